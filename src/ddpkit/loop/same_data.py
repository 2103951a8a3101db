"""Whether every rank reads the same dataset: its length, the indices of its subsets, a sample of its tensors.

``rt.loader`` and ``ddpkit.evaluate``/``predict`` cut one dataset into the ranks' shards, which
is every sample once only when each rank cuts the same dataset. ``ddpkit.init(seed=...)`` seeds
every rank alike until ``rt.setup``, which gives each rank a random stream of its own (dropout
differs between ranks): a ``random_split`` or a ``Subset`` of random indices drawn after it, or
data drawn at random after it, is each rank's own. The shards then overlap and miss samples,
the validation set holds training samples, and the metric says "every sample once" of a dataset
that no rank holds, silently. :func:`check` compares, in one small all-reduce: the length, every
``Subset``'s indices (through ``ConcatDataset`` and nested subsets), and the bits of a
``TensorDataset``'s tensors or a dataset's ``data``/``targets`` arrays in memory (an evenly
strided sample of 65,536 to 131,071 elements each, so a large dataset costs a millisecond).
"""

from __future__ import annotations

from typing import Any

import torch

from ddpkit.errors import UsageError
from ddpkit.parallel import same_model

_SAMPLE = 1 << 16
"""Elements of a tensor read at most (evenly strided over it): data drawn at random on each rank
differs in every element, so a sample finds it, and a large dataset costs no more than a small one."""


def _sample_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The bits sum of ``tensor`` (a strided sample of fewer than twice :data:`_SAMPLE` elements), on the CPU."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() > _SAMPLE:
        flat = flat[:: flat.numel() // _SAMPLE]
    return same_model.bits_sum(flat).cpu()


def _tensor_sum(value: Any) -> torch.Tensor | None:
    """The bits sum of a tensor or a numpy array in memory (:func:`_sample_sum`), else None."""
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
                names.append(f"{where}.tensors[{i}]")
                sums.append(_sample_sum(tensor))
        else:
            for attribute in ("data", "targets"):
                found = _tensor_sum(getattr(data, attribute, None))
                if found is not None:
                    names.append(f"{where}.{attribute}")
                    sums.append(found)

    walk(dataset, "dataset")
    return names, torch.stack(sums)


def check(dataset: Any, what: str) -> None:
    """Raise on every rank, in one line, when ranks hold different map-style ``dataset``\\ s (a collective).

    Args:
        dataset: the dataset every rank was given (a stream is not checked: it has no length).
        what: the call that checks, for the message (``"rt.loader"``).
    """
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        return
    where = same_model.compare(*fingerprint(dataset))
    if where is not None:
        raise UsageError(
            f"{what}: the dataset differs between ranks ({where}), so the ranks' shards would overlap and miss "
            "samples: split or draw it before rt.setup, which gives each rank a random stream of its own, or "
            "with a generator seeded alike on every rank "
            "(random_split(data, lengths, generator=torch.Generator().manual_seed(0)))"
        )
