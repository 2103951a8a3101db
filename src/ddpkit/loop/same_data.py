"""Whether every rank reads the same dataset: its length, the indices of its subsets, a sample of its tensors.

``rt.loader`` and ``ddpkit.evaluate``/``predict`` cut one dataset into the ranks' shards, which
is every sample once only when each rank cuts the same dataset. ``ddpkit.init(seed=...)`` seeds
every rank alike until ``rt.setup``, which gives each rank a random stream of its own (dropout
differs between ranks): a ``random_split`` or a ``Subset`` of random indices drawn after it, or
data drawn at random after it, is each rank's own. The shards then overlap and miss samples,
the validation set holds training samples, and the metric says "every sample once" of a dataset
that no rank holds, silently. :func:`check` compares, in one small all-reduce: the length, every
``Subset``'s indices (through ``ConcatDataset`` and nested subsets), the bits of a
``TensorDataset``'s tensors or a dataset's ``data``/``targets`` arrays in memory (an evenly
strided sample of 65,536 to 131,071 elements each, so a large dataset costs a millisecond), summed
and weighted by place (the same rows shuffled on each rank differ), and a hash of the lists a
dataset reads from (``samples``, ``imgs``, ``files``, ``paths``, CIFAR's ``targets``: file names by
their last two parts, an evenly strided 4,096 to 8,191 items), which finds a file list in each host's
own ``os.listdir`` order.
"""

from __future__ import annotations

import hashlib
import inspect
import os
from typing import Any

import torch

from ddpkit.errors import UsageError
from ddpkit.parallel import same_model

_SAMPLE = 1 << 16
"""Elements of a tensor read at most (evenly strided over it): data drawn at random on each rank
differs in every element, so a sample finds it, and a large dataset costs no more than a small one."""


def _sample_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The bits sum of ``tensor`` (a strided sample of fewer than twice :data:`_SAMPLE` elements) and the
    same sum weighted by each element's place, which a shuffle changes (the same rows in each rank's own
    order), as two int64s on the CPU."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() > _SAMPLE:
        flat = flat[:: flat.numel() // _SAMPLE]
    return _sums(same_model.as_integers(flat.cpu()).to(torch.int64))  # (a wider element: its int32 halves)


def _sums(values: torch.Tensor) -> torch.Tensor:
    """The sum of int64 ``values`` and their sum weighted by place, below :data:`_PRIME`, as two int64s."""
    places = torch.arange(1, len(values) + 1, dtype=torch.int64)  # (a sum past int64 wraps alike on every rank)
    return torch.stack([values.sum(), (values * places).sum() % _PRIME])


_PRIME = (1 << 31) - 1
"""The place-weighted sum is kept below it, so the digest of every part (:func:`same_model.compare`) stays small."""


_LISTS = 1 << 12
"""Items of a list read at most (evenly strided over it), each written out in full."""


def _list_sum(value: Any) -> torch.Tensor | None:
    """A hash of a list's items in order (an evenly strided sample of fewer than twice :data:`_LISTS`)
    where they are plain values (file names, ``(path, class)`` pairs, labels), as two int64s; else None."""
    if not isinstance(value, (list, tuple)) or not value:
        return None
    picked = [_plain(item) for item in value[:: max(1, len(value) // _LISTS)]]
    if any(item is _NOT_PLAIN for item in picked):
        return None
    digest = hashlib.blake2b(repr(picked).encode(), digest_size=4).digest()
    return torch.tensor([len(value), int.from_bytes(digest, "little")], dtype=torch.int64)


_NOT_PLAIN = object()


def _plain(item: Any) -> Any:
    """``item`` as the hash takes it: a number (a numpy scalar as Python's) or None as it is, a string or a
    path by its last two parts (a class's folder and the file: the same files under each host's own
    directory are the same data), a tuple or list item by item; :data:`_NOT_PLAIN` for anything else (a
    tensor, an object of the script's)."""
    if isinstance(item, (tuple, list)):
        parts = [_plain(part) for part in item]
        return _NOT_PLAIN if any(part is _NOT_PLAIN for part in parts) else parts
    if isinstance(item, (str, os.PathLike)):
        text = os.fspath(item)
        return os.path.join(os.path.basename(os.path.dirname(text)), os.path.basename(text))
    if isinstance(item, bool) or item is None or isinstance(item, bytes):
        return item
    if isinstance(item, (int, float)):  # (np.float64 is a float whose repr differs by numpy's version)
        return int(item) if isinstance(item, int) else float(item)
    return _NOT_PLAIN


def _tensor_sum(value: Any) -> torch.Tensor | None:
    """The sums of a tensor or a numpy array in memory (:func:`_sample_sum`), else None."""
    if not isinstance(value, torch.Tensor):
        if type(value).__module__ != "numpy" or not hasattr(value, "dtype") or value.dtype.hasobject:
            return None
        if type(value).__name__ == "memmap":  # on disk: a strided sample would read a page an element
            return None
        try:
            value = torch.from_numpy(value)
        except (TypeError, ValueError):  # strings, negative strides, big-endian, datetimes, numpy scalars
            return None
    return _sample_sum(value)


def fingerprint(dataset: Any) -> tuple[list[str], torch.Tensor]:
    """Named int64 parts of ``dataset`` that every rank's copy must share."""
    names: list[str] = ["dataset length"]
    sums: list[torch.Tensor] = [torch.tensor(len(dataset), dtype=torch.int64)]

    def walk(data: Any, where: str) -> None:
        if isinstance(data, torch.utils.data.Subset):
            indices = torch.as_tensor(data.indices, dtype=torch.int64).reshape(-1)
            positions = torch.arange(1, len(indices) + 1, dtype=torch.int64)
            names.extend([f"{where} (a Subset: its indices)", f"{where} (a Subset: the indices' order)"])
            sums.extend([indices.sum(), (indices * positions).sum()])
            walk(data.dataset, f"{where}.dataset")
        elif isinstance(data, torch.utils.data.ConcatDataset):
            for i, part in enumerate(data.datasets):
                walk(part, f"{where}.datasets[{i}]")
        elif isinstance(data, torch.utils.data.TensorDataset):
            for i, tensor in enumerate(data.tensors):
                add([f"{where}.tensors[{i}]", f"{where}.tensors[{i}] (its order)"], _sample_sum(tensor))
        else:
            for attribute in _ATTRIBUTES:
                name = f"{where}.{attribute}"
                found = _tensor_sum(getattr(data, attribute, None)) if attribute in ("data", "targets") else None
                if found is not None:
                    add([name, f"{name} (its order)"], found)
                    continue
                listed = _list_sum(inspect.getattr_static(data, attribute, None))  # (no property of the script's runs)
                if listed is not None:
                    add([f"{name} (its length)", name], listed)

    def add(named: list[str], found: torch.Tensor) -> None:
        names.extend(named)
        sums.extend(found)

    walk(dataset, "dataset")
    return names, torch.stack(sums)


_ATTRIBUTES = ("data", "targets", "samples", "imgs", "files", "paths")
"""A dataset's attributes that hold its samples or what they are read from: arrays and tensors (torchvision's
MNIST and CIFAR ``data``), lists of labels (CIFAR's ``targets``), of ``(path, class)`` (``ImageFolder``'s
``samples`` and ``imgs``) or of file names."""


def check(dataset: Any, what: str, lengths: Any = None) -> None:
    """Raise on every rank, in one line, when ranks hold different map-style ``dataset``\\ s (a collective).

    Args:
        dataset: the dataset every rank was given (a stream is not checked: it has no length).
        what: the call that checks, for the message (``"rt.loader"``).
        lengths: ``rt.loader``'s ``lengths=``, which order the samples alike on every rank only where they agree.
    """
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        return
    names, sums = fingerprint(dataset)
    if lengths is not None:  # every one of them, not a sample
        names += ["lengths=", "lengths= (their order)"]
        sums = torch.cat([sums, _sums(torch.as_tensor(lengths).reshape(-1).to(torch.int64))])
    where = same_model.compare(names, sums)
    if where is not None:
        raise UsageError(
            f"{what}: the dataset differs between ranks ({where}), so the ranks' shards would overlap and miss "
            "samples: split or draw it before rt.setup, which gives each rank a random stream of its own (shuffle "
            "its rows or files there too), or with a generator seeded alike on every rank "
            "(random_split(data, lengths, generator=torch.Generator().manual_seed(0))), and sort a list of "
            "files (os.listdir and glob give each host its own order)"
        )
