"""Timing the link the ranks share: allreduces started together, counted as the link's own cost.

:func:`timed_calls` times an allreduce right after a barrier, so every rank starts it together and
no rank times a peer's lateness; :func:`typical` keeps the median of the faster half of the calls,
since on a machine whose cores the ranks fill a call now and then waits a scheduler tick, which
is the cores being busy, not the link. :func:`link` turns a one-element and a larger allreduce into
the per-call latency and the link's speed, what ``grad_compression="auto"`` and ``ddpkit bench``
predict step times from.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

PROBE_BUDGET_S = 4.0
"""About how long the repeats of one timing may take: a big payload on a slow link is timed fewer
times (at least 3), as the ranks agree from the first call's time."""


def bus_bytes(size: float, world_size: int) -> float:
    """Bytes each rank sends to allreduce ``size`` bytes in a ring of ``world_size`` ranks."""
    return size * 2 * (world_size - 1) / world_size if world_size > 1 else 0.0


def timed_calls(tensor: torch.Tensor, repeats: int, group: Any = None) -> list[float]:
    """Seconds of each of up to ``repeats`` allreduces of ``tensor``, each right after a barrier.

    A collective: every rank calls it with a tensor of the same size.
    """
    device = tensor.device

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    start = now()
    dist.all_reduce(tensor, group=group)  # the first call sets up connections and buffers
    first = torch.tensor([now() - start], dtype=torch.float64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MAX, group=group)
    repeats = max(3, min(repeats, int(PROBE_BUDGET_S / max(first.item(), 1e-9))))
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = now()
        dist.all_reduce(tensor, group=group)
        times.append(now() - start)
    return times


def typical(calls: Sequence[float]) -> float:
    """The median of the faster half of ``calls``: what a call costs when no core is busy."""
    ordered = sorted(calls)
    return statistics.median(ordered[: max(1, (len(ordered) + 1) // 2)])


def slowest_step(step_ends: list[float]) -> float:
    """The slowest rank's median step, from each rank's step end times (the first step is set-up and
    not counted): one number for every rank. A collective, through the backend's own device."""
    from ddpkit.distributed import collectives

    steps = [b - a for a, b in zip(step_ends[1:], step_ends[2:])]
    return float(collectives.all_reduce(statistics.median(steps), op="max"))


def link(nbytes: int, device: torch.device, *, repeats: int = 7) -> tuple[float, float | None]:
    """``(latency_s, bytes_per_s)`` of the default group: a one-element allreduce, and one of
    ``nbytes``, each the largest over ranks of their typical call (ranks agree on the answer).

    ``bytes_per_s`` is what each rank sends per second in a ring allreduce (None where the larger
    call was no slower than the small one). A collective: every rank calls it.
    """
    world = dist.get_world_size()
    small = typical(timed_calls(torch.zeros(1, device=device), repeats))
    big = typical(timed_calls(torch.zeros(max(1, nbytes // 4), device=device), repeats))
    agreed = torch.tensor([small, big], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    small, big = agreed.tolist()
    moving = big - small
    return small, (bus_bytes(max(1, nbytes // 4) * 4, world) / moving if moving > 0 else None)
