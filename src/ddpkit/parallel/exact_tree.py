"""The pieces of micro-shards that hold no state: the refusals, the threads a shard gets, the fixed summation tree, how a batch is cut, and how shard statistics travel.

Example:
    >>> tree_sum([1, 2, 3, 4])       # ((1 + 3) + (2 + 4)): the first split takes every other item
    10
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ddpkit._tensors import init_fields, remapped, replaced, resequenced
from ddpkit.distributed.host import usable_cores
from ddpkit.errors import UsageError
from ddpkit.parallel import lazy_buffers


def check(
    micro_shards: int | None,
    *,
    world_size: int,
    sync_batchnorm: bool,
    grad_compression: str | None,
    strategy: str,
    sync: str,
    ddp_kwargs: dict[str, Any],
) -> None:
    """Refuse, in one line, ``micro_shards`` that cannot be exact here (nothing when it is None).

    Args:
        micro_shards: M, the shards of every global batch (None: not asked for).
        world_size: processes of the job.
        sync_batchnorm, grad_compression, strategy, sync, ddp_kwargs: ``rt.setup``'s other
            options, each refused where it is not its default (``compile`` and ``rt.accumulate`` combine).

    Raises:
        UsageError: M below 1 or not a power of two; a world size that is not a power of two dividing M; or an option
            the fixed tree cannot take (SyncBatchNorm, compression, fsdp, an infrequent sync,
            DDP arguments). A fault-tolerant job combines: its quorum shares the shards (:mod:`ddpkit.parallel.exact`).
    """
    if micro_shards is None:
        return
    if isinstance(micro_shards, bool) or not isinstance(micro_shards, int) or micro_shards < 1:
        raise UsageError(f"micro_shards must be a whole number of at least 1, got {micro_shards!r}")
    if micro_shards & (micro_shards - 1):
        below = 1 << (micro_shards.bit_length() - 1)
        raise UsageError(
            f"micro_shards must be a power of two (1, 2, 4, 8, ...) so that every power-of-two world size "
            f"up to it gives the same bits, got {micro_shards}; use {below} or {below * 2}"
        )
    if world_size & (world_size - 1) or micro_shards % world_size:
        raise UsageError(
            f"micro_shards={micro_shards} is exact on a power-of-two number of processes that "
            f"divides it (1, 2, 4, ...); this run has {world_size}: change the number of processes, "
            f"or micro_shards to a multiple of {world_size}"
        )
    refused = [
        (
            "sync_batchnorm=True",
            sync_batchnorm,
            "SyncBatchNorm mixes the statistics of every rank, so they change with the world size",
            "drop sync_batchnorm: each shard keeps its own BatchNorm statistics, the same on any world size",
        ),
        (
            f"grad_compression={grad_compression!r}",
            grad_compression is not None,
            "a compressed gradient depends on how the batch is split over the ranks",
            "drop grad_compression: the exact exchange moves no more bytes than an allreduce",
        ),
        (
            f"strategy={strategy!r}",
            strategy != "ddp",
            "fsdp reduce-scatters each gradient in an order of its own, which changes with the world size",
            "use strategy='ddp'",
        ),
        (
            f"sync={sync!r}",
            sync != "every-step",
            "a periodic sync depends on how many replicas train apart between syncs",
            "use sync='every-step'",
        ),
        (
            f"DDP arguments {sorted(ddp_kwargs)}",
            bool(ddp_kwargs),
            "no DDP wrapper is used",
            "drop them: the exchange buckets the gradients itself, and leaves a parameter without a gradient out of the sum",
        ),
    ]
    for name, bad, why, instead in refused:
        if bad:
            raise UsageError(f"micro_shards does not combine with {name} ({why}); {instead}")


def reversed_bits(rank: int, world_size: int) -> int:
    """``rank``'s ``log2(world_size)`` low bits in reverse order (``world_size`` a power of two; else ``rank``).

    >>> [reversed_bits(r, 4) for r in range(4)], [reversed_bits(r, 8) for r in range(8)]
    ([0, 2, 1, 3], [0, 4, 2, 6, 1, 5, 3, 7])
    """
    bits = world_size.bit_length() - 1
    if world_size < 2 or world_size & (world_size - 1):
        return rank
    return int(format(rank, f"0{bits}b")[::-1], 2)


def threads_for(micro_shards: int, cores: int | None = None) -> int:
    """Intra-op threads of every shard: ``cores // micro_shards`` (at least one), whatever the world size."""
    return max(1, (usable_cores() if cores is None else cores) // micro_shards)


def tree_sum(items: Sequence[Any], add: Any = None) -> Any:
    """``tree(items[0::2]) + tree(items[1::2])``, None for an empty list; None items count as nothing.

    >>> tree_sum([1.0, 2.0, 3.0, 4.0])      # (1 + 3) + (2 + 4)
    10.0
    >>> tree_sum([None, 5.0]), tree_sum([])
    (5.0, None)
    """
    add = add or (lambda a, b: a + b)
    if not items:
        return None
    if len(items) == 1:
        return items[0]
    left, right = tree_sum(items[0::2], add), tree_sum(items[1::2], add)
    if left is None or right is None:
        return right if left is None else left
    return add(left, right)


def tree_sum_halves(items: Sequence[Any], add: Any = None) -> Any:
    """``tree(items[:n // 2]) + tree(items[n // 2:])``: the tree of shards laid end to end (streams of
    :class:`ddpkit.Shards`, whose ranks read contiguous columns); None items count as nothing.

    >>> tree_sum_halves([1.0, 2.0, 3.0, 4.0])      # (1 + 2) + (3 + 4)
    10.0
    """
    add = add or (lambda a, b: a + b)
    if not items:
        return None
    if len(items) == 1:
        return items[0]
    half = len(items) // 2
    left, right = tree_sum_halves(items[:half], add), tree_sum_halves(items[half:], add)
    if left is None or right is None:
        return right if left is None else left
    return add(left, right)


def _add_grads(a: list[Any], b: list[Any]) -> list[Any]:
    return [y if x is None else x if y is None else x + y for x, y in zip(a, b)]


def _take(item: Any, j: int, every: int, rows: int | None = None) -> Any:
    """Local shard ``j`` of one batch element: rows ``j, j + every, ...`` of each tensor inside it
    (``rows`` given: rows ``j * rows`` to ``(j + 1) * rows``, shards laid end to end), contiguous
    whatever ``every`` is (a model that ``.view()``s its inputs runs on any world size)."""
    if isinstance(item, torch.Tensor):
        return (item[j::every] if rows is None else item[j * rows : (j + 1) * rows]).contiguous()
    if isinstance(item, (list, tuple)):
        return resequenced(item, (_take(x, j, every, rows) for x in item))  # a namedtuple too
    if isinstance(item, Mapping):  # a dict, or a UserDict such as a tokenizer's BatchEncoding, kept in its type
        return remapped(item, {k: _take(v, j, every, rows) for k, v in item.items()})
    fields = init_fields(item)
    if fields is not None:  # a collate_fn's batch class
        return replaced(item, {name: _take(v, j, every, rows) for name, v in fields.items()})
    if any(isinstance(v, torch.Tensor) for v in getattr(item, "__dict__", {}).values()):
        raise UsageError(
            f"rt.shards cannot cut a {type(item).__name__} (its tensors are attributes of an object it does not "
            "know), and each shard would get all of it; pass its tensors, e.g. rt.shards(batch.x, batch.y), "
            "or make it a dataclass, a namedtuple or a dict"
        )
    return item  # a value for the whole batch (a string, a number): every shard's


def _path_of(item: Any, batch: Any, path: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
    """Where ``item`` (the very object) sits in ``batch``: the keys and indices down to it; None: nowhere."""
    if item is batch:
        return path
    children = (
        batch.items() if isinstance(batch, Mapping) else enumerate(batch) if isinstance(batch, (list, tuple)) else ()
    )
    for key, child in children:
        found = _path_of(item, child, (*path, key))
        if found is not None:
            return found
    return None


def _at(batch: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        batch = batch[key]
    return batch


def _cut_alike(whole: Any, parts: list[Any]) -> bool:
    """Whether each part (a shard collated on its own) has the shapes of rows of ``whole`` (a collate
    that stacks, or pads to a fixed length): a shard cut from the batch is then the same."""
    if isinstance(whole, torch.Tensor):
        return all(isinstance(p, torch.Tensor) and p.shape[1:] == whole.shape[1:] for p in parts)
    if isinstance(whole, Mapping):
        return all(_cut_alike(v, [p[k] for p in parts]) for k, v in whole.items())
    if isinstance(whole, (list, tuple)):
        return all(_cut_alike(v, [p[i] for p in parts]) for i, v in enumerate(whole))
    fields = init_fields(whole)
    if fields is not None:
        return all(_cut_alike(v, [getattr(p, n) for p in parts]) for n, v in fields.items())
    return True


def _pack(stats: dict[int, tuple[torch.Tensor, torch.Tensor]], norms: list[_BatchNorm]) -> torch.Tensor:
    """One shard's statistics as a float64 row: per layer, 1 (ran) or 0, its mean and its variance."""
    parts = []
    for index, norm in enumerate(norms):
        if index in stats:
            mean, var = stats[index]
            parts += [torch.ones(1, dtype=torch.float64), mean.double().cpu(), var.double().cpu()]
        else:
            parts.append(torch.zeros(1 + 2 * norm.num_features, dtype=torch.float64))
    return torch.cat(parts)


def _unpack(row: torch.Tensor, norms: list[_BatchNorm]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """What :func:`_pack` wrote: the layers that ran, with their mean and variance."""
    out, offset = {}, 0
    for index, norm in enumerate(norms):
        c = norm.num_features
        if row[offset] > 0:
            out[index] = (row[offset + 1 : offset + 1 + c], row[offset + 1 + c : offset + 1 + 2 * c])
        offset += 1 + 2 * c
    return out


def _pack_table(shards: list[Any], norms: list[_BatchNorm]) -> torch.Tensor:
    """Shards' statistics (None: a shard without any) as one float64 tensor: a flag a shard, then a row a shard."""
    width = sum(1 + 2 * n.num_features for n in norms)
    flags = torch.tensor([0.0 if s is None else 1.0 for s in shards], dtype=torch.float64)
    rows = [_pack(s, norms) if s is not None else torch.zeros(width, dtype=torch.float64) for s in shards]
    return torch.cat([flags, *rows])


def _unpack_table(table: torch.Tensor, count: int, norms: list[_BatchNorm]) -> list[Any]:
    """What :func:`_pack_table` wrote for ``count`` shards (a CPU float64 tensor)."""
    rows = table[count:].view(count, -1)
    return [None if table[k] == 0 else _unpack(rows[k], norms) for k in range(count)]


def broadcast_from_rank0(model: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank (what DDP's constructor does; a collective)."""
    import torch.distributed as dist

    with torch.no_grad():
        for parameter in model.parameters():
            dist.broadcast(parameter.data, src=0)
    lazy_buffers.broadcast_from_rank0(model)  # the buffers, as DDP's own copy of them does
