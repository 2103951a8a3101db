"""Timing the link the ranks share: allreduces started together, counted as the link's own cost.

:func:`timed_calls` times an allreduce right after a barrier, so every rank starts it together and
no rank times a peer's lateness; :func:`typical` keeps the median of the faster half of the calls,
since on a machine whose cores the ranks fill a call now and then waits a scheduler tick, which
is the cores being busy, not the link. :func:`link` turns a one-element and a larger allreduce into
the per-call latency and the link's speed, what ``grad_compression="auto"`` and ``ddpkit bench``
predict step times from. :func:`timed_link` is that timing over any group's sum and largest (a
process group's, or a fault-tolerant quorum's): a slow link's larger call is cut to what a quarter
of :data:`PROBE_BUDGET_S` sends, so a 1 Mbit/s link is timed in seconds, not minutes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed import collectives

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

    def call() -> None:
        dist.all_reduce(tensor, group=group)

    # the first call sets up connections and buffers
    first = torch.tensor([_seconds(call, tensor.device)], dtype=torch.float64, device=tensor.device)
    dist.all_reduce(first, op=dist.ReduceOp.MAX, group=group)
    times = []
    for _ in range(_repeats(repeats, first.item())):
        dist.barrier(group=group)
        times.append(_seconds(call, tensor.device))
    return times


def _seconds(call: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``call`` takes; on a GPU, from the device's queued work done to the call's work done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def typical(calls: Sequence[float]) -> float:
    """The median of the faster half of ``calls``: what a call costs when no core is busy."""
    ordered = sorted(calls)
    return statistics.median(ordered[: max(1, (len(ordered) + 1) // 2)])


def slowest_step(step_ends: list[float]) -> float:
    """The slowest rank's median step, from each rank's step end times (the first step is set-up and
    not counted): one number for every rank. A collective, through the backend's own device."""
    steps = [b - a for a, b in zip(step_ends[1:], step_ends[2:])]
    return float(collectives.all_reduce(statistics.median(steps), op="max"))


FIRST_ELEMENTS = 1 << 16
"""The first timed sum's size (256 KB of float32) at most: it predicts the larger one's time."""


def timed_link(
    sum_: Callable[[torch.Tensor], None],
    max_: Callable[[torch.Tensor], None],
    nbytes: int,
    device: torch.device,
    *,
    repeats: int = 7,
    before: Callable[[], None] | None = None,
) -> tuple[float, float, int]:
    """``(latency_s, seconds, bytes)`` of a group: the typical one-element sum, the typical sum of
    ``bytes`` (``nbytes`` at most), each this rank's median of its faster half of calls (:func:`typical`).

    A first, untimed one-element sum sets up what the calls use (NCCL makes its communicator then); a
    second one says how often the budget lets them repeat; the
    one-element calls come next, before any larger one (a shaped link's token bucket, emptied by a
    larger sum, would delay them: 3.3 ms for 0.2 ms at 1 Mbit/s). A
    timed sum of at most 256 KB predicts the larger one's time, the group's largest prediction counting
    (latency counted as bytes: an overestimate). Where the larger sum would take more than a quarter of
    :data:`PROBE_BUDGET_S`, it is cut to what that sends (at 1 Mbit/s a 4 MiB sum takes 40 s a call), and
    every timing is repeated as often as the budget allows (at least 3 times, at most ``repeats``).
    Every rank gets the same ``bytes`` and the same counts, so the calls pair up. The times are not
    agreed: the caller takes the group's largest with whatever else it agrees on.

    Args:
        sum_: sums a tensor in place over the group (every rank calls it with the same size).
        max_: the group's largest of a CPU float64 tensor, in place.
        nbytes: the larger sum's bytes at most (4-byte elements).
        device: where the summed tensors live.
        repeats: the most calls a timing takes.
        before: called before each timed call, such as a barrier that starts every rank together.
    """

    def seconds(tensor: torch.Tensor) -> float:
        if before is not None:
            before()
        return _seconds(lambda: sum_(tensor), device)

    small = torch.zeros(1, device=device)
    seconds(small)  # (connections, communicators, buffers: NCCL's take seconds)
    once = torch.tensor([seconds(small)], dtype=torch.float64)
    max_(once)
    # the one-element calls before any larger one: a shaped link's emptied token bucket would delay them
    latency = typical([seconds(small) for _ in range(_repeats(repeats, once.item()))])
    elements = max(1, nbytes // 4)
    first_elements = min(elements, FIRST_ELEMENTS)
    first = torch.tensor([seconds(torch.zeros(first_elements, device=device))], dtype=torch.float64)
    max_(first)
    predicted = first.item() * elements / first_elements
    if predicted > PROBE_BUDGET_S / 4:
        elements = max(first_elements, int(elements * PROBE_BUDGET_S / 4 / predicted))
        predicted = first.item() * elements / first_elements
    big = torch.zeros(elements, device=device)
    return latency, typical([seconds(big) for _ in range(_repeats(repeats, predicted))]), elements * 4


def _repeats(most: int, each_s: float) -> int:
    """How many calls of ``each_s`` seconds the budget allows: at least 3, at most ``most``."""
    return max(3, min(most, int(PROBE_BUDGET_S / max(each_s, 1e-9))))


def link(nbytes: int, device: torch.device, *, repeats: int = 7) -> tuple[float, float | None]:
    """``(latency_s, bytes_per_s)`` of the default group (:func:`timed_link` over its allreduce, each
    call after a barrier), each the largest over ranks of their typical call (ranks agree on the answer).

    ``bytes_per_s`` is what each rank sends per second in a ring allreduce (None where the larger
    call was no slower than the small one). A collective: every rank calls it.
    """

    def sum_(tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)

    def max_(values: torch.Tensor) -> None:  # (through the backend's device: NCCL reduces no CPU tensor)
        values.copy_(collectives.all_reduce(values, op="max"))

    latency, big, sent = timed_link(sum_, max_, nbytes, device, repeats=repeats, before=dist.barrier)
    agreed = torch.tensor([latency, big], dtype=torch.float64)
    max_(agreed)
    small, big = agreed.tolist()
    moving = big - small
    return small, (bus_bytes(sent, dist.get_world_size()) / moving if moving > 0 else None)
