"""Recipes: models build by name with the right shapes, data sets load (safely) from disk."""

from __future__ import annotations

import gzip
import os
import pickle
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from ddpkit.errors import UsageError
from ddpkit.recipes.datasets import DATASETS, DatasetInfo, load_dataset
from ddpkit.recipes.models import MODELS, build_model

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
CIFAR_MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
CIFAR_STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)


# --- tiny on-disk fixtures --------------------------------------------------------------------


def _idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
    """Encode ``array`` (uint8) as an IDX file: magic 0x0800+ndim, big-endian dims, data."""
    magic = 0x0800 + array.ndim if magic is None else magic
    header = struct.pack(f">I{array.ndim}I", magic, *array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write(path: Path, payload: bytes, gz: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)
    return path


def _write_mnist(folder: Path, gz: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Write 5 train and 3 test 28x28 images with labels; return what was written."""
    rng = np.random.RandomState(42)
    written = {}
    for split, prefix, n in (("train", "train", 5), ("test", "t10k", 3)):
        images = rng.randint(0, 256, size=(n, 28, 28)).astype(np.uint8)
        labels = rng.randint(0, 10, size=n).astype(np.uint8)
        _write(folder / f"{prefix}-images-idx3-ubyte", _idx_bytes(images), gz)
        _write(folder / f"{prefix}-labels-idx1-ubyte", _idx_bytes(labels), gz)
        written[split] = (images, labels)
    return written


def _write_cifar_batch(path: Path, n: int, seed: int, protocol: int = 4) -> tuple[np.ndarray, list]:
    rng = np.random.RandomState(seed)
    data = rng.randint(0, 256, size=(n, 3072)).astype(np.uint8)
    labels = [int(v) for v in rng.randint(0, 10, size=n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump({b"batch_label": b"tiny", b"data": data, b"labels": labels}, f, protocol=protocol)
    return data, labels


class _Evil:
    """Runs a shell command when unpickled by a trusting loader."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _EvilExec(_Evil):
    def __reduce__(self):
        return (exec, (f"import os; os.system({self.command!r})",))


# --- models -----------------------------------------------------------------------------------


IMAGE_MODELS = [name for name in MODELS if name != "tiny-lm"]


@pytest.mark.parametrize("name", IMAGE_MODELS)
@pytest.mark.parametrize("channels,size", [(1, 8), (3, 32)], ids=["digits", "synthetic"])
def test_model_forward_shape(name, channels, size):
    torch.manual_seed(0)
    model = build_model(name, num_classes=10, in_channels=channels, image_size=size)
    out = model(torch.randn(2, channels, size, size))
    assert out.shape == (2, 10) and out.dtype == torch.float32


@pytest.mark.parametrize("name", MODELS)
def test_same_seed_gives_same_initial_weights(name):

    def build(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return build_model(name, num_classes=10, in_channels=1, image_size=8).state_dict()

    first, again, other = build(7), build(7), build(8)
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first if first[k].is_floating_point())


def test_tiny_lm_reads_token_sequences_and_has_five_million_parameters():
    info = load_dataset("tokens", "train", synthetic_size=64)
    inputs, targets = info.dataset[3]
    assert inputs.shape == targets.shape == (32,) and torch.equal(inputs[1:], targets[:-1])
    assert info.num_classes == 256 and int(inputs.max()) < 256
    again = load_dataset("tokens", "train", synthetic_size=64)
    assert torch.equal(again.dataset.tokens, info.dataset.tokens)  # seeded: the same every time
    assert not torch.equal(load_dataset("tokens", "test", synthetic_size=64).dataset.tokens, info.dataset.tokens)
    model = build_model("tiny-lm", num_classes=info.num_classes, in_channels=1, image_size=info.image_size)
    assert sum(p.numel() for p in model.parameters()) >= 5_000_000
    batch = torch.stack([inputs, info.dataset[4][0]])
    logits = model(batch)
    assert logits.shape == (2, 256, 32)  # classes first: F.cross_entropy(logits, targets [N, T])
    assert torch.nn.functional.cross_entropy(logits, torch.stack([targets, info.dataset[4][1]])).ndim == 0


def test_convnet_layout_matches_the_classic_mnist_convnet():
    model = build_model("convnet", num_classes=10, in_channels=1, image_size=28)
    assert model.layer1[0].kernel_size == (5, 5) and model.layer1[0].padding == (2, 2)
    assert isinstance(model.layer1[1], torch.nn.BatchNorm2d)
    assert model.layer2[0].out_channels == 32
    assert model.fc.in_features == 32 * 7 * 7


def test_mlp_has_no_batchnorm():
    model = build_model("mlp", num_classes=10, in_channels=1, image_size=8)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert model(torch.randn(1, 1, 8, 8)).shape == (1, 10)


@pytest.mark.parametrize(
    "name,params,keys",
    [
        ("resnet18", 11_689_512, ["layer2.0.downsample.0.weight", "layer4.1.bn2.running_var"]),
        ("resnet50", 25_557_032, ["layer1.0.downsample.1.weight", "layer4.2.conv3.weight"]),
    ],
)
def test_resnets_match_torchvision_without_needing_it(name, params, keys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # any import of torchvision would fail
    model = build_model(name, num_classes=1000, in_channels=3, image_size=224)
    # torchvision's published parameter counts for these architectures, and its state-dict names
    assert sum(p.numel() for p in model.parameters()) == params
    state = model.state_dict()
    assert all(key in state for key in ["conv1.weight", "bn1.num_batches_tracked", "fc.bias", *keys])
    assert state["fc.weight"].shape == (1000, 512 if name == "resnet18" else 2048)


def test_unknown_model_lists_choices():
    with pytest.raises(UsageError, match="unknown model 'vgg'.*convnet, mlp, mlp-large, resnet18, resnet50"):
        build_model("vgg", num_classes=10, in_channels=1, image_size=8)


def test_convnet_rejects_images_too_small():
    with pytest.raises(UsageError, match="at least 4x4"):
        build_model("convnet", num_classes=10, in_channels=1, image_size=2)


# --- digits and synthetic ---------------------------------------------------------------------


@pytest.mark.parametrize("name,shape", [("digits", (1, 8, 8)), ("synthetic", (3, 32, 32))])
@pytest.mark.parametrize("split", ["train", "test"])
def test_item_shapes_and_dtypes(name, shape, split):
    info = load_dataset(name, split, synthetic_size=64)
    assert isinstance(info, DatasetInfo) and info.name == name
    assert (info.in_channels, info.image_size, info.num_classes) == (shape[0], shape[1], 10)
    x, y = info.dataset[0]
    assert x.shape == shape and x.dtype == torch.float32
    assert y.shape == () and y.dtype == torch.int64
    assert info.dataset.targets.dtype == torch.int64
    xb, yb = next(iter(DataLoader(info.dataset, batch_size=4)))
    assert xb.shape == (4, *shape) and yb.shape == (4,) and yb.dtype == torch.int64


def test_digits_split_is_fixed_and_disjoint():
    train, test = load_dataset("digits", "train"), load_dataset("digits", "test")
    assert (len(train.dataset), len(test.dataset)) == (1437, 360)
    # Pinned so that a change of split (which would break comparisons across runs) fails here.
    assert train.dataset.targets[:10].tolist() == [2, 8, 2, 6, 6, 7, 1, 9, 8, 5]
    assert test.dataset.targets[:10].tolist() == [7, 9, 4, 7, 0, 2, 6, 1, 3, 1]
    again = load_dataset("digits", "train")
    assert torch.equal(train.dataset.images, again.dataset.images)
    train_rows = {row.numpy().tobytes() for row in train.dataset.images}
    test_rows = {row.numpy().tobytes() for row in test.dataset.images}
    assert not train_rows & test_rows and len(train_rows | test_rows) == 1797  # digits are unique
    assert abs(train.dataset.images.mean().item()) < 1e-4
    assert abs(train.dataset.images.std().item() - 1) < 1e-4


def test_synthetic_is_deterministic_learnable_and_split_specific():
    train = load_dataset("synthetic", "train", synthetic_size=2048, image_size=4)
    again = load_dataset("synthetic", "train", synthetic_size=2048, image_size=4)
    test = load_dataset("synthetic", "test", synthetic_size=2048, image_size=4)
    assert train.image_size == 4 and train.dataset[0][0].shape == (3, 4, 4)
    assert len(train.dataset) == 2048
    assert torch.equal(train.dataset.images, again.dataset.images)
    assert torch.equal(train.dataset.targets, again.dataset.targets)
    assert not torch.equal(train.dataset.images, test.dataset.images)
    assert len(train.dataset.targets.unique()) >= 8  # all classes (nearly) present
    # Labels come from one linear rule shared by both splits: least squares on train fits test.
    x_train = train.dataset.images.reshape(2048, -1)
    onehot = torch.nn.functional.one_hot(train.dataset.targets, 10).float()
    weights = torch.linalg.lstsq(x_train, onehot).solution
    predicted = (test.dataset.images.reshape(2048, -1) @ weights).argmax(1)
    assert (predicted == test.dataset.targets).float().mean() > 0.6  # ~0.79; chance is 0.1


def test_image_size_applies_only_to_synthetic():
    assert load_dataset("digits", image_size=8).image_size == 8
    with pytest.raises(UsageError, match="nothing is resized"):
        load_dataset("digits", image_size=32)


# --- MNIST ------------------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("where", ["", "MNIST/raw", "raw"])
def test_mnist_idx_files_load(tmp_path, where, gz):
    written = _write_mnist(tmp_path / where, gz=gz)
    for split, (images, labels) in written.items():
        info = load_dataset("mnist", split, str(tmp_path))
        assert (info.in_channels, info.image_size, info.num_classes) == (1, 28, 10)
        assert len(info.dataset) == len(images)
        assert info.dataset.targets.tolist() == labels.tolist()
        x, y = info.dataset[len(images) - 1]
        assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
        expected = (torch.from_numpy(images[-1]).float() / 255 - MNIST_MEAN) / MNIST_STD
        torch.testing.assert_close(x[0], expected)


def test_mnist_wrong_magic_names_the_file(tmp_path):
    _write_mnist(tmp_path)
    bad = _idx_bytes(np.zeros((5, 28, 28), np.uint8), magic=0x0801)
    _write(tmp_path / "train-images-idx3-ubyte", bad)
    with pytest.raises(UsageError, match=r"train-images-idx3-ubyte has magic number 0x00000801"):
        load_dataset("mnist", "train", str(tmp_path))


def test_mnist_count_mismatch_and_truncation(tmp_path):
    _write_mnist(tmp_path)
    _write(tmp_path / "t10k-labels-idx1-ubyte", _idx_bytes(np.zeros(4, np.uint8)))
    with pytest.raises(UsageError, match="3 images but .*t10k-labels-idx1-ubyte holds 4 labels"):
        load_dataset("mnist", "test", str(tmp_path))
    truncated = _idx_bytes(np.zeros((5, 28, 28), np.uint8))[:-10]
    _write(tmp_path / "train-images-idx3-ubyte", truncated)
    with pytest.raises(UsageError, match="train-images-idx3-ubyte header says"):
        load_dataset("mnist", "train", str(tmp_path))


def test_mnist_missing_dir_and_files(tmp_path):
    with pytest.raises(UsageError, match=r"--data mnist needs --data-dir DIR .*nothing is downloaded"):
        load_dataset("mnist")
    with pytest.raises(UsageError, match="does not exist"):
        load_dataset("mnist", data_dir=str(tmp_path / "nope"))
    with pytest.raises(UsageError, match=r"train-images-idx3-ubyte\[\.gz\] not found"):
        load_dataset("mnist", data_dir=str(tmp_path))


# --- CIFAR-10 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar_pickles_load(tmp_path, protocol):
    folder = tmp_path / "cifar-10-batches-py"
    data1, labels1 = _write_cifar_batch(folder / "data_batch_1", 4, seed=1, protocol=protocol)
    data2, labels2 = _write_cifar_batch(folder / "data_batch_2", 3, seed=2, protocol=protocol)
    test_data, test_labels = _write_cifar_batch(folder / "test_batch", 2, seed=3, protocol=protocol)
    train = load_dataset("cifar10", "train", str(tmp_path))
    assert (train.in_channels, train.image_size, train.num_classes) == (3, 32, 10)
    assert train.dataset.targets.tolist() == labels1 + labels2
    x, y = train.dataset[4]  # first image of data_batch_2
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y.item() == labels2[0]
    raw = torch.from_numpy(data2[0]).float().view(3, 32, 32) / 255
    torch.testing.assert_close(x, (raw - CIFAR_MEAN) / CIFAR_STD)
    test = load_dataset("cifar10", "test", str(folder))  # the batches folder itself works too
    assert test.dataset.targets.tolist() == test_labels and len(test.dataset) == 2


@pytest.mark.parametrize("evil", [_Evil, _EvilExec])
def test_malicious_cifar_pickle_is_refused_and_runs_nothing(tmp_path, evil):
    marker = tmp_path / "hacked"
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({b"data": evil(f"echo hacked > {marker}"), b"labels": [0]}, f)
    with pytest.raises(UsageError, match="test_batch refers to .*refusing to load"):
        load_dataset("cifar10", "test", str(tmp_path))
    assert not marker.exists()


def test_cifar_missing_and_corrupt_files(tmp_path):
    with pytest.raises(UsageError, match=r"--data cifar10 needs --data-dir DIR"):
        load_dataset("cifar10", "train")
    with pytest.raises(UsageError, match="CIFAR-10 file data_batch_1 not found"):
        load_dataset("cifar10", "train", str(tmp_path))
    folder = tmp_path / "cifar-10-batches-py"
    _write_cifar_batch(folder / "data_batch_2", 2, seed=0)
    with pytest.raises(UsageError, match="data_batch_1 not found"):
        load_dataset("cifar10", "train", str(tmp_path))
    (folder / "test_batch").write_bytes(b"not a pickle")
    with pytest.raises(UsageError, match="cannot read CIFAR-10 batch .*test_batch"):
        load_dataset("cifar10", "test", str(tmp_path))


# --- bad names --------------------------------------------------------------------------------


def test_unknown_dataset_and_split():
    with pytest.raises(UsageError, match="unknown data set 'imagenet'.*" + ", ".join(DATASETS)):
        load_dataset("imagenet")
    with pytest.raises(UsageError, match="unknown split 'val'.*train, test"):
        load_dataset("digits", "val")


def test_a_replica_called_in_another_thread_runs_under_the_callers_autocast_dtype():
    """DataParallel calls each replica in a thread of its own, where autocast's dtype is that thread's
    (torch keeps it per thread): under bf16 the replicas ran float16 on CUDA. Here on the CPU, whose
    autocast is the same kind of state."""
    import threading

    from ddpkit.recipes.models import _UnderAutocast

    linear = torch.nn.Linear(4, 4)
    found: dict[str, torch.dtype] = {}

    def in_a_thread(name: str, call) -> None:
        worker = threading.Thread(target=lambda: found.__setitem__(name, call(torch.randn(2, 4)).dtype))
        worker.start()
        worker.join()

    with torch.autocast("cpu", dtype=torch.float16):
        in_a_thread("plain", lambda x: linear(x))  # the caller's autocast is not the thread's
        in_a_thread("wrapped", _UnderAutocast(linear, "cpu", torch.float16))
    assert found == {"plain": torch.float32, "wrapped": torch.float16}
