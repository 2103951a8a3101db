"""The hand-written PyTorch DDP loop that ``ddpkit bench --compare-raw`` measures ddpkit against.

Plain ``torch.distributed`` in the style of the PyTorch DDP tutorials: the process group
from torchrun's environment variables, ``DistributedSampler`` + ``DataLoader``,
``DistributedDataParallel`` with its defaults, optional autocast + ``GradScaler``. (On CUDA
ddpkit passes ``gradient_as_bucket_view=True``, which saves a copy of the gradients; the results
are bitwise the same, the memory and time are what the comparison is for.) Start it
as ``ddpkit bench`` does (or with ``torchrun --nproc-per-node 2 -m ddpkit.bench.raw_ddp ...``)::

    ddpkit run -n 2 -m ddpkit.bench.raw_ddp --model convnet --data synthetic --precision fp32 \\
        --batch 32 --steps 50 --warmup 5 --result raw.json

It lives inside the package (``benchmarks/raw_ddp.py`` only runs it) so that an installed
ddpkit can run the comparison without a source checkout, and so both loops start the same
way: as a module under the same launcher. From ddpkit it takes only what must be
identical for a fair comparison and is not training code: the model and data builders
(plain ``nn.Module`` and ``Dataset``), the workload of :mod:`ddpkit.bench.workload` and the
stopwatch of :mod:`ddpkit.bench.stopwatch`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from ddpkit.bench import wire
from ddpkit.bench.stopwatch import backward_alone, mark, rank_stats, write_result
from ddpkit.bench.workload import bench_dataset, make_optimizer, powersgd_start, worker_parser
from ddpkit.distributed.collectives import all_gather_object
from ddpkit.recipes.models import build_model

_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _batches(sampler: DistributedSampler, loader: DataLoader) -> Iterator[Any]:
    """Batches without end, calling ``set_epoch`` so every epoch has its own order."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def _register_hook(model: DistributedDataParallel, choice: str, warmup: int) -> None:
    """torch's own communication hook for ``choice``, as a hand-written script registers it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if choice == "powersgd":
        # what Accelerate registers for DDPCommunicationHookType.POWER_SGD, at rank 2
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=powersgd_start(warmup)
        )
        hook = powerSGD_hook.powerSGD_hook
        model.register_comm_hook(state, hook if dist.get_backend() == "nccl" else _one_bucket_at_a_time(hook))
    elif choice in ("fp16", "bf16"):
        hook = default_hooks.fp16_compress_hook if choice == "fp16" else default_hooks.bf16_compress_hook
        model.register_comm_hook(None, hook)


def _one_bucket_at_a_time(hook: Any) -> Any:
    """torch's PowerSGD hook, waiting for the previous bucket: what a script on gloo needs.

    The hook issues its second and third allreduce from callbacks on gloo's threads; with two
    buckets in flight, ranks can issue them in different orders, and gloo aborts ("Received
    data size doesn't match expected size", seen here on ResNet-18 at the first compressed step).
    """
    previous: list[Any] = [None]

    def hook_in_order(state, bucket):  # noqa: ANN001, ANN202 — DDP checks a hook's annotations
        if previous[0] is not None:
            previous[0].wait()
        future = hook(state, bucket)
        previous[0] = None if bucket.is_last() else future
        return future

    return hook_in_order


def train(opts: Any) -> None:
    """Warm-up and timed steps of the raw loop; rank 0 writes ``opts.result``."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        info = bench_dataset(opts.data, opts.batch * world_size, opts.model)
        torch.manual_seed(opts.seed)
        model = build_model(
            opts.model, num_classes=info.num_classes, in_channels=info.in_channels, image_size=info.image_size
        ).to(device)
        model = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)
        _register_hook(model, opts.grad_compression, opts.warmup)
        optimizer = make_optimizer(model, opts)
        amp_dtype = _AMP_DTYPES.get(opts.precision)
        scaler = torch.amp.GradScaler(device.type) if opts.precision == "fp16" else None
        sampler = DistributedSampler(info.dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=opts.seed)
        loader = DataLoader(info.dataset, batch_size=opts.batch, sampler=sampler, pin_memory=use_cuda)
        batches = _batches(sampler, loader)
        marks = []
        for _ in range(opts.warmup + opts.steps):
            start = mark(device)
            inputs, targets = next(batches)
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            fetched = mark(device)
            autocast = (
                torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()
            )
            with autocast:
                loss = F.cross_entropy(model(inputs), targets)
            forward = mark(device)
            if scaler is not None:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            backward = mark(device)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            marks.append((start, fetched, forward, backward, mark(device)))
        stats = rank_stats(
            marks, opts.warmup, model, device, world_size, comm_calls=wire.calls_per_step(model, opts.grad_compression)
        )
        if world_size > 1:
            stats["backward_alone_seconds"] = backward_alone(
                model,
                inputs,
                targets,
                lambda: torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext(),
                device,
            )
        # Not dist.all_gather_object: it unpickles what arrives, and between hosts that is a socket.

        gathered = all_gather_object(stats)
        if rank == 0:
            write_result(
                opts.result,
                gathered,
                loop="raw",
                world_size=world_size,
                device=device.type,
                devices=1,
                precision=opts.precision,
                batch_per_process=opts.batch,
                global_batch=opts.batch * world_size,
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ddpkit.bench.raw_ddp`` under a launcher: parse the arguments and run the raw loop."""
    opts = worker_parser("python -m ddpkit.bench.raw_ddp").parse_args(argv)
    if "RANK" not in os.environ:
        sys.stderr.write(
            "start the raw loop under a launcher: torchrun --nproc-per-node 2 -m ddpkit.bench.raw_ddp ...\n"
        )
        return 2
    train(opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
