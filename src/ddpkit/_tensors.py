"""A tensor's bytes without numpy (which an image with CUDA torch alone, ``make gpu-check``'s, may lack),
a mapping, sequence or dataclass of a batch rebuilt in its own type, and per-position scores as rows.

A base module (it imports nothing of ddpkit).

Example:
    >>> raw_bytes(torch.tensor([1, 2], dtype=torch.uint8))
    b'\\x01\\x02'
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of ``tensor``'s elements in order, on the host (what ``tensor.numpy().tobytes()`` gives).

    One copy in C of a contiguous host copy's memory. ``bytes(storage)`` would give the same bytes,
    but it reads them one element at a time in Python: 115 s for ResNet-18's 45 MB of weights, which
    the bench digests once a run."""
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if not flat.numel():
        return b""
    # `flat` stays referenced for the read: its memory is alive and holds exactly these bytes
    return ctypes.string_at(flat.data_ptr(), flat.numel())


def position_rows(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores ``(N, C, d1, ...)`` and targets ``(N, d1, ...)`` as rows ``(N * d1 * ..., C)`` and targets
    ``(N * d1 * ...,)``; scores ``(N, C)`` as they are.

    ``F.cross_entropy`` and ``F.nll_loss`` give the same loss either way, but on CUDA the first runs
    ``nll_loss2d``, whose sum and mean add with atomicAdd, which ``torch.use_deterministic_algorithms``
    (``micro_shards`` on a GPU) refuses; the rows' one-dimensional kernel is deterministic.

    >>> [tuple(t.shape) for t in position_rows(torch.zeros(2, 5, 3), torch.zeros(2, 3, dtype=torch.long))]
    [(6, 5), (6,)]
    """
    if outputs.dim() <= 2:
        return outputs, targets
    return outputs.movedim(1, -1).reshape(-1, outputs.shape[1]), targets.reshape(-1)


def remapped(mapping: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """``items`` (``mapping``'s keys with new values) in ``mapping``'s type where that is not a dict.

    A dict, or a subclass of one (an ``OrderedDict``, Hugging Face's ``ModelOutput``), comes back as a
    plain dict. Another mapping (a ``UserDict`` such as Hugging Face's ``BatchEncoding``, which a
    tokenizer or a data collator returns) is rebuilt as ``type(mapping)(items)``, so attribute access
    such as ``batch.input_ids`` keeps working; a mapping type whose constructor does not take a dict
    comes back as a plain dict.
    """
    if isinstance(mapping, dict):
        return items
    try:
        return type(mapping)(items)
    except TypeError:  # a constructor that takes no dict: the items as a plain dict (documented above)
        return items


def resequenced(sequence: list[Any] | tuple[Any, ...], items: Any) -> Any:
    """``items`` in ``sequence``'s type: a namedtuple's fields by position, a list or tuple (or a
    subclass taking an iterable) from the items.

    >>> from collections import namedtuple
    >>> Pair = namedtuple("Pair", "x y")
    >>> resequenced(Pair(1, 2), iter([3, 4])), resequenced((1, 2), iter([3, 4]))
    (Pair(x=3, y=4), (3, 4))
    """
    return type(sequence)(*items) if hasattr(sequence, "_fields") else type(sequence)(items)


def init_fields(value: Any) -> dict[str, Any] | None:
    """A dataclass instance's fields that its constructor takes, by name (what ``dataclasses.replace``
    rebuilds it from); None for anything else (a dataclass itself too).

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Batch:
    ...     x: int
    ...     y: int
    >>> init_fields(Batch(1, 2)), init_fields(Batch), init_fields((1, 2))
    ({'x': 1, 'y': 2}, None, None)
    """
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return None
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}


def replaced(value: Any, changes: dict[str, Any]) -> Any:
    """A copy of the dataclass instance ``value`` with ``changes`` to its fields: ``dataclasses.replace``
    (its ``__post_init__`` runs on the new values), else, for a class with an ``InitVar`` that
    ``replace`` cannot give again, a shallow copy with the fields set.

    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Pair:
    ...     x: int
    ...     y: int
    >>> replaced(Pair(1, 2), {"x": 5})
    Pair(x=5, y=2)
    """
    try:
        return dataclasses.replace(value, **changes)
    except ValueError:  # "InitVar 'scale' must be specified with replace()"
        copied = copy.copy(value)
        for name, field in changes.items():
            object.__setattr__(copied, name, field)  # (a frozen dataclass's too)
        return copied


__all__ = ["init_fields", "raw_bytes", "remapped", "replaced", "resequenced"]
