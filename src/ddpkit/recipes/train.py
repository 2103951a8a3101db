"""The training worker behind ``ddpkit train``: one process of a built-in recipe.

Started by ``ddpkit train`` through ``ddpkit run -m ddpkit.recipes.train --config-json ...``;
it is also a readable example of a complete ddpkit training script.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit import checkpoint
from ddpkit._files import atomic_path
from ddpkit._tensors import position_rows
from ddpkit.errors import DdpkitError, UsageError
from ddpkit.loop.evaluate import evaluate
from ddpkit.observe.progress import Progress
from ddpkit.parallel import periodic as periodic_sync
from ddpkit.recipes.config import TrainConfig
from ddpkit.recipes.datasets import DatasetInfo, load_dataset
from ddpkit.recipes.models import DataParallel, build_model


def recipe_of(config: TrainConfig, info: DatasetInfo) -> dict[str, Any]:
    """What ``ddpkit predict`` needs to rebuild the model: stored as a plain dict in checkpoints."""
    return {
        "model": config.model,
        "data": config.data,
        "num_classes": info.num_classes,
        "in_channels": info.in_channels,
        "image_size": info.image_size,
        "precision": config.precision,
        "sync_bn": bool(config.sync_batchnorm),
        "micro_shards": config.micro_shards,
    }


def datasets_of(config: TrainConfig) -> tuple[DatasetInfo, DatasetInfo]:
    """The training and test sets of ``config``, as workers and the parent's preflight read them."""
    train = load_dataset(config.data, "train", config.data_dir, synthetic_size=config.synthetic_size)
    test = load_dataset(config.data, "test", config.data_dir, synthetic_size=max(256, config.synthetic_size // 4))
    return train, test


def build(config: TrainConfig, rt: ddpkit.Runtime) -> tuple[Any, ...]:
    """Data, model, optimizer and loader of ``config``, and ``config`` with ``sync_bn`` decided."""
    with rt.local_main_first():  # one process per node reads (and caches) node-local files first
        train, test = datasets_of(config)
    model = build_model(
        config.model, num_classes=train.num_classes, in_channels=train.in_channels, image_size=train.image_size
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=config.effective_lr, momentum=config.momentum)
    if config.sync_batchnorm is None:  # the default: world-size invariant wherever there is BatchNorm
        config = dataclasses.replace(config, sync_batchnorm=sync_bn_default(config, model, rt.world_size))
    if config.micro_shards is not None:  # bitwise invariant: ghost BatchNorm, one summation tree
        model, optimizer = rt.setup(model, optimizer, micro_shards=config.micro_shards)
    elif config.strategy == "fsdp":
        model, optimizer = rt.setup(model, optimizer, strategy="fsdp", cpu_offload=config.cpu_offload)
    else:
        periodic = (
            {}
            if config.sync == "every-step"
            else {
                "sync": config.sync,
                "sync_every": config.sync_every,
                "outer_lr": config.outer_lr,
                "outer_momentum": config.outer_momentum,
            }
        )
        model, optimizer = rt.setup(
            model,
            optimizer,
            sync_batchnorm=config.sync_batchnorm,
            grad_compression=config.grad_compression,
            powersgd_rank=config.powersgd_rank,
            **periodic,
        )
    if config.data_parallel:  # the seeds' single-process multi-GPU baseline
        model = DataParallel(model)
    sizes = (
        {"batch_size": config.batch_size}
        if config.batch_size is not None and rt.replica is None
        else {"global_batch_size": config.samples_per_step}  # (a replica's: split over each step's quorum)
    )
    loader = rt.loader(train.dataset, shuffle=True, num_workers=config.num_workers, **sizes)
    return train, test, model, optimizer, loader, config


class EpochLoss:
    """The epoch's training loss summed over its samples so far (float64), kept in checkpoints and
    handed to a healing replica with the rest of the state: the ``train_loss`` of an epoch that was
    resumed mid-way, or that a replica joined late, counts every step once.

    Each rank adds its own samples' losses (``pending``); :meth:`settle` sums them over the ranks into
    ``total``, the same on every rank, before a checkpoint and at the epoch's end. A fault-tolerant
    replica adds the step's quorum's sum (``rt.all_reduce`` inside the step), already the whole batch's.
    """

    def __init__(self, rt: ddpkit.Runtime) -> None:
        self.rt = rt
        self.epoch = -1
        self.total = 0.0
        self.pending = torch.zeros((), dtype=torch.float64)

    def start(self, epoch: int) -> None:
        """Epoch ``epoch`` trains on: a new sum, unless it is the one a checkpoint or a peer left mid-way."""
        if epoch != self.epoch:
            self.epoch, self.total = epoch, 0.0
        self.pending = torch.zeros((), dtype=torch.float64)

    def add(self, summed: torch.Tensor) -> None:
        """A committed step's losses, summed over this rank's samples (a replica: over the quorum's)."""
        if self.rt.replica is not None:
            self.total += float(summed)
        else:
            self.pending += summed

    def settle(self) -> float:
        """``total`` with every rank's pending losses in it (a collective, but in a fault-tolerant replica)."""
        if self.rt.replica is None:
            self.total += float(self.rt.all_reduce(self.pending))
            self.pending = torch.zeros((), dtype=torch.float64)
        return self.total

    def state_dict(self) -> dict[str, Any]:
        """The epoch and its settled sum (call :meth:`settle` first: a checkpoint's is every rank's)."""
        return {"epoch": self.epoch, "total": self.total}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Take a checkpoint's or a peer's epoch and sum."""
        self.epoch, self.total = int(saved["epoch"]), float(saved["total"])
        self.pending = torch.zeros((), dtype=torch.float64)


def _resume(rt: ddpkit.Runtime, state: dict[str, Any], config: TrainConfig) -> Any:
    """``rt.resume(state)``; a checkpoint written before ``epoch_loss`` was kept resumes without it
    (its epoch's ``train_loss`` then counts the steps after the resume only, as it did).

    A fault-tolerant replica resumes at its first quorum, inside the loader, where no error can be
    caught here: it reads the checkpoint it would resume first."""
    if rt.replica is not None:
        if _written_before_epoch_loss(config):
            state.pop("epoch_loss")
        return rt.resume(state)
    try:
        return rt.resume(state)
    except DdpkitError as exc:
        if "no entry for 'epoch_loss'" not in str(exc):
            raise
    older = {key: value for key, value in state.items() if key != "epoch_loss"}
    resumed = rt.resume(older)
    state.update(older)
    return resumed


def _written_before_epoch_loss(config: TrainConfig) -> bool:
    """Whether the checkpoint ``config`` resumes from (``--resume`` FILE, DIR or auto) holds no ``epoch_loss``."""
    if config.resume is None:
        return False
    source = Path(config.out_dir) / "checkpoints" if config.resume == "auto" else Path(config.resume)
    path = checkpoint.latest(source) if source.is_dir() else source
    if path is None or not path.is_file():
        return False
    return "epoch_loss" not in checkpoint.read(path, verified=source.is_dir())["user"]


def placed(config: TrainConfig, rt: ddpkit.Runtime) -> TrainConfig:
    """``config`` on the nodes the job runs on: under srun, SLURM's, not ``--nnodes`` (what a per-process
    ``--batch-size`` and ``--scale-lr`` multiply by). A fault-tolerant job's processes are its replicas."""
    world = rt._run.world.replicas if rt.replica is not None else rt.world_size
    if world != config.world_size and world % config.nproc == 0:
        return dataclasses.replace(config, nnodes=world // config.nproc)
    return config


def tracked_config(config: TrainConfig) -> dict[str, Any]:
    """The run's whole configuration as the trackers record it (what ``--config-json`` holds)."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k != "extra"}


def sync_bn_default(config: TrainConfig, model: torch.nn.Module, world_size: int) -> bool:
    """``--sync-batchnorm`` when not given: on where DDP trains a model with BatchNorm on several processes.

    Statistics of the global batch make every BatchNorm layer normalise as one process would on
    the same batch, so the run does not depend on the number of processes. DataParallel has its
    own per-GPU statistics, fsdp refuses BatchNorm and an infrequent sync averages the statistics
    at each sync, so none of them turns it on.
    """
    has_batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return (
        has_batchnorm
        and world_size > 1
        and config.strategy == "ddp"
        and not config.data_parallel
        and config.sync == "every-step"
        and config.micro_shards is None
    )


def train(config: TrainConfig) -> dict[str, Any]:
    """Run ``config`` in this process (one of the world); returns the summary."""
    started = time.perf_counter()
    rt = ddpkit.init(
        seed=config.seed,
        precision=config.precision,
        out_dir=config.out_dir,
        keep_checkpoints=config.keep_checkpoints,
        hang_timeout=config.hang_timeout,
        checkpoint_dir=Path(config.out_dir) / "checkpoints",
        resume=config.resume,
        trackers=config.trackers,
        run_name=config.run_name,
        config=tracked_config(config),
    )
    config = placed(config, rt)
    train_info, test_info, model, optimizer, loader, config = build(config, rt)
    epoch_loss = EpochLoss(rt)
    state = {"model": model, "optimizer": optimizer, "recipe": recipe_of(config, train_info), "epoch_loss": epoch_loss}
    _resume(rt, state, config)  # rank 0 says where it goes on from ("ddpkit: resumed from ...")

    final_checkpoint, metrics, seen, train_seconds = None, {}, 0, 0.0
    replicated = rt.replica is not None  # a fault-tolerant replica: each step's quorum holds its batch
    steps_left = len(loader) * max(0, config.epochs - rt.epoch) - loader.position
    one_bar = rt.is_main if rt.replica is None else rt.replica == 0  # (before a quorum, every replica is "main")
    with Progress(total=steps_left, enabled=one_bar, desc="train", unit="step") as bar:
        for epoch in rt.epochs(config.epochs):
            epoch_start = time.perf_counter()
            epoch_loss.start(epoch)  # (a resumed or healed epoch keeps what its steps summed)
            for inputs, targets in loader:
                summed = torch.zeros((), dtype=torch.float64)  # this process's samples' losses, summed
                if config.micro_shards is None:
                    with rt.autocast():
                        loss = F.cross_entropy(*position_rows(model(inputs), targets))
                    rt.backward(loss)
                    summed += loss.detach().double().cpu() * loader.local_count
                else:
                    for shard_inputs, shard_targets in rt.shards(inputs, targets):
                        with rt.autocast():
                            shard_loss = F.cross_entropy(*position_rows(model(shard_inputs), shard_targets))
                        rt.backward(shard_loss)
                        summed += shard_loss.detach().double().cpu() * len(shard_targets)
                    loss = summed / max(1, loader.local_count)
                if replicated:  # over the step's quorum (a replica's shard is not the batch), before it commits
                    summed = rt.all_reduce(summed)
                    loss = summed / max(1, loader.global_count)
                before = rt.global_step
                rt.step(optimizer)
                if rt.global_step == before:  # a fault-tolerant step that did not commit: the batch comes again
                    continue
                epoch_loss.add(summed)
                seen += loader.global_count
                if bar.active:
                    rate = seen / max(1e-9, train_seconds + time.perf_counter() - epoch_start)
                    bar.update(1, epoch=epoch, loss=f"{loss.item():.4f}", **{"samples/s": f"{rate:.0f}"})
                if config.log_every and rt.global_step % config.log_every == 0:
                    rt.log({"train_loss_step": loss.detach()}, reduce=None if replicated else "mean")
                if rt.preempted or (config.checkpoint_every and rt.global_step % config.checkpoint_every == 0):
                    epoch_loss.settle()  # the checkpoint keeps the epoch's loss so far, summed over ranks
                    final_checkpoint = rt.checkpoint(state)  # preempted: saves, then exits 75
            train_seconds += time.perf_counter() - epoch_start
            metrics = _evaluate(rt, model, test_info, config)
            train_loss = epoch_loss.settle() / max(1, len(train_info.dataset))
            rt.log(
                {
                    "epoch": epoch,
                    "train_loss": train_loss,
                    "test_loss": metrics["loss"],
                    "test_accuracy": metrics["accuracy"],
                },
                reduce=None,
            )
            final_checkpoint = rt.checkpoint(state)
            rt.print(
                f"epoch {epoch}: train_loss={train_loss:.4f} test_loss={metrics['loss']:.4f} "
                f"test_accuracy={metrics['accuracy']:.4f}"
            )

    if not metrics:  # resumed after the last epoch: evaluate what was loaded
        metrics = _evaluate(rt, model, test_info, config)
    syncer = periodic_sync.of(model)  # an infrequent sync: its period, chosen from the link where not given
    outer = syncer.outer.param_groups[0] if syncer is not None and syncer.outer is not None else None
    summary = {
        "world_size": rt.world_size,
        "fault_tolerant": replicated,
        "replicas": config.world_size if replicated else None,
        "precision": config.precision,
        "epochs": config.epochs,
        "global_batch_size": loader.sampler.global_batch_size,
        "model": config.model,
        "data": config.data,
        "seed": config.seed,
        "steps": rt.global_step,
        "lr": config.effective_lr,
        "sync_bn": config.sync_batchnorm,
        "micro_shards": config.micro_shards,
        "grad_compression": config.grad_compression or "none",
        "strategy": config.strategy,
        "sync": config.sync,
        # the period chosen (None where the run was too short to choose one)
        "sync_every": (None if syncer.choosing else syncer.every) if syncer is not None else config.sync_every,
        "sync_decision": syncer.decision if syncer is not None else None,
        "outer_lr": outer["lr"] if outer else None,
        "outer_momentum": outer["momentum"] if outer else None,
        "cpu_offload": config.cpu_offload,
        "powersgd_rank": config.powersgd_rank if config.grad_compression in ("powersgd", "auto") else None,
        "grad_compression_auto": getattr(getattr(rt._run.entries[0].mode, "compressor", None), "decision", None)
        if rt._run.entries
        else None,
        "test_accuracy": metrics["accuracy"],
        "test_loss": metrics["loss"],
        "test_count": metrics["count"],
        "wall_seconds": time.perf_counter() - started,
        "train_seconds": train_seconds,
        "samples_per_second": seen / train_seconds if train_seconds else 0.0,
        "final_checkpoint": str(final_checkpoint) if final_checkpoint else None,
        "trackers": dict(rt._run.tracking.ids) if rt._run.tracking is not None else {},
    }
    rt.heartbeat("save")
    if rt.is_main:
        _write_outputs(rt, summary, Path(config.out_dir))
    rt.barrier()
    return summary


def _evaluate(rt: ddpkit.Runtime, model: Any, info: DatasetInfo, config: TrainConfig) -> dict[str, Any]:
    """Evaluate on every rank (each batch tells the hang watchdog we are evaluating)."""
    return evaluate(
        model, info.dataset, num_classes=info.num_classes, batch_size=config.eval_batch_size, autocast=rt.autocast
    )


def _write_outputs(rt: ddpkit.Runtime, summary: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "summary.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
    rt._plot_loss()


RUN_OUTPUTS = ("summary.json", "metrics.jsonl", "metrics.csv", "loss.png", "checkpoints", "tensorboard")


def clear_previous_run(config: TrainConfig) -> list[Path]:
    """With ``--overwrite`` (and no ``--resume``), remove the earlier run's outputs in ``--out-dir``.

    Left in place, its checkpoints would outrank the new run's (rotation keeps the highest
    steps, so the new ones would be pruned) and a later ``--resume auto`` would pick them.
    Only the files a run writes are removed, in ``checkpoints/`` and ``tensorboard/`` too (a
    ``checkpoints/`` of the user's own keeps its files); anything else in ``--out-dir`` stays.
    """
    if not config.overwrite or config.resume is not None:
        return []
    import shutil

    written: dict[str, Callable[[str], bool]] = {
        "checkpoints": checkpoint.steps.run_written,
        "tensorboard": lambda name: name.startswith("events.out.tfevents."),
    }
    removed = []
    for name in RUN_OUTPUTS:
        path = Path(config.out_dir) / name
        if name in written:
            entries = []
            with contextlib.suppress(OSError):  # (not a directory, or gone: another node sharing --out-dir)
                entries = [entry for entry in path.iterdir() if written[name](entry.name)]
            for entry in entries:  # another node sharing --out-dir may race us
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:  # (a link to another run's step directory: the link goes, not what it names)
                    entry.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # (not empty: files of the user's own stay)
                path.rmdir()
            if not entries:
                continue
        elif path.is_file():
            path.unlink(missing_ok=True)
        else:
            continue
        removed.append(path)
    return removed


def preflight(config: TrainConfig) -> None:
    """Read the data and check a named --resume checkpoint before any process starts.

    Bad data paths and bad checkpoints are the user's input: they become one-line usage
    errors here instead of failures inside every worker.

    Raises:
        UsageError: missing or corrupt data files; an unreadable, corrupt or unsafe
            checkpoint, or one of another model or precision.
    """
    try:
        train, _ = datasets_of(config)
        _check_resume(config, train)
    except UsageError:
        raise
    except DdpkitError as exc:
        raise UsageError(str(exc)) from None


def _check_resume(config: TrainConfig, info: DatasetInfo) -> None:
    if config.resume in (None, "auto"):
        return
    source = Path(config.resume)
    path = checkpoint.latest(source) if source.is_dir() else source
    if path is None:
        raise DdpkitError(f"--resume {source}: no complete checkpoint in this directory")
    payload = checkpoint.read(path, verified=source.is_dir())  # latest() just verified it
    model = build_model(
        config.model, num_classes=info.num_classes, in_channels=info.in_channels, image_size=info.image_size
    )
    if "model" not in payload["user"]:
        raise DdpkitError(f"checkpoint {path} holds no 'model' entry; it was not written by ddpkit train")
    checkpoint.check_model_state(model, payload["user"]["model"], f"checkpoint {path}")
    saved = payload["ddpkit"]["precision"].get("precision")
    if saved != config.precision:
        raise DdpkitError(
            f"checkpoint {path} was written with precision {saved!r} and this run uses "
            f"{config.precision!r}; pass --precision {saved}"
        )


def main(argv: list[str] | None = None) -> int:
    """Train from ``--config-json JSON`` (``argv``, default ``sys.argv[1:]``); returns the exit code.

    A :class:`DdpkitError` is one line on the main rank and its ``exit_code``; bad usage is 2.
    """
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "--config-json":
        sys.stderr.write("usage: python -m ddpkit.recipes.train --config-json JSON (use 'ddpkit train')\n")
        return 2
    try:
        train(TrainConfig.from_json(argv[1]))
    except DdpkitError as exc:
        rt = ddpkit.current()
        if rt is None or rt.is_main:
            sys.stderr.write(f"ddpkit train: error: {exc}\n")
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
