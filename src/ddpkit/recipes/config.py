"""The settings of ``ddpkit train``: a dataclass, read from flags and YAML/TOML files, checked early."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from ddpkit.errors import UsageError
from ddpkit.observe.trackers import names, problem
from ddpkit.observe.watchdog import check_timeout
from ddpkit.parallel.fsdp import check as check_fsdp
from ddpkit.parallel.options import check_strategy
from ddpkit.recipes.config_checks import (
    check_compression,
    check_counts,
    check_fault_tolerant,
    check_micro_shards,
    check_out,
    check_sync,
)
from ddpkit.recipes.datasets import DATASETS
from ddpkit.recipes.models import MODELS, build_model
from ddpkit.state.precision import PRECISIONS


@dataclass
class TrainConfig:
    """One training run of a built-in recipe."""

    # Earlier names of settings (flags and config-file keys) that still work: old name -> field.
    ALIASES: ClassVar[dict[str, str]] = {
        "global_batch": "global_batch_size",
        "batch": "batch_size",
        "sync_bn": "sync_batchnorm",
        "workers": "num_workers",
        "out": "out_dir",
        "tracker": "trackers",
        "eval_batch": "eval_batch_size",
    }

    model: str = "convnet"
    """Model recipe: convnet, mlp, resnet18 or resnet50."""
    data: str = "digits"
    """Data set: digits (bundled with scikit-learn), mnist, cifar10 or synthetic."""
    data_dir: str | None = None
    """Directory with torchvision's on-disk files for mnist and cifar10 (nothing is downloaded)."""
    nproc: int = 1
    """Processes on this machine (per node)."""
    nnodes: int = 1
    """Nodes of the job; each node runs ddpkit train with its own --node-rank (0 hosts the rendezvous)."""
    node_rank: int | None = None
    """This node's index when --nnodes > 1."""
    master: str | None = None
    """HOST:PORT of node 0 when --nnodes > 1."""
    precision: str = "fp32"
    """fp32, bf16 (autocast) or fp16 (autocast + GradScaler)."""
    epochs: int = 5
    """Passes over the training set."""
    global_batch_size: int | None = None
    """Samples per optimizer step across all processes (the default: 64)."""
    batch_size: int | None = None
    """Samples per step per process, instead of --global-batch-size; the global batch then grows with the
    world size."""
    lr: float = 0.05
    """Learning rate of SGD with momentum."""
    momentum: float = 0.9
    """SGD momentum."""
    scale_lr: bool = False
    """Linear scaling rule: multiply lr by the world size when --batch-size is per process."""
    sync_batchnorm: bool | None = None
    """BatchNorm statistics over the global batch, across processes, so that the result does not
    depend on the number of processes (SyncBatchNorm). The default: on wherever the model has
    BatchNorm and more than one process trains it with ddp; --no-sync-batchnorm normalises each process's
    batch on its own, as plain DDP does."""
    micro_shards: int | None = None
    """Bitwise the same run on any power-of-two number of processes that divides M: each global
    batch in M micro-shards, each with its own BatchNorm statistics (ghost batch norm, instead of
    --sync-batchnorm), computed on cores // M threads, their gradients summed along one fixed tree (see
    ddpkit.parallel.exact). ddpkit demo's rows use it."""
    grad_compression: str | None = None
    """Gradients on the wire: none (the default), fp16, bf16, powersgd, or auto (time the link and
    the first steps, then take whichever predicts the shortest step; see ddpkit.parallel.auto)."""
    powersgd_rank: int = 2
    """Rank of PowerSGD's low-rank factors (higher: more bytes, closer to the full gradient)."""
    sync: str = "every-step"
    """every-step (DDP's allreduce each step), local-sgd (average the weights every --sync-every steps)
    or diloco (an outer Nesterov step on the averaged change every --sync-every steps): for slow links;
    the result then depends on the number of processes (see ddpkit.parallel.periodic)."""
    sync_every: int | None = None
    """Optimizer steps between syncs of --sync local-sgd or diloco (left out: chosen from the link and the step)."""
    outer_lr: float | None = None
    """DiLoCo's outer learning rate (None: 0.7, DiLoCo's, with ``sync_every``; 1.0 where the period is
    chosen from the link: at the short periods a link allows, DiLoCo's outer Nesterov step multiplies each
    period's progress and diverges, where an average matches DDP)."""
    outer_momentum: float | None = None
    """DiLoCo's outer Nesterov momentum (None: 0.9 with ``sync_every``; 0 where the period is chosen from the link)."""
    strategy: str = "ddp"
    """ddp (replicated) or fsdp (parameters, gradients and optimizer state sharded, see
    ddpkit.parallel.fsdp; its checkpoints are directories of shards that resume on any world size)."""
    cpu_offload: bool = False
    """With --strategy fsdp: keep the shards and the optimizer state in CPU memory."""
    num_workers: int = 0
    """DataLoader worker processes per training process."""
    seed: int = 0
    """Seed of weights, data order and augmentation."""
    out_dir: str = "runs/train"
    """Output directory: metrics, TensorBoard events, loss.png, checkpoints, summary.json."""
    resume: str | None = None
    """A checkpoint file or directory to resume from, or 'auto' for the newest in OUT_DIR/checkpoints."""
    checkpoint_every: int = 0
    """Also save every this many optimizer steps (0: only at the end of each epoch)."""
    keep_checkpoints: int = 3
    """Newest checkpoints kept in OUT_DIR/checkpoints."""
    max_restarts: int = 0
    """Restart the whole group up to this many times when a worker fails (resume with --resume auto);
    with --fault-tolerant, each replica up to this many times."""
    fault_tolerant: bool = False
    """Per-step fault tolerance (torchft, as ddpkit run --fault-tolerant): --nproc replicas of one
    process each on every node; a replica that dies is restarted on its own and heals from a live
    peer while the others train on, to the same result."""
    min_replicas: int | None = None
    """With --fault-tolerant: the fewest replicas a step may commit with (default 1)."""
    quorum_timeout: float | None = None
    """With --fault-tolerant: seconds a replica waits for --min-replicas before it stops (default 60)."""
    secret_file: str | None = None
    """With --fault-tolerant across nodes: the job's secret, the same file (readable by you alone) on
    every node."""
    hang_timeout: float | None = None
    """Seconds in which no rank makes progress before the job counts as hung: ddpkit prints where
    each rank is and the stuck rank's stack, and exits (code 124) instead of waiting for the
    collective timeout. Must exceed the longest step, evaluation or save. Unset (the default):
    adaptive, a rank waiting minutes in a collective while a peer makes no progress; 0: off.
    A collective mismatch is named (exit 123) unless 0."""
    trackers: str | None = None
    """Experiment trackers, comma-separated: tensorboard, wandb, mlflow (default: tensorboard).
    W&B and MLflow continue the same run on every restart, requeue and --resume, each step once;
    they get a step's row once a checkpoint covers it. MLflow's store: MLFLOW_TRACKING_URI, else
    OUT_DIR/mlflow.db; W&B offline with WANDB_MODE=offline."""
    run_name: str | None = None
    """The run's name in W&B and MLflow."""
    log_every: int = 0
    """Also log train_loss_step (the batch's loss, averaged over ranks) every this many optimizer
    steps (0: only the epoch's train_loss)."""
    eval_batch_size: int = 256
    """Batch size of the per-epoch evaluation."""
    synthetic_size: int = 2048
    """Training samples of --data synthetic."""
    data_parallel: bool = False
    """One process driving all visible GPUs with torch.nn.DataParallel (for comparison only)."""
    overwrite: bool = False
    """Replace the run an --out-dir already holds (its checkpoints, metrics and summary; other files
    stay)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Settings a test or a later feature passes through unchanged."""

    @property
    def world_size(self) -> int:
        """Processes of the whole job: ``nproc`` on each of ``nnodes`` nodes."""
        return self.nproc * self.nnodes

    @property
    def samples_per_step(self) -> int:
        """Samples per optimizer step across all processes: ``batch_size`` x world, ``global_batch_size``, or 64."""
        if self.batch_size is not None:
            return self.batch_size * self.world_size
        return self.global_batch_size if self.global_batch_size is not None else 64

    @property
    def effective_lr(self) -> float:
        """``lr``, times the world size under ``scale_lr`` with a per-process ``batch_size``."""
        return self.lr * self.world_size if (self.scale_lr and self.batch_size is not None) else self.lr

    def to_json(self) -> str:
        """The settings as JSON, for the workers' ``--config-json``."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        """The settings :meth:`to_json` wrote."""
        return cls(**json.loads(text))

    @classmethod
    def renamed(cls, settings: dict[str, Any], *, source: str = "settings") -> dict[str, Any]:
        """``settings`` with earlier names (``ALIASES``) replaced by the fields' names.

        Raises:
            UsageError: a setting is given under both its names.
        """
        named: dict[str, Any] = {}
        for key, value in settings.items():
            name = cls.ALIASES.get(key, key)
            if name in named:
                old = next(o for o, n in cls.ALIASES.items() if n == name)
                raise UsageError(f"{source}: {old} is the earlier name of {name}; give one of them")
            named[name] = value
        return named


FIELD_NAMES = {f.name for f in fields(TrainConfig)}


def read_config_file(path: str) -> dict[str, Any]:
    """Settings from a YAML (.yaml/.yml) or TOML (.toml) file; keys may use - or _."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"config file {path} not found")
    text = file.read_text()
    try:
        if file.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif file.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            raise UsageError(f"config file {path}: use a .yaml, .yml or .toml file")
    except UsageError:
        raise
    except Exception as exc:  # yaml.YAMLError, tomllib.TOMLDecodeError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"config file {path} cannot be parsed: {first}") from None
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must hold a mapping of settings")
    settings = {str(key).replace("-", "_"): value for key, value in data.items()}
    unknown = sorted(set(settings) - FIELD_NAMES - set(TrainConfig.ALIASES))
    if unknown:
        raise UsageError(f"config file {path}: unknown setting(s) {', '.join(unknown)}")
    settings = TrainConfig.renamed(settings, source=f"config file {path}")
    for name, value in settings.items():
        _check_type(path, name, value)
    return settings


_KINDS = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "dict": (dict,)}
_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "dict": "a mapping"}


def _check_type(path: str, name: str, value: Any) -> None:
    """Config files are typed by hand: 'epochs: many' must be an error, not a crash later."""
    annotation = str(next(f.type for f in fields(TrainConfig) if f.name == name))
    kinds = [part.strip().split("[")[0] for part in annotation.split("|")]
    if value is None and "None" in kinds:
        return
    for kind in kinds:
        allowed = _KINDS.get(kind, ())
        if isinstance(value, allowed) and not (kind in ("int", "float") and isinstance(value, bool)):
            return
    wanted = " or ".join(_NAMES[k] for k in kinds if k in _NAMES)
    raise UsageError(f"config file {path}: {name} must be {wanted}, got {value!r}")


_DATA_PARALLEL = "DataParallel mode needs --nproc 1 and at least 2 visible GPUs"


def validate(config: TrainConfig) -> None:
    """Check everything that can be checked before a process starts or a file is written.

    :func:`check` first (the settings alone), then :func:`probe` (this machine: GPUs, files,
    the model). ``grad_compression="none"``, the flag's spelling of no compression, becomes None.

    Raises:
        UsageError: the first setting that would fail, in one line.
    """
    if config.grad_compression == "none":
        config.grad_compression = None
    check(config)
    probe(config)


def check(config: TrainConfig) -> None:
    """Check the settings by themselves: names, counts, batch sizes, combinations of flags.

    Looks at nothing outside ``config`` (no GPU, file or model), so it answers the same on every
    machine and in a test.

    Raises:
        UsageError: the first setting that is wrong, in one line.
    """

    if config.model not in MODELS:
        raise UsageError(f"unknown model {config.model!r}; choose one of {', '.join(MODELS)}")
    if config.data not in DATASETS:
        raise UsageError(f"unknown data {config.data!r}; choose one of {', '.join(DATASETS)}")
    if config.model == "tiny-lm" or config.data == "tokens":
        raise UsageError(
            "--model tiny-lm and --data tokens are ddpkit bench's language-model workload "
            "(ddpkit bench --model tiny-lm); ddpkit train classifies images: see examples/tiny_lm.py"
        )
    if config.data in ("mnist", "cifar10") and not config.data_dir:
        raise UsageError(f"--data {config.data} needs --data-dir DIR with torchvision's files; nothing is downloaded")
    if config.precision not in PRECISIONS:
        raise UsageError(f"unknown precision {config.precision!r}; choose one of {', '.join(PRECISIONS)}")
    check_counts(config)
    check_fault_tolerant(config)
    if config.data_parallel and config.nproc != 1:
        raise UsageError(_DATA_PARALLEL)
    check_compression(config)
    check_sync(config)
    check_micro_shards(config)
    check_strategy(config.strategy, config.cpu_offload, cli=True)
    if config.strategy == "fsdp" and config.data_parallel:
        raise UsageError("--strategy fsdp shards over processes; it does not combine with --data-parallel")
    if config.lr <= 0:
        raise UsageError(f"--lr must be positive, got {config.lr}")
    check_timeout(config.hang_timeout, flag="--hang-timeout")
    if config.trackers is not None:
        names(config.trackers)


def probe(config: TrainConfig) -> None:
    """Check ``config`` against this machine: ``--data-dir`` and ``--out-dir`` on disk, the GPUs that
    DataParallel needs, and (under fsdp) the model that would be sharded.

    Raises:
        UsageError: the first thing here that would make the run fail, in one line.
    """
    if config.data_dir and not os.path.isdir(config.data_dir):
        raise UsageError(f"--data-dir {config.data_dir} is not a directory")
    if config.data_parallel:
        import torch

        if torch.cuda.device_count() < 2:
            raise UsageError(_DATA_PARALLEL)
    if config.strategy == "fsdp":
        # what rt.setup refuses, before any process starts
        check_fsdp(
            grad_compression=config.grad_compression,
            compile=False,
            sync_batchnorm=config.sync_batchnorm,
            ddp_kwargs={},
            model=build_model(config.model, num_classes=10, in_channels=3, image_size=32),
        )
    check_out(config)
    if config.trackers is not None:  # what rank 0's init would refuse, before any process starts
        found = problem(names(config.trackers), config.out_dir)
        if found:
            raise UsageError(found)
