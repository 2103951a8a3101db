"""Whether every rank holds the same model: each tensor's bits summed as integers, compared across ranks.

An evaluation or a prediction over every rank's shard is one model's only when every rank holds
that model. A checkpoint loaded on rank 0 alone after ``rt.setup``, a model built unseeded and
evaluated without ``rt.setup``, an EMA of weights that replicas train apart: each rank then scores
its shard with another model and the joined metric belongs to none, silently. :func:`check` finds
it with one small all-reduce (an all-gather more, to name the tensor, only where they differ): the
sum of each parameter's and buffer's bits as integers (exact in any order, so equal tensors agree
on any device and thread count; float sums could part in the last place and raise a false alarm).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from ddpkit._torch import unwrap, wrapped_ddp
from ddpkit.distributed import collectives
from ddpkit.errors import UsageError


def bits_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum, in int64, of ``tensor``'s bits read as integers (:func:`as_integers`; a 0-d tensor on its
    device)."""
    return as_integers(tensor).sum(dtype=torch.int64)


def as_integers(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bits, flat, read as integers: elements of 4, 8 or 16 bytes as int32s, of 2 as int16s,
    of 1 (bools too) as uint8s."""
    flat = tensor.detach().contiguous().reshape(-1)
    size = flat.element_size()
    kind = torch.int32 if size % 4 == 0 else torch.int16 if size == 2 else torch.uint8
    return flat.view(kind)


def fingerprint(
    module: torch.nn.Module, *, buffers: bool = True, ignore: Collection[str] = ()
) -> tuple[list[str], torch.Tensor]:
    """The names of ``module``'s parameters (and buffers: ``"buffer seen"``) and each one's bits sum
    (int64, on the CPU). Left out: a lazy module's parameters that no forward has made yet, the
    names in ``ignore`` (what DDP is told to leave alone), and BatchNorm's ``num_batches_tracked``
    (it counts training forwards, which no evaluation reads)."""
    named: list[tuple[str, torch.Tensor]] = [
        (n, t) for n, t in module.named_parameters() if not is_lazy(t) and n not in ignore
    ]
    if buffers:
        named += [
            (f"buffer {n}", t)
            for n, t in module.named_buffers()
            if not is_lazy(t) and n not in ignore and not n.endswith("num_batches_tracked")
        ]
    if not named:
        return [], torch.zeros(0, dtype=torch.int64)
    return [name for name, _ in named], torch.stack([bits_sum(t).cpu() for _, t in named])  # any device each


def differs(module: torch.nn.Module, *, buffers: bool = True, given: Any = None) -> str | None:
    """Where ranks hold different ``module``\\ s (``"rank 1's 0.weight differs from rank 0's"``), else None; a
    collective, the same answer on every rank.

    Args:
        module: the model as it runs (unwrapped, the synced weights in place where it syncs infrequently).
        buffers: compare the buffers too (not where each rank's BatchNorm statistics are its own by design).
        given: the model as the script passed it (DDP around ``module``: what it is told to ignore is left out).
    """
    if collectives.world_size() == 1 or any(type(p).__name__ == "DTensor" for p in module.parameters()):
        return None  # (a sharded model's ranks hold their own shards, fsdp inside a copy too)
    ddp = wrapped_ddp(given if given is not None else module)
    ignore = getattr(ddp, "parameters_to_ignore", ()) if ddp is not None else ()
    return compare(*fingerprint(unwrap(module), buffers=buffers, ignore=ignore or ()))


def compare(names: list[str], sums: torch.Tensor) -> str | None:
    """Where ranks' ``sums`` (int64, one a named part) differ: ``"rank 1's <name> differs from rank 0's"``, else
    None. One small all-reduce when they agree; an all-gather more to say where when they do not."""
    if collectives.world_size() == 1:
        return None
    digest = torch.stack([torch.tensor(len(sums)), sums.sum(), (sums * torch.arange(1, len(sums) + 1)).sum()])
    top = collectives.all_reduce(torch.cat([digest, ~digest]), "max")  # ~: max of ~d is ~(min of d)
    if torch.equal(top[:3], ~top[3:]):
        return None
    mine = torch.cat([torch.tensor([len(names)], dtype=torch.int64), sums])
    table = collectives.all_gather(mine)  # every rank's count, then its sums, rank after rank
    rows, at = [], 0
    while at < len(table):
        count = int(table[at])
        rows.append(table[at + 1 : at + 1 + count])
        at += 1 + count
    differing = [rank for rank, row in enumerate(rows) if not torch.equal(row, rows[0])]
    if not differing:  # (the digest is the rows' own: it cannot part where they agree)
        return None
    rank, more = differing[0], (f"; {len(differing) - 1} more rank(s) differ" if len(differing) > 1 else "")
    if len(rows[rank]) != len(rows[0]):
        return f"rank {rank} holds {len(rows[rank])} parts, rank 0 {len(rows[0])}{more}"
    index = int((rows[rank] != rows[0]).nonzero()[0])
    return f"rank {rank}'s {names[index]} differs from rank 0's{more}"


def check(module: torch.nn.Module, what: str, given: Any = None) -> None:
    """Raise on every rank, in one line, when ranks hold different ``module``\\ s (a collective).

    Args:
        module: the model as it will run (unwrapped, its synced weights in place).
        what: the call that checks, for the message (``"ddpkit.evaluate"``).
        given: the model as the script passed it (see :func:`differs`).
    """
    where = differs(module, given=given)
    if where is not None:
        raise UsageError(
            f"{what}: the model differs between ranks ({where}), so its result would join several models' "
            "shards: give every rank the same weights (load a checkpoint on every rank, not on rank 0 alone; "
            "seed before building the model, or pass it through rt.setup, which starts every rank from rank "
            "0's; a copy of a model that syncs infrequently holds each replica's own weights; a buffer each "
            "rank updates on its own needs averaging first)"
        )
