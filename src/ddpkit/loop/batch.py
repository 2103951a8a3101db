"""Batches as nested structures of tensors: map over them, join them, empty them, move them.

A batch is what a ``collate_fn`` makes: tensors, or dicts (and other mappings, such as Hugging Face's
``BatchEncoding``, which keep their type), lists, tuples, namedtuples and dataclasses of them.
The loaders (:mod:`ddpkit.loop.loader`, :mod:`ddpkit.loop.streams`) and evaluation
(:mod:`ddpkit.loop.evaluate`) handle them through these functions only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ddpkit._tensors import init_fields, remapped, replaced, resequenced


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any, *, strict: bool = False) -> Any:
    """Apply ``fn`` to every tensor of a (nested) batch: tensors, dicts and other mappings, lists, tuples,
    namedtuples, dataclasses (rebuilt with ``dataclasses.replace``, :func:`ddpkit._tensors.replaced`).

    Other leaves come back unchanged, or raise ``TypeError`` with ``strict=True``.
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return remapped(batch, {key: map_tensors(fn, value, strict=strict) for key, value in batch.items()})
    if isinstance(batch, (list, tuple)):
        mapped = [map_tensors(fn, value, strict=strict) for value in batch]
        return resequenced(batch, mapped)
    fields = init_fields(batch)
    if fields is not None:  # a collate_fn's batch class
        return replaced(batch, {name: map_tensors(fn, v, strict=strict) for name, v in fields.items()})
    if strict:
        raise TypeError(type(batch).__name__)
    return batch


def concat_batches(batches: list[Any]) -> Any:
    """Join collated batches along the first dimension (tensors, dicts, tuples, lists of values, dataclasses);
    a plain value the batches hold alike (a string, a number) is kept once."""
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
    fields = init_fields(first)
    if fields is not None:
        return replaced(first, {name: concat_batches([getattr(b, name) for b in batches]) for name in fields})
    if isinstance(first, (str, bytes, int, float, bool, type(None))) and all(b == first for b in batches):
        return first  # a value for the whole batch (a dataclass's name of its split): alike in each
    raise TypeError(f"cannot join batches of {type(first).__name__} from several workers")


def zero_rows(batch: Any) -> Any:
    """The batch with no rows: its structure for a rank whose share of a batch is empty."""
    return map_tensors(lambda t: t[:0], batch)


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``; non-blocking from pinned memory."""
    return map_tensors(lambda t: t.to(device, non_blocking=device.type == "cuda"), batch)
