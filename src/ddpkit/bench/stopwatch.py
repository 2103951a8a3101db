"""The stopwatch both bench loops share: phase marks, per-rank statistics, memory, fingerprints.

ddpkit's loop (:mod:`ddpkit.bench.worker`), the hand-written one (:mod:`ddpkit.bench.raw_ddp`)
and the peers of ``benchmarks/peers.py`` take five :func:`mark` readings a step and hand them to
:func:`rank_stats`, so every loop is timed, sized and fingerprinted by the same code and they
differ only in the training calls themselves. Rank 0 writes every rank's measurements with
:func:`write_result`; the parent (:mod:`ddpkit.bench.summary`) turns them into statistics.
"""

from __future__ import annotations

import hashlib
import json
import resource
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ddpkit._files import atomic_path
from ddpkit._tensors import raw_bytes
from ddpkit._torch import unwrap
from ddpkit.bench import wire
from ddpkit.distributed.host import usable_cores
from ddpkit.parallel.options import SetupOptions
from ddpkit.parallel.powersgd import payload_elements

PHASES = ("data_wait", "forward", "backward", "optimizer")
"""The four phases between a step's five :func:`mark` readings (start, data, forward, backward, optimizer)."""


def mark(device: torch.device) -> float:
    """A phase boundary: wait for queued GPU work (CUDA runs asynchronously), then read the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def rank_stats(
    marks: Sequence[Sequence[float]],
    warmup: int,
    model: torch.nn.Module,
    device: torch.device,
    world_size: int,
    devices: int = 1,
    payload_bytes: float | None = None,
    comm_calls: int | None = None,
) -> dict[str, Any]:
    """This rank's measurements after the loop: phase times, peak memory, gradients, weights, wire.

    Peak memory is read before the link is probed (:func:`ddpkit.bench.wire.probe`), which
    allocates buffers of its own. Every rank must call it: the probe is a collective.

    Args:
        marks: five :func:`mark` readings per step (start, after data, forward, backward,
            optimizer), warm-up steps included.
        warmup: how many of the first steps are not timed.
        model: the trained model (wrapped or not); its gradients are sized and its weights hashed.
        device: this rank's device.
        world_size: processes in the job; with one, nothing is sent and the link is not probed.
        devices: GPUs from ``device`` on whose memory counts (DataParallel), else 1.
        payload_bytes: what a compression hook handed to allreduce per timed step (default:
            every gradient once, as DDP's own buckets do).
        comm_calls: collective calls per step (:func:`ddpkit.bench.wire.calls_per_step`).
    """

    memory = _peak_memory(device, devices)
    timed = [list(m) for m in marks[warmup:]]
    params = [p for p in unwrap(model).parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    sent = (grad_bytes if payload_bytes is None else payload_bytes) if world_size > 1 else 0
    probed = wire.probe(sent, device) if world_size > 1 and params else None
    return {
        "phases": [[b - a for a, b in zip(m, m[1:])] for m in timed],
        "steps": [m[-1] - m[0] for m in timed],
        # when each timed step's forward pass ended: the spread across ranks is the wait
        "ready_at": [m[2] for m in timed],
        **memory,
        "grad_bytes": grad_bytes,
        # what PowerSGD (at ddpkit's default rank) would hand to allreduce per step instead
        "powersgd_bytes": 4 * payload_elements([p.shape for p in params], SetupOptions().powersgd_rank),
        "payload_bytes_per_step": sent,
        "wire": probed,
        "comm_calls": comm_calls,
        # SyncBatchNorm layers each add two collectives a step (statistics forward, sums backward)
        "sync_batchnorm_layers": sum(type(m).__name__ == "SyncBatchNorm" for m in unwrap(model).modules()),
        "threads": torch.get_num_threads(),
        "cores": usable_cores(),
        "weights_sha256": weights_digest(model),
    }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's own shard


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters + gradients + optimizer state this rank holds (under fsdp: its shards only).

    Gradients count as one per trainable parameter: they exist from backward to the step.
    """
    params = [_local(p) for p in unwrap(model).parameters()]
    held = sum(p.numel() * p.element_size() for p in params)
    grads = sum(_local(p).numel() * p.element_size() for p in unwrap(model).parameters() if p.requires_grad)
    state = sum(
        _local(v).numel() * v.element_size()
        for entry in optimizer.state.values()
        for v in entry.values()
        if isinstance(v, torch.Tensor)
    )
    return int(held + grads + state)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter and buffer, in state-dict order: equal digests = bitwise equal."""
    digest = hashlib.sha256()
    for key, value in unwrap(model).state_dict().items():
        digest.update(key.encode())
        digest.update(raw_bytes(_local(value)))
    return digest.hexdigest()


def write_result(path: str, gathered: list[dict[str, Any]], **meta: Any) -> None:
    """Rank 0: every rank's :func:`rank_stats` plus what was run, for the parent to read."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps({**meta, "torch": torch.__version__, "ranks": gathered}) + "\n")


def _peak_memory(device: torch.device, devices: int) -> dict[str, float | None]:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_mb = rss / 2**20 if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB on Linux
    cuda_mb = None
    if device.type == "cuda":
        first = device.index or 0  # only our own GPUs: touching others could create contexts there
        cuda_mb = max(torch.cuda.max_memory_allocated(i) for i in range(first, first + devices)) / 2**20
    return {"peak_rss_mb": rss_mb, "peak_cuda_mb": cuda_mb}


def compute_scaling(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    autocast: Callable[[], Any],
    device: torch.device,
    quiet: Any = None,
    repeats: int = 2,
) -> float | None:
    """How much longer a forward and backward take on twice the batch: seconds at ``2b`` over
    seconds at ``b`` (the fastest of ``repeats`` each), without any gradient sync.

    A small model's step does not double with its batch (each call's fixed cost stays), so a
    diagnosis that predicts "a 2x batch" by doubling the compute under-predicts; this measures
    the factor instead. Runs after the timed steps and the weights' digest, like
    :func:`backward_alone`; its gradients are dropped.

    Args:
        model: the trained model.
        inputs: a batch as one forward takes it (a micro-shard's, under micro-shards).
        targets: its targets.
        autocast: the loop's autocast, a callable returning a context manager.
        device: this rank's device, for :func:`mark`.
        quiet: a callable returning the context that keeps the passes local (DDP's ``no_sync``,
            micro-shards' probe); None: none needed.
        repeats: passes timed at each size; the fastest counts.
    """
    import contextlib

    if len(inputs) < 1:
        return None
    seconds = []
    for batch_x, batch_y in ((inputs, targets), (torch.cat([inputs, inputs]), torch.cat([targets, targets]))):
        times = []
        for _ in range(repeats):
            with quiet() if quiet is not None else contextlib.nullcontext():
                start = mark(device)
                with autocast():
                    loss = F.cross_entropy(model(batch_x), batch_y)
                loss.backward()
                times.append(mark(device) - start)
            model.zero_grad(set_to_none=True)
        seconds.append(min(times))
    return seconds[1] / seconds[0] if seconds[0] > 0 else None


def backward_alone(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    autocast: Callable[[], Any],
    device: torch.device,
    repeats: int = 2,
    quiet: Callable[[], Any] | None = None,
) -> float | None:
    """Seconds of one backward pass with no gradient sync (DDP's ``no_sync``): the compute the
    allreduce can hide behind. None for a model without ``no_sync`` (fsdp, one process) and no ``quiet``.

    Runs after the timed steps and after the weights' digest: its forwards move BatchNorm
    statistics, and its gradients are dropped.

    Args:
        model: the DDP model of the timed loop.
        inputs: the last batch's inputs, run forward again.
        targets: the last batch's targets.
        autocast: the loop's autocast, a callable returning a context manager.
        device: this rank's device, for :func:`mark`.
        repeats: backward passes timed; the fastest counts.
        quiet: what keeps the passes out of the run instead of ``no_sync`` (micro-shards' probing).
    """
    if quiet is None and not hasattr(model, "no_sync"):
        return None
    times = []
    for _ in range(repeats):
        with quiet() if quiet is not None else model.no_sync():
            with autocast():
                loss = F.cross_entropy(model(inputs), targets)
            start = mark(device)
            loss.backward()
            times.append(mark(device) - start)
        model.zero_grad(set_to_none=True)
    return min(times)
