"""Which collective each replica of a fault-tolerant step calls, compared before it runs.

torchft's quorum pairs the replicas' collectives in the order they are called. A collective that
some replicas call and others do not (an ``rt.all_reduce`` under ``if rt.is_main``), or that they
call with other shapes or dtypes, pairs with another one: gloo aborted the replica whose sizes
differed, the survivors redid the step without it, and the replica restarted, healed and aborted
again at the same line. Nothing named the call.

So before a quorum collective, every participant describes it in one row of fixed size: its check's
number in the step, the call's name, dtype and shape, and the line of the user's script that led to
it (:func:`~ddpkit.errors.user_line`). It sends a 40-bit :func:`fingerprint` of the row first, one
number whatever the call, so the check always pairs up, and costs what a one-element sum costs (gloo
sums one element in one exchange, more in two). Where the sum says they differ, the rows follow;
every participant sees them in the same sums: the first in the quorum prints the report, one line per
replica (:func:`report`), and marks the job's store (:func:`mark`), so that ``ddpkit run
--fault-tolerant`` stops every replica instead of restarting one; each raises
:class:`CollectiveMismatch` in one line, and exits with :data:`~ddpkit.errors.EXIT_MISMATCH` (123).

Every quorum collective is checked (the gradient average, the exact exchange, an infrequent sync's
exchange and the period's agreement, the link probe as one call, ``rt.all_reduce`` inside a step,
the commit at ``rt.step``), except SyncBatchNorm's: a run of them (one model call's layers, one
backward pass's) is checked at its first, so a step checks a few calls, not one per layer.

Example:
    >>> mine = row(0, 1, 7, "all_reduce(sum)", torch.zeros(3), "train.py:40")
    >>> Call.of(mine).signature
    'all_reduce(sum) float32[3]'
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch

from ddpkit._tensors import raw_bytes
from ddpkit.errors import EXIT_MISMATCH, DdpkitError

MISMATCH_KEY = "ddpkit/ft/mismatch"
"""The job's store key the reporting replica sets (to its report): the launcher stops every replica."""

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_DIMS = 4  # shapes up to 4-D in full; more: their element count
_NAME_BYTES = 32
_WHERE_BYTES = 160
_MARK = 0x44445043  # every row starts with it: a row without it did not arrive whole
_INTS = 11  # the mark, replica, number, step, dtype, ndim, numel, 4 dims
_COMPARED = [2, *range(4, _INTS + _NAME_BYTES // 8)]  # number, dtype, shape and name: not replica, step or line
WIDTH = _INTS + (_NAME_BYTES + _WHERE_BYTES) // 8
"""int64 values in a row."""


class CollectiveMismatch(DdpkitError):
    """The replicas of a fault-tolerant step called different collectives (exit code 123)."""

    exit_code = EXIT_MISMATCH


def _packed(text: str, size: int) -> list[int]:
    data = text.encode()[-size:]
    return torch.frombuffer(bytearray(data.ljust(size, b"\0")), dtype=torch.int64).tolist()


def _unpacked(values: torch.Tensor) -> str:
    return raw_bytes(values).rstrip(b"\0").decode(errors="replace")


def row(replica: int, number: int, step: int, call: str, tensor: torch.Tensor | None, where: str) -> torch.Tensor:
    """One replica's row (int64, :data:`WIDTH` values) for the check before its ``number``-th checked call.

    Args:
        replica: the replica's index (``ddpkit run --fault-tolerant``'s, kept across restarts).
        number: the check's number in this step, from 1.
        step: torchft's step.
        call: what is called (``"all_reduce(sum)"``, ``"commit"``; at most 32 bytes are kept).
        tensor: what it sends, or None.
        where: the user's line that led to it (its last 160 bytes are kept).
    """
    dtype = 0 if tensor is None else (_DTYPES.index(tensor.dtype) + 1 if tensor.dtype in _DTYPES else 99)
    shape = [] if tensor is None else list(tensor.shape)
    dims = shape if len(shape) <= _DIMS else [-1] * _DIMS
    numel = 0 if tensor is None else tensor.numel()
    head = [_MARK, replica, number, step, dtype, len(shape), numel, *dims, *[0] * (_DIMS - len(dims))]
    return torch.tensor(head + _packed(call, _NAME_BYTES) + _packed(where, _WHERE_BYTES), dtype=torch.int64)


@dataclasses.dataclass(frozen=True)
class Call:
    """A row read back: which call a replica was about to make."""

    replica: int
    number: int
    step: int
    call: str
    dtype: str
    shape: str
    where: str

    @classmethod
    def of(cls, values: torch.Tensor) -> Call:
        """The call a :func:`row` describes."""
        v = [int(x) for x in values[1:_INTS].tolist()]
        replica, number, step, dtype, ndim, numel = v[:6]
        if dtype == 0:
            kind, shape = "", ""
        else:
            kind = str(_DTYPES[dtype - 1]).removeprefix("torch.") if dtype <= len(_DTYPES) else "other"
            shape = str(v[6 : 6 + ndim]) if ndim <= _DIMS else f"[{ndim}-D, {numel} elements]"
        end = _INTS + _NAME_BYTES // 8
        return cls(replica, number, step, _unpacked(values[_INTS:end]), kind, shape, _unpacked(values[end:]))

    @property
    def signature(self) -> str:
        """``all_reduce(sum) float32[3]``; a call without a tensor is its name alone."""
        return f"{self.call} {self.dtype}{self.shape}" if self.dtype else self.call


def fingerprint(row: torch.Tensor) -> int:
    """40 bits of what a row compares (:func:`differ`): the one number a check sends first.

    Where every participant's is the same, their sum is ``participants`` times it. Where not, it is
    another number for each of them (two replicas: always; more: unless one's fingerprint is the mean
    of all, a chance of 2**-40), and only then are the rows themselves sent, to be named.
    """
    compared = raw_bytes(row[_COMPARED])
    return int.from_bytes(hashlib.blake2b(compared, digest_size=5).digest(), "little")


def whole(rows: torch.Tensor) -> bool:
    """Whether every participant's row arrived whole (its mark, once): a collective that failed part
    way (NCCL aborts a stalled one and leaves the sums as they were) is not a mismatch."""
    return bool((rows[:, 0] == _MARK).all())


def differ(rows: torch.Tensor) -> bool:
    """Whether the replicas' rows (one per participant) name different calls."""
    compared = rows[:, _COMPARED]
    return bool((compared != compared[:1]).any())


def report(rows: torch.Tensor) -> str:
    """The mismatch in words: a line saying what differs, then one line per replica.

    Args:
        rows: every participant's :func:`row`, in quorum order.
    """
    calls = sorted((Call.of(r) for r in rows), key=lambda c: c.replica)
    first = calls[0]
    others = [c for c in calls if c.signature != first.signature]
    apart = others[0] if others else calls[-1]
    lines = [
        f"ddpkit: collective mismatch in step {first.step}: replicas {first.replica} and {apart.replica} "
        f"called different collectives as their check #{first.number}; every replica exits with code "
        f"{EXIT_MISMATCH}. Each replica:"
    ]
    for c in calls:
        at = f" at {c.where}" if c.where else ""
        lines.append(f"ddpkit:   replica {c.replica}: check #{c.number} of step {c.step}: {c.signature}{at}")
    lines.append(
        "ddpkit: every replica must call the same collectives in the same order with the same shapes and "
        "dtypes; a collective under `if rt.replica == 0` (or rt.is_main) is the usual cause"
    )
    return "\n".join(lines)


def mark(store: Any, text: str) -> None:
    """Tell the job (its launcher, replicas restarting) that its replicas called different collectives."""
    store.set(MISMATCH_KEY, text)


def marked(store: Any) -> bool:
    """Whether a replica of this job found a collective mismatch."""
    return bool(store.check([MISMATCH_KEY]))


__all__ = [
    "MISMATCH_KEY",
    "WIDTH",
    "Call",
    "CollectiveMismatch",
    "differ",
    "fingerprint",
    "mark",
    "marked",
    "report",
    "row",
    "whole",
]
