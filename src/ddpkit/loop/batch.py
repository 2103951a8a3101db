"""Batches as nested structures of tensors: map over them, join them, empty them, move them.

A batch is what a ``collate_fn`` makes: tensors, or dicts (and other mappings, such as Hugging Face's
``BatchEncoding``, which keep their type), lists, tuples and namedtuples of them.
The loaders (:mod:`ddpkit.loop.loader`, :mod:`ddpkit.loop.streams`) and evaluation
(:mod:`ddpkit.loop.evaluate`) handle them through these functions only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ddpkit._tensors import remapped, resequenced


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any, *, strict: bool = False) -> Any:
    """Apply ``fn`` to every tensor of a (nested) batch: tensors, dicts and other mappings, lists, tuples,
    namedtuples.

    Other leaves come back unchanged, or raise ``TypeError`` with ``strict=True``.
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return remapped(batch, {key: map_tensors(fn, value, strict=strict) for key, value in batch.items()})
    if isinstance(batch, (list, tuple)):
        mapped = [map_tensors(fn, value, strict=strict) for value in batch]
        return resequenced(batch, mapped)
    if strict:
        raise TypeError(type(batch).__name__)
    return batch


def concat_batches(batches: list[Any]) -> Any:
    """Join collated batches along the first dimension (tensors, dicts, tuples, lists of values)."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches)
    if isinstance(first, Mapping):
        return remapped(first, {key: concat_batches([b[key] for b in batches]) for key in first})
    if isinstance(first, (list, tuple)):
        per_sample = not hasattr(first, "_fields")  # a namedtuple's fields are not samples
        if per_sample and all(not isinstance(v, (torch.Tensor, dict, list, tuple)) for b in batches for v in b):
            return type(first)([v for b in batches for v in b])  # a per-sample list (strings)
        joined = [concat_batches([b[i] for b in batches]) for i in range(len(first))]
        return resequenced(first, joined)
    raise TypeError(f"cannot join batches of {type(first).__name__} from several workers")


def zero_rows(batch: Any) -> Any:
    """The batch with no rows: its structure for a rank whose share of a batch is empty."""
    return map_tensors(lambda t: t[:0], batch)


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``; non-blocking from pinned memory."""
    return map_tensors(lambda t: t.to(device, non_blocking=device.type == "cuda"), batch)
