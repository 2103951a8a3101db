"""A bench row from the workers' per-rank measurements: step time, throughput, phases, overlap.

Per step, the world's step time is its slowest rank's; ``samples_per_second`` is the global
batch over the median of those, over the timed steps only. ``breakdown`` is the mean seconds
per step of each phase over ranks and steps, so its phases add up to at most
``mean_step_seconds``. ``comm`` splits the gradient exchange into transfer, latency and wait
(:mod:`ddpkit.bench.wire`), with the link's measured speed and what the backward pass hid of it.
Memory is in MiB: the peak RSS of the largest rank, and CUDA's max allocated on GPUs.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from ddpkit.bench import wire
from ddpkit.bench.plan import Configuration
from ddpkit.bench.stopwatch import PHASES
from ddpkit.bench.table import add_speedup


def summarize(config: Configuration, result: Mapping[str, Any]) -> dict[str, Any]:
    """One table row from a worker's per-rank measurements (no speed-up yet)."""
    ranks = result["ranks"]
    world_steps = [max(steps) for steps in zip(*(r["steps"] for r in ranks))]
    median_step = statistics.median(world_steps)
    periodic = ranks[0].get("periodic")
    if periodic is not None:  # an infrequent sync: a step apart, plus a sync's cost over its period
        plain = [s for s, synced in zip(world_steps, periodic["synced_steps"]) if not synced]
        sync_seconds = max(r["periodic"]["seconds_per_sync"] for r in ranks)
        if plain:  # with every step a sync (sync_every 1) the median holds it already
            median_step = statistics.median(plain) + sync_seconds / periodic["every"]
    count = len(ranks) * len(world_steps)
    breakdown = {
        phase: sum(r["phases"][k][i] for r in ranks for k in range(len(world_steps))) / count
        for i, phase in enumerate(PHASES)
    }
    world = len(ranks)
    payload = statistics.fmean(r.get("payload_bytes_per_step", 0) for r in ranks)
    comm, overlap = _comm(ranks, payload), None
    if comm is not None:
        overlap = comm.pop("overlap")
    cuda = [r["peak_cuda_mb"] for r in ranks]
    return {
        "mode": config.mode,
        "nproc": config.nproc,
        "precision": config.precision,
        "applicable": True,
        "grad_compression": config.grad_compression,
        "hosts": config.hosts or None,
        "link_mbit": None,
        "world_size": world,
        "data_format": config.data_format,
        "sync_bn": config.sync_bn,
        "micro_shards": config.micro_shards,
        # what each rank hands to allreduce per step, and what a ring allreduce sends of it
        "payload_bytes_per_step": payload,
        "bytes_sent_per_step": wire.bus_bytes(payload, world),
        "device": result["device"],
        "devices": config.devices,
        "batch_per_process": result["batch_per_process"],
        "global_batch": result["global_batch"],
        "samples_per_second": result["global_batch"] / median_step,
        "tokens_per_second": (
            result["global_batch"] * result["tokens_per_sample"] / median_step
            if result.get("tokens_per_sample")
            else None
        ),
        "sync": result.get("sync", "every-step"),
        "grad_compression_auto": ranks[0].get("grad_compression_auto"),
        "sync_every": periodic["every"] if periodic else None,
        "sync_decision": periodic.get("decision") if periodic else None,
        "sync_seconds": max(r["periodic"]["seconds_per_sync"] for r in ranks) if periodic else None,
        "step_seconds": median_step,
        "mean_step_seconds": statistics.fmean(world_steps),
        "speedup": None,
        "efficiency": None,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "peak_rss_mb_per_rank": [r["peak_rss_mb"] for r in ranks],
        # parameters + gradients + optimizer state this rank holds (DDP: all; fsdp: its shards)
        "state_bytes_per_rank": [r.get("state_bytes") for r in ranks],
        "peak_cuda_mb": max(cuda) if None not in cuda else None,
        "breakdown": breakdown,
        "comm": comm,
        # the share of the allreduce hidden behind the backward pass (None: not measured)
        "comm_overlap": overlap,
        # a forward and backward on twice the batch over one on the batch (None: not measured)
        "compute_scaling_2x": _median_of(ranks, "compute_scaling_2x"),
        "threads_per_process": ranks[0]["threads"],
        "cores": ranks[0]["cores"],
        "weights_sha256": ranks[0]["weights_sha256"],
    }


def _median_of(ranks: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """The median over ranks of a value each measured, None where any did not."""
    values = [r.get(key) for r in ranks]
    return None if not values or None in values else statistics.median(values)


def _comm(ranks: Sequence[Mapping[str, Any]], payload: float) -> dict[str, Any] | None:
    """The row's ``comm``: the wire's split (:func:`ddpkit.bench.wire.split`) and the overlap."""
    split = wire.split(ranks, payload)
    if split is None:
        return None
    grad_bytes = ranks[0]["grad_bytes"]
    # the exchange's own time; waiting for a slower rank is never hidden, so it counts as exposed
    overlap, exposed, of_possible = _overlap(ranks, split["transfer_s"] + split["latency_s"])
    wait = split["skew_s"]
    periodic = ranks[0].get("periodic")
    if periodic is not None:
        # ranks run apart between syncs, so their steps' ends drift and say nothing; a sync costs what
        # it measured, and what of that the bytes and the call do not explain is waiting
        split["skew_s"] = 0.0
        sync_s = max(r["periodic"]["seconds_per_sync"] for r in ranks) / periodic["every"]
        wait = max(0.0, sync_s - split["transfer_s"] - split["latency_s"])
        # what the steps waited for the exchange, a step: an exchange behind the inner steps
        # (sync_delay) costs only what was left of it when it landed, however slow the link
        exposed = sync_s
        overlap = of_possible = None
    elif 0 < payload < grad_bytes:
        # the backward under no_sync skips the hook, so what a compressed step's backward took
        # beyond it is the compressor's own work as well as the wait: no share of the wire's
        overlap = of_possible = None
    elif exposed is not None:
        # what the step lost that neither the bytes nor the calls explain: waiting, for the
        # slowest rank (the skew) or for a core
        wait = max(wait, exposed - split["transfer_s"] - split["latency_s"])
    call = split.pop("payload_call_s")
    return {
        "grad_bytes_per_step": grad_bytes,
        **split,
        "wait_s": wait,
        # the payload allreduced once in isolation, latency included: achieved, not the link's speed
        "allreduce_seconds": call,
        "allreduce_gb_per_s": payload / call / 1e9 if call > 0 else None,
        "powersgd_bytes_per_step": ranks[0].get("powersgd_bytes"),
        "sync_batchnorm_calls": 2 * (ranks[0].get("sync_batchnorm_layers") or 0),
        # seconds a step in SyncBatchNorm's collectives, their waiting included (mean of ranks)
        "sync_batchnorm_seconds": statistics.fmean(r.get("sync_batchnorm_seconds") or 0.0 for r in ranks),
        "exposed_seconds": exposed,
        "overlap_of_possible": of_possible,
        "overlap": overlap,
    }


def _overlap(ranks: Sequence[Mapping[str, Any]], allreduce: float) -> tuple[float | None, ...]:
    """How much of an allreduce of ``allreduce`` seconds the backward pass hid, per step:
    ``(overlap, exposed seconds, overlap_of_possible)``, Nones where it was not measured.

    A training step's backward phase waits for DDP's last bucket; a backward under ``no_sync``
    (measured after the loop) is the compute alone. What the step's backward took beyond that
    is the communication left exposed; the rest of the probe's allreduce time was hidden.
    ``overlap``: hidden / allreduce. At most the backward's own length can be hidden, so
    ``overlap_of_possible`` (hidden / min(allreduce, backward alone)) says whether the layout
    hid what it could: a link far slower than the compute has a low ``overlap`` regardless.
    """
    alone = [r.get("backward_alone_seconds") for r in ranks]
    if None in alone or allreduce <= 0:
        return None, None, None
    backward = PHASES.index("backward")
    exposed = statistics.fmean(
        max(0.0, statistics.median(p[backward] for p in r["phases"]) - a) for r, a in zip(ranks, alone)
    )
    hidden = max(0.0, allreduce - exposed)
    possible = min(allreduce, statistics.fmean(alone))
    return min(1.0, hidden / allreduce), exposed, (min(1.0, hidden / possible) if possible > 0 else None)


def not_applicable(config: Configuration, link_mbit: float | None = None) -> dict[str, Any]:
    """The row of a configuration that cannot run here: its names, its reason, no measurements."""
    return {
        "mode": config.mode,
        "nproc": config.nproc,
        "precision": config.precision,
        "grad_compression": config.grad_compression,
        "hosts": config.hosts or None,
        "link_mbit": link_mbit,
        "sync_bn": config.sync_bn,
        "micro_shards": config.micro_shards,
        "data_format": config.data_format,
        "applicable": False,
        "reason": config.reason,
        "samples_per_second": None,
        "speedup": None,
        "efficiency": None,
        "peak_rss_mb": None,
        "breakdown": None,
    }


def with_speedup(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Speed-up over single; efficiency per device doing the work (GPUs of dp, else processes)."""
    widths = [{**r, "processes": r["nproc"] * r.get("devices", 1) * (r.get("hosts") or 1)} for r in rows]
    return [
        {**row, "speedup": done["speedup"], "efficiency": done["efficiency"]}
        for row, done in zip(rows, add_speedup(widths))
    ]
