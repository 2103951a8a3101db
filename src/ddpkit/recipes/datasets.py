"""Data sets that ``ddpkit`` recipes can load by name, all held in memory and never downloaded.

``digits`` ships with scikit-learn and ``synthetic`` is generated, so both work offline with no
files; ``mnist`` and ``cifar10`` read the files torchvision would have downloaded, so a cluster
without internet access can still train on them.
"""

from __future__ import annotations

import gzip
import importlib
import pickle
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

try:  # a dependency of ddpkit; an image with CUDA torch alone (make gpu-check) may lack it
    import numpy as np
except ImportError:  # pragma: no cover - tests/test_bench.py's bare interpreter: synthetic data needs none
    np = None  # type: ignore[assignment]
from torch.utils.data import Dataset

from ddpkit.errors import UsageError

DATASETS = ("digits", "mnist", "cifar10", "synthetic", "tokens")
SPLITS = ("train", "test")

_DIGITS_TEST_SIZE = 360
_MNIST_NORM = ((0.1307,), (0.3081,))
_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_IDX_UBYTE_MAGIC = 0x0800  # IDX magic: two zero bytes, type 0x08 (unsigned byte), then ndim.
_CIFAR_NORM = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
_CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR_DIRNAME = "cifar-10-batches-py"
_SYNTHETIC_SEEDS = {"train": 1_000_003, "test": 2_000_003}
_SYNTHETIC_PROJECTION_SEED = 3_000_017  # shared by both splits so test labels follow train's rule
_NUM_CLASSES = 10
TOKEN_VOCAB, TOKEN_LENGTH = 256, 32  # tokens: 32 inputs and 32 next-token targets a sequence
_TOKEN_CHAIN_SEED = 4_000_037


@dataclass(frozen=True)
class DatasetInfo:
    """A loaded split plus the sizes a model needs to be built for it."""

    dataset: Dataset
    num_classes: int
    in_channels: int
    image_size: int
    name: str


class InMemoryDataset(Dataset):
    """Images and labels held as whole tensors, so indexing is cheap and workers need no files.

    ``uint8`` images stay raw (4x less memory for CIFAR-10) and are scaled to [0, 1] and
    normalised per channel with ``mean``/``std`` as each item is read; float images are returned
    unchanged.
    """

    _draws_nothing = True  # its reads need no keyed generators (:func:`ddpkit.loop.loader.draws_nothing`)

    def __init__(
        self,
        images: torch.Tensor,
        targets: torch.Tensor,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
    ) -> None:
        if len(images) != len(targets):
            raise ValueError(f"{len(images)} images but {len(targets)} targets")
        self.images = images
        self.targets = targets.long()
        self._mean = None if mean is None else torch.tensor(mean).view(-1, 1, 1)
        self._std = None if std is None else torch.tensor(std).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[index]
        if x.dtype == torch.uint8:
            x = x.float().div_(255.0)
            if self._mean is not None:
                x = x.sub_(self._mean).div_(self._std)
        return x, self.targets[index]


# --- digits -----------------------------------------------------------------------------------


def _load_digits(split: str) -> DatasetInfo:
    """scikit-learn's 8x8 digits with a split fixed forever, so accuracies stay comparable."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UsageError("--data digits needs scikit-learn; pip install scikit-learn") from None
    bunch = load_digits()
    images = torch.from_numpy(bunch.images).float().div_(16.0).unsqueeze(1)
    targets = torch.from_numpy(bunch.target).long()
    # Legacy RandomState streams are frozen by numpy, so this permutation never changes.
    perm = torch.from_numpy(np.random.RandomState(0).permutation(len(targets)))
    train_idx, test_idx = perm[:-_DIGITS_TEST_SIZE], perm[-_DIGITS_TEST_SIZE:]
    train = images[train_idx]
    mean, std = train.mean(), train.std()
    idx = train_idx if split == "train" else test_idx
    data = InMemoryDataset((images[idx] - mean) / std, targets[idx])
    return DatasetInfo(data, _NUM_CLASSES, 1, 8, "digits")


# --- MNIST (IDX files) ------------------------------------------------------------------------


def _read_bytes(path: Path) -> bytes:
    """Read a file, gunzipping ``.gz``, turning I/O and gzip failures into one-line errors."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise UsageError(f"cannot read {path}: {exc}; re-download it") from None


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    """Parse an unsigned-byte IDX file of ``ndim`` dimensions (big-endian header)."""
    raw = _read_bytes(path)
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise UsageError(f"{path} is too short to be an IDX file; re-download it")
    (magic,) = struct.unpack(">I", raw[:4])
    if magic != _IDX_UBYTE_MAGIC + ndim:
        raise UsageError(
            f"{path} has magic number 0x{magic:08x}, expected "
            f"0x{_IDX_UBYTE_MAGIC + ndim:08x} (IDX, unsigned bytes, {ndim}-D); "
            "is it the right MNIST file?"
        )
    dims = struct.unpack(f">{ndim}I", raw[4:header_len])
    expected = int(np.prod(dims))
    if len(raw) - header_len != expected:
        raise UsageError(
            f"{path} header says {dims} = {expected} bytes but it holds {len(raw) - header_len}; re-download it"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header_len).reshape(dims).copy()


def _find_mnist_file(root: Path, filename: str) -> Path:
    """Look where torchvision and people usually put MNIST, plain or gzipped."""
    folders = (root, root / "MNIST" / "raw", root / "raw")
    for folder in folders:
        for candidate in (folder / filename, folder / f"{filename}.gz"):
            if candidate.is_file():
                return candidate
    looked = ", ".join(str(f) for f in folders)
    raise UsageError(
        f"MNIST file {filename}[.gz] not found in {looked}; put torchvision's "
        "MNIST raw files there (nothing is downloaded)"
    )


def _load_mnist(root: Path, split: str) -> DatasetInfo:
    """Load one MNIST split from IDX files, validating the two files agree."""
    images_name, labels_name = _MNIST_FILES[split]
    images_path = _find_mnist_file(root, images_name)
    labels_path = _find_mnist_file(root, labels_name)
    images = _read_idx(images_path, 3)
    labels = _read_idx(labels_path, 1)
    if len(images) != len(labels):
        raise UsageError(
            f"{images_path} holds {len(images)} images but {labels_path} holds "
            f"{len(labels)} labels; the files do not belong together"
        )
    if images.shape[1] != images.shape[2]:
        raise UsageError(
            f"{images_path} holds {images.shape[1]}x{images.shape[2]} images; only square images are supported"
        )
    _check_labels(labels, labels_path)
    data = InMemoryDataset(torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels), *_MNIST_NORM)
    return DatasetInfo(data, _NUM_CLASSES, 1, int(images.shape[1]), "mnist")


# --- CIFAR-10 (python pickles) ----------------------------------------------------------------


def _numpy_global(module: str, name: str) -> Any:
    """Return the numpy callable a pickled array legitimately needs, or None if not allowed."""
    if (module, name) in {("numpy", "ndarray"), ("numpy", "dtype")}:
        return getattr(np, name)
    if module in {"numpy.core.multiarray", "numpy._core.multiarray"} and name in {"_reconstruct", "scalar"}:
        return getattr(_numpy_core_module("multiarray"), name)
    if module in {"numpy.core.numeric", "numpy._core.numeric"} and name == "_frombuffer":
        return _numpy_core_module("numeric")._frombuffer  # pickle protocol 5 arrays
    if (module, name) == ("_codecs", "encode"):
        # Python 3 writes bytes this way at protocol 2; it only converts str to bytes.
        return importlib.import_module("_codecs").encode
    return None


def _numpy_core_module(name: str) -> Any:
    """Import numpy's core submodule without the deprecation warning numpy 2 gives ``core``."""
    try:
        return importlib.import_module(f"numpy._core.{name}")
    except ImportError:  # numpy < 1.26
        return importlib.import_module(f"numpy.core.{name}")


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that can build numpy arrays and nothing else, so a planted file runs no code."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file, encoding="bytes")
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        """Resolve only allow-listed numpy globals; anything else is refused."""
        found = _numpy_global(module, name)
        if found is None:
            raise UsageError(
                f"{self._path} refers to {module}.{name}, which a CIFAR-10 batch "
                "never needs; refusing to load it (is the file genuine?)"
            )
        return found


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Load one CIFAR-10 batch pickle safely and check it holds N x 3072 bytes and N labels."""
    try:
        with open(path, "rb") as f:
            batch = _NumpyOnlyUnpickler(f, path).load()
    except UsageError:
        raise
    except Exception as exc:  # unpickling corrupt data can raise almost anything
        raise UsageError(f"cannot read CIFAR-10 batch {path}: {exc!r}; re-download it") from None
    if not isinstance(batch, dict):
        raise UsageError(f"{path} is not a CIFAR-10 batch (holds {type(batch).__name__})")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if not (
        isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2 and data.shape[1] == 3 * 32 * 32
    ):
        raise UsageError(f"{path} has no uint8 'data' array of shape N x 3072; re-download it")
    try:
        labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError):
        raise UsageError(f"{path} has no list of integer 'labels'; re-download it") from None
    if len(labels) != len(data):
        raise UsageError(f"{path} holds {len(data)} images but {len(labels)} labels")
    _check_labels(labels, path)
    return data, labels


def _load_cifar10(root: Path, split: str) -> DatasetInfo:
    """Load one CIFAR-10 split from torchvision's ``cifar-10-batches-py`` folder."""
    folder = root / _CIFAR_DIRNAME if (root / _CIFAR_DIRNAME).is_dir() else root
    if split == "train":
        paths = [folder / n for n in _CIFAR_TRAIN_FILES if (folder / n).is_file()]
        required = _CIFAR_TRAIN_FILES[0]
    else:
        paths = [folder / "test_batch"] if (folder / "test_batch").is_file() else []
        required = "test_batch"
    if not paths or paths[0].name != required:
        raise UsageError(
            f"CIFAR-10 file {required} not found in {folder}; unpack torchvision's "
            f"cifar-10-python.tar.gz in {root} (nothing is downloaded)"
        )
    batches = [_read_cifar_batch(p) for p in paths]
    images = np.concatenate([d for d, _ in batches]).reshape(-1, 3, 32, 32)
    labels = np.concatenate([lab for _, lab in batches])
    data = InMemoryDataset(torch.from_numpy(images), torch.from_numpy(labels), *_CIFAR_NORM)
    return DatasetInfo(data, _NUM_CLASSES, 3, 32, "cifar10")


# --- synthetic --------------------------------------------------------------------------------


def _load_synthetic(split: str, size: int, image_size: int | None) -> DatasetInfo:
    """Seeded random images whose label is the argmax of a fixed linear map, so it is learnable."""
    side = 32 if image_size is None else image_size
    for label, value in (("synthetic_size", size), ("image_size", side)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"--data synthetic needs a positive integer {label}, got {value!r}")
    images = torch.randn(size, 3, side, side, generator=torch.Generator().manual_seed(_SYNTHETIC_SEEDS[split]))
    projection = torch.randn(
        3 * side * side, _NUM_CLASSES, generator=torch.Generator().manual_seed(_SYNTHETIC_PROJECTION_SEED)
    )
    targets = (images.reshape(size, -1) @ projection).argmax(dim=1)
    return DatasetInfo(InMemoryDataset(images, targets), _NUM_CLASSES, 3, side, "synthetic")


class TokenSequences(Dataset):
    """Token sequences ``[N, T + 1]``; item ``i`` is ``(tokens[:-1], tokens[1:])``: inputs and next tokens."""

    _draws_nothing = True

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        sequence = self.tokens[index]
        return sequence[:-1], sequence[1:]


def _load_tokens(split: str, size: int) -> DatasetInfo:
    """Sequences of a fixed random Markov chain over 256 tokens (8 successors each, random
    weights): learnable down to the chain's entropy, about 1.8 nats, never to zero."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise UsageError(f"--data tokens needs a positive integer synthetic_size, got {size!r}")
    chain_gen = torch.Generator().manual_seed(_TOKEN_CHAIN_SEED)
    successors = torch.rand(TOKEN_VOCAB, TOKEN_VOCAB, generator=chain_gen).argsort(dim=1)[:, :8]
    weights = torch.rand(TOKEN_VOCAB, 8, generator=chain_gen) + 0.1
    chain = torch.zeros(TOKEN_VOCAB, TOKEN_VOCAB).scatter_(1, successors, weights)
    chain /= chain.sum(dim=1, keepdim=True)
    gen = torch.Generator().manual_seed(_SYNTHETIC_SEEDS[split])
    tokens = [torch.randint(TOKEN_VOCAB, (size,), generator=gen)]
    for _ in range(TOKEN_LENGTH):
        tokens.append(torch.multinomial(chain[tokens[-1]], 1, generator=gen).squeeze(1))
    return DatasetInfo(TokenSequences(torch.stack(tokens, dim=1)), TOKEN_VOCAB, 1, TOKEN_LENGTH, "tokens")


# --- shared -----------------------------------------------------------------------------------


def _check_labels(labels: np.ndarray, path: Path) -> None:
    """Catch out-of-range labels now rather than as a CUDA assert deep inside the loss."""
    if len(labels) and (labels.min() < 0 or labels.max() >= _NUM_CLASSES):
        raise UsageError(
            f"{path} has labels outside 0..{_NUM_CLASSES - 1} (min {labels.min()}, max {labels.max()}); re-download it"
        )


def _data_root(name: str, data_dir: str | Path | None) -> Path:
    """Check that a file-backed data set was given an existing directory."""
    if data_dir is None:
        example = "train-images-idx3-ubyte" if name == "mnist" else f"{_CIFAR_DIRNAME}/data_batch_1"
        label = "MNIST" if name == "mnist" else "CIFAR-10"
        raise UsageError(
            f"--data {name} needs --data-dir DIR holding torchvision's {label} "
            f"files ({example}, ...); nothing is downloaded"
        )
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise UsageError(
            f"--data-dir {root} does not exist or is not a directory; point it at the folder holding the {name} files"
        )
    return root


def load_dataset(
    name: str,
    split: str = "train",
    data_dir: str | Path | None = None,
    *,
    synthetic_size: int = 2048,
    image_size: int | None = None,
) -> DatasetInfo:
    """Load split ``split`` of data set ``name`` into memory.

    Args:
        name: one of ``DATASETS``.
        split: ``"train"`` or ``"test"``.
        data_dir: folder with torchvision's files; needed by ``mnist`` and ``cifar10`` only.
        synthetic_size: number of samples ``synthetic`` (and ``tokens``) generates.
        image_size: side of ``synthetic`` images (default 32); for other data sets it may only
            repeat their native size, as nothing is resized.

    Returns:
        The data set, whose items are ``(float32 [C, H, W], int64 scalar)`` (``tokens``: ``(int64
        [T], int64 [T])``, inputs and next tokens), and its sizes.

    Raises:
        UsageError: unknown name or split, missing or corrupt files, bad sizes.
    """
    if name not in DATASETS:
        raise UsageError(f"unknown data set {name!r}; choose one of: {', '.join(DATASETS)}")
    if split not in SPLITS:
        raise UsageError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    if name == "synthetic":
        return _load_synthetic(split, synthetic_size, image_size)
    if name == "tokens":
        return _load_tokens(split, synthetic_size)
    if np is None:
        raise UsageError(f"data set {name!r} is read through numpy, which is not installed; pip install numpy")
    if name == "digits":
        info = _load_digits(split)
    elif name == "mnist":
        info = _load_mnist(_data_root(name, data_dir), split)
    else:
        info = _load_cifar10(_data_root(name, data_dir), split)
    if image_size is not None and image_size != info.image_size:
        raise UsageError(
            f"--data {name} has {info.image_size}x{info.image_size} images and "
            f"nothing is resized; drop --image-size {image_size} (it is for synthetic)"
        )
    return info
