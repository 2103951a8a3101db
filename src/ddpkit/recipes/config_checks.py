"""The refusals of ``ddpkit train``'s settings, each one line that says what to give instead, checked before any process starts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ddpkit.errors import UsageError
from ddpkit.parallel import compression, exact_tree, periodic_parts

if TYPE_CHECKING:
    from ddpkit.recipes.config import TrainConfig


def check_counts(config: TrainConfig) -> None:
    """Counts in range, one way of giving the batch, a global batch the world divides, the nodes."""
    for name in ("nproc", "epochs", "eval_batch_size", "synthetic_size"):
        if getattr(config, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(config, name)}")
    for name in ("num_workers", "checkpoint_every", "max_restarts", "log_every"):
        if getattr(config, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(config, name)}")
    if config.keep_checkpoints < 1:
        raise UsageError(f"--keep-checkpoints must be at least 1, got {config.keep_checkpoints}")
    if config.batch_size is not None and config.global_batch_size is not None:
        raise UsageError("give --global-batch-size or --batch-size, not both")
    if config.batch_size is not None and config.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {config.batch_size}")
    if config.global_batch_size is not None and config.global_batch_size < 1:
        raise UsageError(f"--global-batch-size must be at least 1, got {config.global_batch_size}")
    if config.nnodes < 1:  # before the world size divides anything
        raise UsageError(f"--nnodes must be at least 1, got {config.nnodes}")
    if config.samples_per_step % config.world_size and not config.fault_tolerant:  # (replicas: split per quorum)
        world = f"--nproc {config.nproc}" + (
            f" x --nnodes {config.nnodes} = {config.world_size}" if config.nnodes > 1 else ""
        )
        raise UsageError(
            f"global batch {config.samples_per_step} does not divide by {world}; "
            f"use a multiple of {config.world_size} or --batch-size per process"
        )
    if config.nnodes > 1 and config.master is None:
        raise UsageError("--nnodes > 1 needs --master HOST:PORT (the host of node 0) and --node-rank R")


def check_fault_tolerant(config: TrainConfig) -> None:
    """What ``--fault-tolerant`` does not take (``rt.setup`` refuses the same in each replica), and its
    own flags without it."""
    if not config.fault_tolerant:
        from ddpkit.distributed.ft_launch import refuse_alone

        refuse_alone(config.min_replicas, config.quorum_timeout, config.secret_file)
        return
    if config.strategy != "ddp":
        raise UsageError(f"--fault-tolerant does not take --strategy {config.strategy} yet; leave --strategy ddp")
    if config.grad_compression in ("powersgd", "auto"):
        raise UsageError(
            f"--fault-tolerant does not take --grad-compression {config.grad_compression} yet (PowerSGD's "
            "error feedback is each replica's own, and a healed replica has none); use bf16 or fp16, or leave it out"
        )
    if config.data_parallel:
        raise UsageError("--fault-tolerant runs one process per replica; it does not combine with --data-parallel")


def check_compression(config: TrainConfig) -> None:
    """What ``grad_compression`` refuses (rt.setup says the same); bf16 on NCCL is checked at setup."""
    import torch

    choice = None if config.grad_compression == "none" else config.grad_compression
    compression.check(
        choice,
        rank=config.powersgd_rank,
        start=None,
        backend=None,
        device=torch.device("cpu"),
        precision=config.precision,
        compile=False,
    )


def check_sync(config: TrainConfig) -> None:
    """What ``rt.setup(sync=...)`` refuses, named by the flags, before any process starts."""
    if config.sync == "every-step":
        if config.sync_every is not None:
            raise UsageError("--sync-every sets how often --sync local-sgd or diloco meets; add --sync diloco")
        return
    if config.sync_batchnorm:
        raise UsageError(f"--sync {config.sync} averages BatchNorm statistics at each sync; drop --sync-batchnorm")
    if config.data_parallel:
        raise UsageError(f"--sync {config.sync} trains each process apart; it does not combine with --data-parallel")
    try:
        periodic_parts.check(
            config.sync,
            every=config.sync_every,
            sync_dtype=None,
            strategy=config.strategy,
            grad_compression=config.grad_compression,
            sync_batchnorm=False,
            precision=config.precision,
        )
    except UsageError as exc:
        raise UsageError(str(exc).replace("sync_every=H", "--sync-every H")) from None


def check_micro_shards(config: TrainConfig) -> None:
    """What ``rt.setup(micro_shards=...)`` refuses, named by the flags, before any process starts."""
    if config.micro_shards is None:
        return
    if config.data_parallel:
        raise UsageError(
            "--micro-shards computes each shard in a process of its own; it does not combine with --data-parallel"
        )
    if config.samples_per_step < config.micro_shards:
        raise UsageError(
            f"--micro-shards {config.micro_shards} cuts a global batch of {config.samples_per_step} "
            "samples; give at least one sample per shard"
        )
    try:
        exact_tree.check(
            config.micro_shards,
            world_size=config.world_size,
            sync_batchnorm=bool(config.sync_batchnorm),
            grad_compression=config.grad_compression,
            strategy=config.strategy,
            sync=config.sync,
            ddp_kwargs={},
        )
    except UsageError as exc:
        message = str(exc)
        for api, flag in (
            ("micro_shards=", "--micro-shards "),
            ("micro_shards", "--micro-shards"),
            ("sync_batchnorm=True", "--sync-batchnorm"),
            ("grad_compression=", "--grad-compression "),
            ("strategy=", "--strategy "),
            ("sync=", "--sync "),
        ):
            message = message.replace(api, flag)
        raise UsageError(message.replace("'", "")) from None


def check_out(config: TrainConfig) -> None:
    """``--out-dir`` is a directory that holds no run, unless ``--resume`` or ``--overwrite`` says what to do with it."""
    # Every node checks: the rendezvous decides which node holds global rank 0, the one that writes.
    out = Path(config.out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out-dir {out} exists and is not a directory")
    if config.resume not in (None, "auto") and not Path(config.resume).exists():
        raise UsageError(f"--resume {config.resume} does not exist; give a checkpoint file or directory, or 'auto'")
    holds_run = out.is_dir() and any((out / name).exists() for name in ("summary.json", "metrics.jsonl", "checkpoints"))
    if holds_run and config.resume is None and not config.overwrite:
        raise UsageError(
            f"--out-dir {out} already holds a run; use --resume auto to continue it, another --out-dir, or --overwrite"
        )


__all__ = ["check_compression", "check_counts", "check_micro_shards", "check_out", "check_sync"]
