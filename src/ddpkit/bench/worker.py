"""One process of ``ddpkit bench``: ddpkit's own training loop, timed step by step.

``ddpkit bench`` starts this module in N processes for every configuration::

    ddpkit run -n 2 -m ddpkit.bench.worker --model convnet --data synthetic --precision fp32 \\
        --batch 32 --steps 50 --warmup 5 --result runs/bench/runs/ddp-x2-fp32.json

It runs the workload of :mod:`ddpkit.bench.workload` through ``ddpkit.init``, ``rt.setup``,
``rt.loader``, ``rt.backward`` and ``rt.step``, and times it with :mod:`ddpkit.bench.stopwatch`,
as the hand-written loop it is compared with (:mod:`ddpkit.bench.raw_ddp`) does. Rank 0 writes
the per-rank measurements to ``--result``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit._tensors import position_rows
from ddpkit.bench import wire
from ddpkit.bench.stopwatch import backward_alone, compute_scaling, mark, rank_stats, state_bytes, write_result
from ddpkit.bench.workload import bench_dataset, make_optimizer, powersgd_start, worker_parser
from ddpkit.parallel.modes import MicroShards
from ddpkit.parallel.sync_batchnorm import SyncBatchNorm
from ddpkit.recipes.models import DataParallel, build_model


def _batches(rt: Any, loader: Any) -> Iterator[Any]:
    """Batches without end, epoch after epoch (``rt.epochs`` sets each epoch's order)."""
    for _ in rt.epochs(sys.maxsize):
        yield from loader


def _periodic_costs(syncer: Any) -> dict[str, Any]:
    """What an infrequent sync of the whole model costs: its seconds and bytes, from the timed steps'
    syncs, or from one sync made now where the timed steps held none (``--steps`` shorter than
    ``--sync-every``). Seconds are those the steps waited: an exchange behind the inner steps
    (``sync_delay``) costs only what was left of it when it landed."""
    if syncer.syncs == 0:
        syncer.sync()  # every rank runs the same steps, so every rank comes here: a collective
    # a sync of the whole model: with sync_fragments=F, F fragment exchanges (each counted in syncs)
    whole = syncer.syncs / len(syncer.fragments)
    return {
        "every": syncer.every,
        "decision": syncer.decision,  # how the period was chosen (None: --sync-every gave it)
        "syncs": syncer.syncs,
        "seconds_per_sync": syncer.sync_seconds / whole,
        "bytes_per_sync": syncer.sent_bytes / whole,
    }


def _micro_shard_step(
    rt: Any, model: Any, optimizer: Any, inputs: Any, targets: Any, start: float, fetched: float
) -> tuple[float, ...]:
    """One step of ``rt.setup(micro_shards=M)``: each shard's forward and backward, then ``rt.step``,
    whose wait for the exchange (started in the last shard's backward) counts as backward time, where
    DDP's wait for its last bucket counts.

    Returns the step's five marks as the plain loop takes them: the forwards' and backwards' own
    seconds laid end to end after ``fetched``; the exchange's wait follows the backwards."""
    device = rt.device
    exact = next(mode.exact for mode in rt._run.modes if isinstance(mode, MicroShards))
    forward = backward = 0.0
    exchanged = exact.exchange_seconds  # (the loop's end waits for the exchange, before rt.step)
    for shard_inputs, shard_targets in rt.shards(inputs, targets):
        begin = mark(device)
        with rt.autocast():
            loss = F.cross_entropy(*position_rows(model(shard_inputs), shard_targets))  # deterministic on CUDA
        middle = mark(device)
        rt.backward(loss)
        forward, backward = forward + middle - begin, backward + mark(device) - middle
    rt.step(optimizer)
    end = mark(device)
    exchange = exact.exchange_seconds - exchanged
    return (start, fetched, fetched + forward, fetched + forward + backward + exchange, end)


def train(opts: argparse.Namespace) -> None:
    """Warm-up and timed steps of the ddpkit loop; rank 0 writes ``opts.result``."""
    rt = ddpkit.init(seed=opts.seed, precision=opts.precision)
    devices = torch.cuda.device_count() if opts.data_parallel else 1
    info = bench_dataset(opts.data, opts.batch * devices * rt.world_size, opts.model)
    torch.manual_seed(opts.seed)
    model = build_model(
        opts.model, num_classes=info.num_classes, in_channels=info.in_channels, image_size=info.image_size
    )
    optimizer = make_optimizer(model, opts)
    compression = None if opts.grad_compression == "none" else opts.grad_compression
    if opts.micro_shards:
        model, optimizer = rt.setup(model, optimizer, micro_shards=opts.micro_shards)
    elif opts.strategy == "fsdp":
        model, optimizer = rt.setup(model, optimizer, strategy="fsdp")
    else:
        extra = (
            {}
            if opts.sync == "every-step"
            else {
                "sync": opts.sync,
                "sync_every": opts.sync_every,
                "sync_dtype": opts.sync_dtype,
                "sync_fragments": opts.sync_fragments,
                "sync_delay": opts.sync_delay,
            }
        )
        if opts.powersgd_rank is not None:
            extra["powersgd_rank"] = opts.powersgd_rank
        model, optimizer = rt.setup(
            model,
            optimizer,
            grad_compression=compression,
            sync_batchnorm=opts.sync_bn,
            powersgd_start=powersgd_start(opts.warmup),
            **extra,
        )
    mode = rt._run.entries[-1].mode  # the mode of the model set up last
    compressor = getattr(mode, "compressor", None) or getattr(mode, "syncer", None)
    exact = mode.exact if isinstance(mode, MicroShards) else None
    if opts.data_parallel:
        model = DataParallel(model)  # replicas under the run's autocast dtype (bf16 stays bf16)
    data = info.dataset
    if opts.data_format == "shards":  # the same samples, read as a stream of 16 shards
        data = ddpkit.Shards.from_dataset(data, shards=16)
    loader = rt.loader(data, batch_size=opts.batch * devices, shuffle=True)
    batches = _batches(rt, loader)
    device, marks, synced = rt.device, [], []

    syncer = compressor if hasattr(compressor, "sync") else None  # sync="diloco" / "local-sgd"
    for step in range(opts.warmup + opts.steps):
        if step == opts.warmup:
            synced_before = SyncBatchNorm.collective_seconds
            if syncer is not None:
                syncer.sent_bytes = syncer.sync_seconds = syncer.syncs = 0
            elif compressor is not None:
                compressor.payload_elements = 0  # count the timed steps only
        start = mark(device)
        inputs, targets = next(batches)
        fetched = mark(device)
        if opts.micro_shards:
            marks.append(_micro_shard_step(rt, model, optimizer, inputs, targets, start, fetched))
            continue
        with rt.autocast():
            loss = F.cross_entropy(model(inputs), targets)
        forward = mark(device)
        rt.backward(loss)
        backward = mark(device)
        syncs = syncer.syncs if syncer is not None else 0
        rt.step(optimizer)
        marks.append((start, fetched, forward, backward, mark(device)))
        synced.append(syncer is not None and syncer.syncs > syncs)
    if syncer is not None:
        periodic = _periodic_costs(syncer)
        payload = periodic["bytes_per_sync"] / syncer.every  # amortised over the period
    else:
        payload = None if compressor is None else compressor.payload_bytes / opts.steps
    calls = wire.calls_per_step(model, opts.grad_compression)
    if opts.micro_shards and rt.world_size > 1:
        calls = exact.exchange_calls
        # recursive halving then doubling moves what a ring allreduce of the gradients moves
        payload = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    stats = rank_stats(marks, opts.warmup, model, device, rt.world_size, devices, payload, calls)
    stats["sync_batchnorm_seconds"] = (SyncBatchNorm.collective_seconds - synced_before) / opts.steps
    if syncer is not None:
        stats["periodic"] = {**periodic, "synced_steps": synced[opts.warmup :]}
    stats["grad_compression_auto"] = getattr(compressor, "decision", None)
    every = opts.micro_shards // rt.world_size if opts.micro_shards else 1  # a rank's shards a step
    if opts.micro_shards and rt.world_size > 1:
        # the shards' backward passes with no exchange beside them (a step's own hold the part of
        # the exchange that overlaps them)
        one = backward_alone(model, inputs[0::every], targets[0::every], rt.autocast, device, quiet=exact.probing)
        assert one is not None  # measured whenever `quiet` is given
        stats["backward_alone_seconds"] = every * one
    elif rt.world_size > 1 and not opts.data_parallel:
        stats["backward_alone_seconds"] = backward_alone(model, inputs, targets, rt.autocast, device)
    if opts.micro_shards:  # what one forward takes: a shard
        stats["compute_scaling_2x"] = compute_scaling(
            model, inputs[0::every], targets[0::every], rt.autocast, device, quiet=exact.probing
        )
    elif opts.strategy != "fsdp" and syncer is None:
        stats["compute_scaling_2x"] = compute_scaling(
            model, inputs, targets, rt.autocast, device, quiet=getattr(model, "no_sync", None)
        )
    stats["state_bytes"] = state_bytes(model, optimizer)
    gathered = ddpkit.all_gather_object(stats)
    if rt.is_main:
        write_result(
            opts.result,
            gathered,
            loop="ddpkit",
            world_size=rt.world_size,
            device=device.type,
            devices=devices,
            precision=opts.precision,
            grad_compression=opts.grad_compression,
            sync=opts.sync,
            tokens_per_sample=info.image_size if opts.model == "tiny-lm" else None,
            batch_per_process=opts.batch * devices,
            global_batch=opts.batch * devices * rt.world_size,
        )
    rt.barrier()  # leave together: a rank tearing down while a peer still talks can abort
    rt.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ddpkit.bench.worker``: parse the workload's arguments and run the timed loop."""
    parser = worker_parser("python -m ddpkit.bench.worker")
    parser.add_argument(
        "--data-parallel", action="store_true", help="wrap the model in torch.nn.DataParallel over every visible GPU"
    )
    opts = parser.parse_args(argv)
    Path(opts.result).parent.mkdir(parents=True, exist_ok=True)
    train(opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
