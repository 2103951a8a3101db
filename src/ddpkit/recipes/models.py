"""Models that ``ddpkit`` recipes can build by name, sized to the data set they train on.

Every model is plain torch (the ResNets too, with torchvision's layout; see ``resnet.py``), so
its initial weights depend only on ``torch.manual_seed``: all ranks built with the same seed start
identical.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ddpkit.errors import UsageError
from ddpkit.recipes.resnet import ResNet

MODELS = ("convnet", "mlp", "mlp-large", "resnet18", "resnet50", "tiny-lm")
"""Every model ``build_model`` makes; ``tiny-lm`` reads token sequences (``--data tokens``), the rest images."""


class _ConvNet(nn.Module):
    """The small two-block CNN from MNIST tutorials: quick to train, has BatchNorm buffers."""

    def __init__(self, num_classes: int, in_channels: int, image_size: int) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(in_channels, 16, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2),
        )
        # Two floor-halving pools leave image_size // 4 pixels a side.
        self.fc = nn.Linear(32 * (image_size // 4) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map a batch ``[N, C, H, W]`` to logits ``[N, num_classes]``."""
        out = self.layer2(self.layer1(x))
        return self.fc(out.reshape(out.size(0), -1))


def _mlp(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    """A BatchNorm-free baseline, useful to tell BatchNorm issues from DDP issues."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_channels * image_size**2, 256),
        nn.ReLU(),
        nn.Linear(256, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def _mlp_large(num_classes: int, in_channels: int, image_size: int, width: int = 4096) -> nn.Module:
    """About 80M parameters on 3x32x32 inputs: large enough for sharding (fsdp) to matter."""
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(in_channels * image_size**2, width), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, num_classes))


class TinyLM(nn.Module):
    """A small causal transformer language model: token and position embeddings, pre-norm
    encoder blocks under a causal mask, a linear head. ``forward`` maps tokens ``[N, T]`` to
    logits ``[N, T, vocab]`` (``[N, vocab, T]`` with ``classes_first=True``, the layout
    ``F.cross_entropy`` takes with targets ``[N, T]``).

    The default size is ``examples/tiny_lm.py``'s; ``ddpkit bench --model tiny-lm`` builds it
    with 256 wide, 7 blocks: 5.6M parameters.
    """

    def __init__(
        self, vocab: int, length: int, width: int = 64, layers: int = 2, heads: int = 4, classes_first: bool = False
    ) -> None:
        super().__init__()
        self.classes_first = classes_first
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(length, width))
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits at every position of ``tokens`` ``[N, T]``."""
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        hidden = self.blocks(self.embed(tokens) + self.position[: tokens.shape[1]], mask=causal, is_causal=True)
        logits = self.head(hidden)
        return logits.transpose(1, 2) if self.classes_first else logits


class _UnderAutocast:
    """A replica called under autocast of ``dtype`` on ``device_type``, in whatever thread calls it."""

    def __init__(self, replica: Any, device_type: str, dtype: torch.dtype) -> None:
        self.replica, self.device_type, self.dtype = replica, device_type, dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.replica(*args, **kwargs)


class DataParallel(nn.DataParallel):
    """torch's ``DataParallel`` (the seeds' one-process, several-GPU baseline) whose replicas run under
    the caller's autocast dtype.

    torch's ``parallel_apply`` enters autocast again in each replica's thread, where the dtype is that
    thread's own (it is thread-local): float16 on CUDA. Under bf16 autocast every replica ran float16,
    which no loss scaling guards. Here each replica enters the caller's dtype itself.
    """

    def parallel_apply(self, replicas: Any, inputs: Any, kwargs: Any) -> Any:
        """torch's, each replica under the calling thread's CUDA autocast dtype where autocast is on."""
        if torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")
            replicas = [_UnderAutocast(replica, "cuda", dtype) for replica in replicas]
        return super().parallel_apply(replicas, inputs, kwargs)


def _check_sizes(name: str, num_classes: int, in_channels: int, image_size: int) -> None:
    """Reject sizes that would only fail later inside a layer with a cryptic shape error."""
    for label, value in (("num_classes", num_classes), ("in_channels", in_channels), ("image_size", image_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"model {name!r} needs a positive integer {label}, got {value!r}")
    if name == "convnet" and image_size < 4:
        raise UsageError(
            f"model 'convnet' needs images of at least 4x4 pixels, got {image_size}; use --model mlp for smaller images"
        )


def build_model(name: str, *, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    """Build model ``name`` for ``in_channels`` x ``image_size`` x ``image_size`` inputs.

    Args:
        name: one of ``MODELS``.
        num_classes: size of the output logits (``tiny-lm``: the vocabulary).
        in_channels: channels of the input images (1 for digits/MNIST, 3 for CIFAR-10).
        image_size: side of the square input images (``tiny-lm``: the sequence length).

    Returns:
        A freshly initialised module in training mode, on the CPU.

    Raises:
        UsageError: unknown name or bad sizes.
    """
    if name not in MODELS:
        raise UsageError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")
    _check_sizes(name, num_classes, in_channels, image_size)
    if name == "convnet":
        return _ConvNet(num_classes, in_channels, image_size)
    if name == "mlp":
        return _mlp(num_classes, in_channels, image_size)
    if name == "mlp-large":
        return _mlp_large(num_classes, in_channels, image_size)
    if name == "tiny-lm":  # num_classes: the vocabulary; image_size: the sequence length
        return TinyLM(num_classes, image_size, width=256, layers=7, heads=8, classes_first=True)
    return ResNet(name, num_classes, in_channels)
