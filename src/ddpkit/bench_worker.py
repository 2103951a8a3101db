"""One process of ``ddpkit bench``: a timed ddpkit training loop, and the stopwatch it shares.

``ddpkit bench`` starts this module in N processes for every configuration::

    ddpkit run -n 2 -m ddpkit.bench_worker --model convnet --data synthetic --precision fp32 \\
        --batch 32 --steps 50 --warmup 5 --result runs/bench/runs/ddp-x2-fp32.json

The hand-written PyTorch loop it is compared with (:mod:`ddpkit._raw_ddp`) imports the
measurement half of this module (:func:`mark`, :func:`bench_dataset`, :func:`rank_stats`,
:func:`write_result`), so both loops are timed, sized and fingerprinted by the same code and
differ only in the training calls themselves. Rank 0 writes the per-rank measurements to
``--result``; the parent (:mod:`ddpkit.bench`) turns them into statistics.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddpkit._torch import unwrap
from ddpkit.errors import UsageError
from ddpkit.dist.host import usable_cores
from ddpkit.recipes.datasets import DatasetInfo, load_dataset
from ddpkit.recipes.models import build_model

SYNTHETIC_POOL = 2048
"""Samples of ``--data synthetic`` (rounded up to whole global batches); epochs wrap around it."""

_ALLREDUCE_REPEATS = 5


# -- measurement shared with the raw loop ------------------------------------------------------

def worker_parser(prog: str) -> argparse.ArgumentParser:
    """The arguments both loops take; the parent always passes every one of them."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--precision", required=True, choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--batch", type=int, required=True, help="samples per process per step")
    parser.add_argument("--steps", type=int, required=True, help="timed steps")
    parser.add_argument("--warmup", type=int, required=True, help="untimed steps before them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--result", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--grad-compression", default="none", choices=("none", "fp16", "bf16", "powersgd"))
    parser.add_argument("--data-format", default="map", choices=("map", "shards"))
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"))
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp"))
    return parser


def powersgd_start(warmup: int) -> int:
    """PowerSGD's plain steps in a bench: the warm-up ones (at least 2), so timed steps compress."""
    return max(2, warmup)


def bench_dataset(name: str, global_batch: int) -> DatasetInfo:
    """The training set cut to a whole number of global batches.

    Every step then holds exactly ``global_batch`` samples, and ddpkit's sharding equals
    ``DistributedSampler`` + ``DataLoader``'s (they agree when the size divides), which the
    bitwise parity check with the raw loop needs.

    Raises:
        UsageError: the data set holds fewer samples than one global batch.
    """
    if name == "synthetic":
        size = -(-max(SYNTHETIC_POOL, global_batch) // global_batch) * global_batch
        return load_dataset("synthetic", "train", synthetic_size=size)
    info = load_dataset(name, "train")
    usable = len(info.dataset) // global_batch * global_batch
    if usable == 0:
        raise UsageError(f"--data {name} has {len(info.dataset)} training samples, fewer than one "
                         f"global batch of {global_batch}; lower --batch or --nproc")
    if usable == len(info.dataset):
        return info
    return dataclasses.replace(info, dataset=torch.utils.data.Subset(info.dataset, range(usable)))


def mark(device: torch.device) -> float:
    """A phase boundary: wait for queued GPU work (CUDA runs asynchronously), then read the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def rank_stats(marks: Sequence[Sequence[float]], warmup: int, model: torch.nn.Module,
               device: torch.device, world_size: int, devices: int = 1,
               payload_bytes: float | None = None) -> dict[str, Any]:
    """This rank's measurements after the loop: phase times, peak memory, gradients, weights.

    ``marks`` holds five clock readings per step (start, after data, forward, backward,
    optimizer). Peak memory is read before the allreduce probe, which allocates a flat
    gradient-sized buffer of its own; ``devices`` GPUs from ``device`` on count (DataParallel).
    ``payload_bytes``: what a compression hook handed to allreduce per timed step (default: every
    gradient once, as DDP's own buckets do).
    """
    memory = _peak_memory(device, devices)
    timed = [list(m) for m in marks[warmup:]]
    params = [p for p in unwrap(model).parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    allreduce_s = None
    if world_size > 1 and params:
        allreduce_s = _probe_allreduce(sum(p.numel() for p in params), params[0].dtype, device)
    return {
        "phases": [[b - a for a, b in zip(m, m[1:])] for m in timed],
        "steps": [m[-1] - m[0] for m in timed],
        **memory,
        "grad_bytes": grad_bytes,
        "payload_bytes_per_step": (grad_bytes if payload_bytes is None else payload_bytes) if world_size > 1 else 0,
        "allreduce_seconds": allreduce_s,
        "threads": torch.get_num_threads(),
        "cores": usable_cores(),
        "weights_sha256": weights_digest(model),
    }


def make_optimizer(model: torch.nn.Module, opts: argparse.Namespace) -> torch.optim.Optimizer:
    """``--optimizer``: SGD with momentum, or AdamW (two state tensors per parameter)."""
    if opts.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=opts.lr)
    return torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=opts.momentum)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor      # a DTensor's own shard


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters + gradients + optimizer state this rank holds (under fsdp: its shards only).

    Gradients count as one per trainable parameter: they exist from backward to the step.
    """
    params = [_local(p) for p in unwrap(model).parameters()]
    held = sum(p.numel() * p.element_size() for p in params)
    grads = sum(_local(p).numel() * p.element_size() for p in unwrap(model).parameters() if p.requires_grad)
    state = sum(_local(v).numel() * v.element_size() for entry in optimizer.state.values()
                for v in entry.values() if isinstance(v, torch.Tensor))
    return int(held + grads + state)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter and buffer, in state-dict order: equal digests = bitwise equal."""
    digest = hashlib.sha256()
    for key, value in unwrap(model).state_dict().items():
        digest.update(key.encode())
        digest.update(_local(value.detach()).cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def write_result(path: str, gathered: list[dict[str, Any]], **meta: Any) -> None:
    """Rank 0: every rank's :func:`rank_stats` plus what was run, for the parent to read."""
    from ddpkit._files import atomic_path

    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps({**meta, "torch": torch.__version__, "ranks": gathered}) + "\n")


def _peak_memory(device: torch.device, devices: int) -> dict[str, float | None]:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_mb = rss / 2**20 if sys.platform == "darwin" else rss / 1024   # bytes on macOS, KiB on Linux
    cuda_mb = None
    if device.type == "cuda":
        first = device.index or 0      # only our own GPUs: touching others could create contexts there
        cuda_mb = max(torch.cuda.max_memory_allocated(i) for i in range(first, first + devices)) / 2**20
    return {"peak_rss_mb": rss_mb, "peak_cuda_mb": cuda_mb}


def backward_alone(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                   autocast: Callable[[], Any], device: torch.device, repeats: int = 2) -> float | None:
    """Seconds of one backward pass with no gradient sync (DDP's ``no_sync``): the compute the
    allreduce can hide behind. None for a model without ``no_sync`` (fsdp, one process).

    Runs after the timed steps and after the weights' digest: its forwards move BatchNorm
    statistics, and its gradients are dropped.
    """
    if not hasattr(model, "no_sync"):
        return None
    times = []
    for _ in range(repeats):
        with model.no_sync():
            with autocast():
                loss = F.cross_entropy(model(inputs), targets)
            start = mark(device)
            loss.backward()
            times.append(mark(device) - start)
        model.zero_grad(set_to_none=True)
    return min(times)


def _probe_allreduce(numel: int, dtype: torch.dtype, device: torch.device) -> float:
    """Median seconds of one allreduce of every gradient at once (what DDP's buckets add up to)."""
    flat = torch.zeros(numel, dtype=dtype, device=device)
    token = torch.zeros(1, device=device)
    dist.all_reduce(flat)                  # first call sets up connections and buffers
    times = []
    for _ in range(_ALLREDUCE_REPEATS):
        dist.all_reduce(token)             # line the ranks up so no one times a peer's lateness
        start = mark(device)
        dist.all_reduce(flat)
        times.append(mark(device) - start)
    return statistics.median(times)


# -- the ddpkit loop ---------------------------------------------------------------------------

def _batches(rt: Any, loader: Any) -> Iterator[Any]:
    """Batches without end, epoch after epoch (``rt.epochs`` sets each epoch's order)."""
    for _ in rt.epochs(sys.maxsize):
        yield from loader


def train(opts: argparse.Namespace) -> None:
    """Warm-up and timed steps of the ddpkit loop; rank 0 writes ``opts.result``."""
    import ddpkit

    rt = ddpkit.init(seed=opts.seed, precision=opts.precision)
    devices = torch.cuda.device_count() if opts.data_parallel else 1
    info = bench_dataset(opts.data, opts.batch * devices * rt.world_size)
    torch.manual_seed(opts.seed)
    model = build_model(opts.model, num_classes=info.num_classes, in_channels=info.in_channels,
                        image_size=info.image_size)
    optimizer = make_optimizer(model, opts)
    compression = None if opts.grad_compression == "none" else opts.grad_compression
    if opts.strategy == "fsdp":
        model, optimizer = rt.setup(model, optimizer, strategy="fsdp")
    else:
        model, optimizer = rt.setup(model, optimizer, grad_compression=compression,
                                    powersgd_start=powersgd_start(opts.warmup))
    compressor = rt.run.compressors[-1]
    if opts.data_parallel:
        model = torch.nn.DataParallel(model)
    data = info.dataset
    if opts.data_format == "shards":        # the same samples, read as a stream of 16 shards
        data = ddpkit.Shards.from_dataset(data, shards=16)
    loader = rt.loader(data, batch_size=opts.batch * devices, shuffle=True)
    batches = _batches(rt, loader)
    device, marks = rt.device, []
    for step in range(opts.warmup + opts.steps):
        if step == opts.warmup and compressor is not None:
            compressor.payload_elements = 0          # count the timed steps only
        start = mark(device)
        inputs, targets = next(batches)
        fetched = mark(device)
        with rt.autocast():
            loss = F.cross_entropy(model(inputs), targets)
        forward = mark(device)
        rt.backward(loss)
        backward = mark(device)
        rt.step(optimizer)
        marks.append((start, fetched, forward, backward, mark(device)))
    payload = None if compressor is None else compressor.payload_bytes / opts.steps
    stats = rank_stats(marks, opts.warmup, model, device, rt.world_size, devices, payload)
    if rt.world_size > 1 and not opts.data_parallel:
        stats["backward_alone_seconds"] = backward_alone(model, inputs, targets, rt.autocast, device)
    stats["state_bytes"] = state_bytes(model, optimizer)
    gathered = ddpkit.all_gather_object(stats)
    if rt.is_main:
        write_result(opts.result, gathered, loop="ddpkit", world_size=rt.world_size,
                     device=device.type, devices=devices, precision=opts.precision,
                     grad_compression=opts.grad_compression,
                     batch_per_process=opts.batch * devices,
                     global_batch=opts.batch * devices * rt.world_size)
    rt.barrier()    # leave together: a rank tearing down while a peer still talks can abort
    rt.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = worker_parser("python -m ddpkit.bench_worker")
    parser.add_argument("--data-parallel", action="store_true",
                        help="wrap the model in torch.nn.DataParallel over every visible GPU")
    opts = parser.parse_args(argv)
    Path(opts.result).parent.mkdir(parents=True, exist_ok=True)
    train(opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
