"""Reductions, gathers and the barrier, identity in a world of one.

Every function takes plain tensors or numbers and works the same with or without a
process group, so user code and ddpkit's own code never branch on the world size.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ddpkit import _torch
from ddpkit._tensors import raw_bytes
from ddpkit.errors import DdpkitError, UsageError, refused_global, warn

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_OWN = [0]  # calls ddpkit made on the default group inside ddpkits_own(), so far in this process
_COUNTED = [True]  # False once torch's sequence number turned out missing (warned once)


def _sequence() -> int | None:
    """:func:`ddpkit._torch.collective_sequence`; where a torch changed it, None from then on, warned once:
    the shards' check of the script's collectives is off, and training goes on."""
    if not _COUNTED[0]:
        return None
    try:
        return _torch.collective_sequence()
    except _torch.PrivateApiChanged as changed:
        _COUNTED[0] = False
        warn(f"{changed}: micro_shards no longer sees a collective of the script's inside a shard")
        return None


@contextlib.contextmanager
def ddpkits_own() -> Iterator[None]:
    """Collectives ddpkit runs on the default group for its own bookkeeping inside the script's code
    (the first counted ``rt.backward`` of a run, inside a micro-shard): counted apart from the script's
    (:func:`script_collectives`)."""
    before = _sequence()
    try:
        yield
    finally:
        after = _sequence() if before is not None else None
        if before is not None and after is not None:
            _OWN[0] += after - before


def script_collectives() -> int | None:
    """How many calls on the default group this process made so far, less ddpkit's own made inside
    :func:`ddpkits_own`; None where they are not counted (no group of two or more, or a backend
    other than gloo and nccl). Only the difference between two readings means anything."""
    sequence = _sequence()
    return None if sequence is None else sequence - _OWN[0]


def world_size() -> int:
    """Processes in the default group, 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """Rank in the default group, 0 without one."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def barrier() -> None:
    """Wait for every rank of the default group; identity in a world of one (or without a group).

    The one barrier of ddpkit: ``rt.barrier()``, the DCP save (:mod:`ddpkit.checkpoint.dcp`) and the merge
    of prediction parts (:mod:`ddpkit.loop.evaluate`) all wait here.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _comm_device() -> torch.device:
    if world_size() > 1 and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(value: Any, op: str = "sum", *, over: Any = None) -> Any:
    """Reduce ``value`` over all ranks with ``op`` in ``"sum"``, ``"mean"``, ``"max"``, ``"min"``.

    Tensors come back as new tensors on their own device (the input is not modified);
    Python numbers come back as Python numbers. ``over``: a group of ddpkit's own instead of the
    ranks (a fault-tolerant replica's step quorum: its ``device`` and ``reduce_(tensor, op)``).

    Example:
        >>> all_reduce(torch.tensor([1.0, 2.0]), op="mean")
        tensor([1., 2.])
    """
    if op not in (*_OPS, "mean"):
        raise UsageError(f"unknown reduce op {op!r}; use sum, mean, max or min")
    is_tensor = isinstance(value, torch.Tensor)
    tensor = value.detach().clone() if is_tensor else torch.tensor(value, dtype=torch.float64)
    if over is not None or world_size() > 1:
        work = tensor.to(over.device if over is not None else _comm_device())
        if op == "mean" and not work.is_floating_point():
            work = work.double()
        if over is not None:
            over.reduce_(work, op)  # (its mean divides by its own size)
        else:
            dist.all_reduce(work, op=_OPS.get(op, dist.ReduceOp.SUM))
            if op == "mean":
                work = work / world_size()
        tensor = work.to(tensor.device)
    if is_tensor:
        return tensor
    return tensor.item() if tensor.dim() == 0 else tensor.tolist()


def weighted_mean(values: list[float], weight: float) -> list[float]:
    """Each of ``values``' mean over the ranks, each rank's weighed by ``weight`` (its samples of the
    batch in hand: a rank with none adds nothing, the NaN mean of its no sample included); a value the
    same on every rank (a learning rate) comes back as it is. One gather; identity in a world of one.

    Example:
        >>> weighted_mean([0.5, 0.1], 3.0)
        [0.5, 0.1]
    """
    if world_size() == 1:
        return list(values)
    row = torch.tensor([*values, weight], dtype=torch.float64, device=_comm_device())
    rows = [torch.empty_like(row) for _ in range(world_size())]
    dist.all_gather(rows, row)
    table = torch.stack(rows).cpu().tolist()
    weights = [line[-1] for line in table]
    means = []
    for index in range(len(values)):
        column = [line[index] for line in table]
        if all(value == column[0] for value in column):  # (NaN equals nothing: weighed below)
            means.append(column[0])
            continue
        kept = [(value, w) for value, w in zip(column, weights) if w > 0]
        total = sum(w for _, w in kept)
        means.append(sum(value * w for value, w in kept) / total if total > 0 else math.nan)
    return means


_control: tuple[Any, Any] | None = None  # (the default group it was made for, its gloo group)


def _control_group() -> Any:
    """A gloo group of all ranks for ddpkit's own small CPU collectives, made on first use (by
    every rank at once) and again after a new default group."""
    global _control
    world = dist.group.WORLD
    if _control is None or _control[0] is not world:
        _control = (world, dist.new_group(backend="gloo"))
    return _control[1]


def any_rank(flag: bool, main_value: int = 0) -> tuple[bool, int]:
    """(whether ``flag`` is True on any rank, rank 0's ``main_value``), the same on every rank.

    One int64 all-reduce on a gloo group of ddpkit's own, so it never waits for a GPU; every rank
    must call it.
    """
    if world_size() == 1:
        return bool(flag), int(main_value)
    tensor = torch.tensor([1 if flag else 0, int(main_value) if rank() == 0 else 0], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_control_group())
    return bool(tensor[0].item()), int(tensor[1].item())


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order.

    First dimensions may differ across ranks (a rank may hold zero rows); the other
    dimensions and the dtype must agree.
    """
    if world_size() == 1:
        return tensor.detach().clone()
    padded, sizes = _padded_rows(tensor, _comm_device())
    chunks = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(chunks, padded)
    return _unpadded(chunks, sizes).to(tensor.device)


def gather(tensor: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
    """Every rank's rows concatenated in rank order on rank ``dst`` only (None elsewhere).

    Like :func:`all_gather` (first dimensions may differ) but only ``dst`` holds the result,
    so a large prediction is not copied to every rank.
    """
    if world_size() == 1:
        return tensor.detach().clone()
    padded, sizes = _padded_rows(tensor, _comm_device())  # (NCCL has had gather since torch 1.11)
    chunks = [torch.empty_like(padded) for _ in sizes] if rank() == dst else None
    dist.gather(padded, gather_list=chunks, dst=dst)
    return _unpadded(chunks, sizes).to(tensor.device) if rank() == dst else None


def _padded_rows(tensor: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """``tensor`` on ``device`` padded with zero rows to the longest rank's; every rank's row count.

    Collectives need equal shapes; the sizes let the receiver cut the padding away again.
    """
    work = tensor.detach().to(device).contiguous()
    if work.dim() == 0:
        work = work.reshape(1)
    sizes = _gather_sizes(work.shape[0])
    padded = torch.zeros((max(sizes), *work.shape[1:]), dtype=work.dtype, device=device)
    padded[: work.shape[0]] = work
    return padded, sizes


def _unpadded(chunks: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    return torch.cat([chunk[:size] for chunk, size in zip(chunks, sizes)])


def _gather_sizes(size: int) -> list[int]:
    local = torch.tensor([size], dtype=torch.long, device=_comm_device())
    sizes = [torch.zeros_like(local) for _ in range(world_size())]
    dist.all_gather(sizes, local)
    return [int(s.item()) for s in sizes]


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank.

    ``obj`` is what a checkpoint may hold: tensors, numbers, strings, None and dicts, lists and
    tuples of them. It travels as the bytes of ``torch.save`` and is read with
    ``torch.load(weights_only=True)``, so bytes that arrive over a socket never build anything
    else (unlike ``dist.broadcast_object_list``, which unpickles them).

    Raises:
        TypeError: ``obj`` holds an object of another kind.
    """
    if world_size() == 1:
        return obj
    device = _comm_device()
    mine = _to_bytes(obj) if rank() == src else torch.zeros(0, dtype=torch.uint8)
    size = torch.tensor([mine.numel()], dtype=torch.long, device=device)
    dist.broadcast(size, src=src)
    payload = mine.to(device) if rank() == src else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src)
    return _from_bytes(payload)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order; ``obj`` as for :func:`broadcast_object` (never unpickled freely).

    Raises:
        TypeError: ``obj`` holds an object of another kind.
    """
    if world_size() == 1:
        return [obj]
    mine = _to_bytes(obj).to(_comm_device())
    padded, sizes = _padded_rows(mine, _comm_device())
    chunks = [torch.empty_like(padded) for _ in range(world_size())]
    dist.all_gather(chunks, padded)
    return [_from_bytes(chunk[:size]) for chunk, size in zip(chunks, sizes)]


def object_bytes(obj: Any) -> bytes:
    """ddpkit's own plain data (as for :func:`broadcast_object`) as the bytes a peer reads with
    :func:`object_from`; not read back first, as :func:`_to_bytes` does for a user's object (that
    takes three times as long as writing them)."""
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def object_from(data: bytes) -> Any:
    """What :func:`object_bytes` (or :func:`_to_bytes`) made, read with ``weights_only=True``.

    Raises:
        DdpkitError: the bytes ask for more than plain data (not what a peer sends); nothing they
            name is called.
    """
    try:
        return _load(data)
    except Exception as exc:  # noqa: BLE001 - torch's weights_only errors are several types
        raise DdpkitError(
            "bytes received for an object collective are not plain data "
            f"({_first_line(exc)}); ddpkit refuses to unpickle them"
        ) from None


def _to_bytes(obj: Any) -> torch.Tensor:
    """``obj`` as ``torch.save`` bytes in a uint8 tensor, refused here if the receiver could not read it."""
    data = object_bytes(obj)
    try:
        _load(data)
    except Exception as exc:  # noqa: BLE001 - torch's weights_only errors are several types
        raise TypeError(
            "ddpkit sends between ranks only tensors, numbers, strings, None and dicts, lists and "
            f"tuples of them (read with torch.load(weights_only=True)); {type(obj).__name__} "
            f"holds something else: {_first_line(exc)}"
        ) from None
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _from_bytes(payload: torch.Tensor) -> Any:
    """What :func:`_to_bytes` made, received as a uint8 tensor (:func:`object_from`)."""
    return object_from(raw_bytes(payload))


def _load(data: bytes) -> Any:
    import io

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _first_line(exc: BaseException) -> str:
    wanted = refused_global(exc)
    if wanted:
        return f"it needs {wanted}"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines or [type(exc).__name__])[0]
