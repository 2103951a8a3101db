"""Models that ``ddpkit`` recipes can build by name, sized to the data set they train on.

Every model is plain torch (the ResNets too, with torchvision's layout; see ``resnet.py``), so
its initial weights depend only on ``torch.manual_seed``: all ranks built with the same seed start
identical.
"""

from __future__ import annotations

import torch
from torch import nn

from ddpkit.errors import UsageError
from ddpkit.recipes.resnet import ResNet

MODELS = ("convnet", "mlp", "mlp-large", "resnet18", "resnet50")


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


def _check_sizes(name: str, num_classes: int, in_channels: int, image_size: int) -> None:
    """Reject sizes that would only fail later inside a layer with a cryptic shape error."""
    for label, value in (("num_classes", num_classes), ("in_channels", in_channels),
                         ("image_size", image_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"model {name!r} needs a positive integer {label}, got {value!r}")
    if name == "convnet" and image_size < 4:
        raise UsageError(
            f"model 'convnet' needs images of at least 4x4 pixels, got {image_size}; "
            "use --model mlp for smaller images"
        )


def build_model(name: str, *, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    """Build model ``name`` for ``in_channels`` x ``image_size`` x ``image_size`` inputs.

    Args:
        name: one of ``MODELS``.
        num_classes: size of the output logits.
        in_channels: channels of the input images (1 for digits/MNIST, 3 for CIFAR-10).
        image_size: side of the square input images.

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
    return ResNet(name, num_classes, in_channels)
