"""The wire and the wait: what a step's gradient exchange costs, split into its causes.

An allreduce inside a training step takes as long as three things together, and only one of
them depends on the bytes:

- **transfer**: moving the step's payload over the link. Measured after the loop by allreducing
  the same number of bytes in isolation, every rank released together by a barrier first; the
  per-call latency is taken off.
- **latency**: the fixed cost of each collective call (a round trip through gloo or NCCL),
  times the calls a step makes (one per DDP bucket; PowerSGD makes two). Measured as a
  one-element allreduce, released the same way.
- **wait**: the first-ready rank waiting for the last before the step's first bucket can be
  reduced (the skew), and any rank waiting for a core. The skew is measured in the step itself:
  the spread, across ranks, of the moment each finished its forward pass (every rank of a bench
  runs on this machine, so their monotonic clocks are one).

Each call is timed on every rank (:func:`ddpkit.distributed.probe.timed_calls`), and a call counts at
the rank that measured it shortest (the rank released last waited for no one). Of those, the
median of the faster half counts (:func:`ddpkit.distributed.probe.typical`): on a machine whose cores the ranks fill, a call now and then waits a scheduler
tick (seen here: 0.4 ms or 3-4 ms for the same 140 KB on loopback), and that is the cores being busy,
which no fewer bytes would shorten.

Only transfer shrinks with fewer bytes, so only a step whose transfer is a real share of it can
gain from compression; latency and waiting shrink with fewer, larger steps, and waiting with
processes that do not crowd the cores. :mod:`ddpkit.bench.diagnose` draws those conclusions from
:func:`split`'s numbers.

The link's speed (``link_bytes_per_s``) is what each rank sends per second in a ring allreduce,
``2 (world - 1) / world`` of the tensor's bytes, over at least :data:`LINK_PROBE_BYTES`: a payload
of a few kilobytes moves in the time of a call's latency, so the speed it seems to reach says
nothing of the link.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from ddpkit._torch import PrivateApiChanged, ddp_bucket_count
from ddpkit.distributed.probe import bus_bytes, timed_calls, typical

LATENCY_REPEATS = 15
"""One-element allreduces timed for the per-call latency."""
TRANSFER_REPEATS = 15
"""Allreduces of the payload (and of the link probe) timed, fewer where each is slow."""
LINK_PROBE_BYTES = 1 << 20
"""The smallest tensor whose allreduce measures the link's speed: 1 MiB."""


def probe(payload_bytes: float, device: Any) -> dict[str, Any]:
    """This rank's timings of the link after the loop: a collective; every rank calls it.

    Returns:
        The seconds of each call: ``latency_calls`` (a one-element allreduce), ``payload_calls``
        (an allreduce of ``payload_bytes``) and ``link_calls`` (an allreduce of
        ``link_probe_bytes``, at least :data:`LINK_PROBE_BYTES`: the payload itself when it is
        that large). Every call starts right after a barrier, so all ranks start it together.
    """
    import torch

    elements = max(1, int(payload_bytes) // 4)
    payload = torch.zeros(elements, dtype=torch.float32, device=device)
    found: dict[str, Any] = {
        "latency_calls": timed_calls(torch.zeros(1, device=device), LATENCY_REPEATS),
        "payload_calls": timed_calls(payload, TRANSFER_REPEATS),
    }
    if elements * 4 >= LINK_PROBE_BYTES:
        found.update(link_probe_bytes=float(elements * 4), link_calls=found["payload_calls"])
    else:
        probe_tensor = torch.zeros(LINK_PROBE_BYTES // 4, dtype=torch.float32, device=device)
        found.update(link_probe_bytes=float(LINK_PROBE_BYTES), link_calls=timed_calls(probe_tensor, TRANSFER_REPEATS))
    return found


def calls_per_step(model: Any, grad_compression: str) -> int | None:
    """Collective calls a step of ``model`` makes for its gradients: DDP's buckets, twice under
    PowerSGD (``P``, then ``Q``). None for a model that is not DDP (fsdp, one process)."""
    import torch

    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    try:
        buckets = ddp_bucket_count(model)
    except PrivateApiChanged as exc:  # a bench row without latency counted, said out loud
        import warnings

        warnings.warn(f"bench: per-step calls not counted: {exc}", stacklevel=2)
        return None
    return buckets * (2 if grad_compression == "powersgd" else 1)


def split(ranks: Sequence[Mapping[str, Any]], payload_bytes: float) -> dict[str, Any] | None:
    """A row's gradient exchange split into transfer, latency and skew (seconds per step).

    None where the ranks measured nothing (one process, or a loop without the probes).

    Args:
        ranks: each rank's :func:`ddpkit.bench.stopwatch.rank_stats`: ``wire`` (its
            :func:`probe`), ``ready_at`` (when each timed step's forward pass ended) and
            ``comm_calls`` (:func:`calls_per_step`).
        payload_bytes: what each rank handed to allreduce per step.
    """
    probes = [r.get("wire") for r in ranks]
    if not probes or None in probes:
        return None
    world = len(ranks)

    def call(kind: str) -> float:  # per call, the rank released last; then the typical call
        return typical([min(times) for times in zip(*(p[kind] for p in probes))])

    latency_call, payload_call, link_call = call("latency_calls"), call("payload_calls"), call("link_calls")
    moving = link_call - latency_call
    calls = ranks[0].get("comm_calls")
    ready = [r.get("ready_at") or [] for r in ranks]
    spreads = [max(at) - min(at) for at in zip(*ready)]
    return {
        "transfer_s": max(0.0, payload_call - latency_call),
        "latency_s": latency_call * (calls or 1),
        "skew_s": statistics.fmean(spreads) if spreads else 0.0,
        "link_bytes_per_s": bus_bytes(probes[0]["link_probe_bytes"], world) / moving if moving > 0 else None,
        "latency_per_call_s": latency_call,
        "calls_per_step": calls,
        "payload_call_s": payload_call,
    }
