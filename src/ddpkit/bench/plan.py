"""What ``ddpkit bench`` measures: its settings, their validation, and the rows they plan.

:class:`BenchSettings` is what the command was asked (``parse_settings`` reads it from the command
line); :func:`plan` turns it into the table's rows, one :class:`Configuration` each, with the
reason a row cannot run on this machine where it cannot. Nothing here starts a process:
:mod:`ddpkit.bench.run` runs the rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ddpkit.errors import UsageError
from ddpkit.parallel import compression, fsdp, periodic_parts
from ddpkit.recipes.models import build_model

MODES = ("single", "dp", "ddp", "ddp-amp", "fsdp")
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "auto")
MODELS = ("convnet", "mlp", "mlp-large", "resnet18", "tiny-lm")
DATA = ("synthetic", "digits")


@dataclass(frozen=True)
class BenchSettings:
    """What ``ddpkit bench`` was asked to measure (validated)."""

    model: str = "convnet"
    data: str = "synthetic"
    modes: tuple[str, ...] = ("single", "dp", "ddp", "ddp-amp")
    nproc: tuple[int, ...] = (2,)
    batch: int = 32  # samples per process (per GPU for dp) per step
    steps: int = 50  # timed steps
    warmup: int = 5  # untimed steps before them
    seed: int = 0
    lr: float = 0.05
    momentum: float = 0.9
    out: str = "runs/bench"
    compare_raw: bool = False
    repeats: int = 3  # raw/ddpkit pairs of --compare-raw
    grad_compression: tuple[str, ...] = ("none",)
    hosts: tuple[int, ...] = ()  # simulated hosts per DDP configuration; () runs on this machine as is
    link_mbit: float | None = None  # the first of ``links`` (each simulated host's link)
    links: tuple[float, ...] = ()  # every --link-mbit value: the hosts' rows run on each
    data_format: tuple[str, ...] = ("map",)  # map: the Dataset; shards: the same samples as ddpkit.Shards
    optimizer: str = "sgd"
    sync_bn: tuple[bool, ...] = (False,)  # DDP rows with BatchNorm synchronised across processes, one row each
    sync: tuple[str, ...] = ("every-step",)  # DDP rows synced every step, or infrequently (one row each)
    sync_every: int | None = None  # optimizer steps between infrequent syncs
    powersgd_rank: int | None = None  # PowerSGD rows' rank (None: rt.setup's default)
    sync_dtype: str | None = None  # the infrequent sync's exchange: bf16 (None), fp32, int8 or sparse
    sync_fragments: int = 1  # Streaming DiLoCo: fragments, each exchanged at its own step
    sync_delay: int = 0  # Streaming DiLoCo: steps an exchange runs in the background
    diagnose_verify: bool = False  # measure the fix each row's diagnosis recommends, against its prediction
    fault_tolerant: bool = False  # compare --fault-tolerant with restart-all around a kill (ddpkit.bench.ft)
    kill_at: int | None = None  # the step after which one process is killed
    checkpoint_every: int = 8  # restart-all's checkpoints, in steps
    min_step_s: float = 0.0  # each fault-tolerant bench step lasts at least this long
    micro_shards: int | None = None  # single and DDP rows with rt.setup(micro_shards=M)
    compare_exact: bool = False  # beside each DDP row, the same row with micro_shards = its world size
    checkpoints: bool = False  # what a save costs the loop instead of the table (ddpkit.bench.ckpt)


@dataclass(frozen=True)
class Configuration:
    """One row of the table: a mode, its processes, its precision and its devices."""

    mode: str
    nproc: int
    precision: str
    devices: int = 1  # GPUs one process drives (DataParallel), else 1
    reason: str | None = None  # why it cannot run here, when it cannot
    grad_compression: str = "none"
    hosts: int = 0  # simulated hosts (nproc processes each), 0: this machine as is
    data_format: str = "map"
    sync_bn: bool = False  # BatchNorm statistics across processes (ddpkit train's default)
    sync: str = "every-step"  # or "local-sgd" / "diloco": train apart, meet every --sync-every steps
    link_mbit: float | None = None  # the simulated hosts' link (with ``hosts``)
    micro_shards: int | None = None  # rt.setup(micro_shards=M): the same bits on any power-of-two world size

    @property
    def world_size(self) -> int:
        """Processes of the whole job: ``nproc`` on each simulated host, or on this machine."""
        return self.nproc * max(self.hosts, 1)

    @property
    def name(self) -> str:
        """``ddp-h2-x1-fp32-powersgd``: the row's file name under ``--out``/runs."""
        hosts = f"-h{self.hosts}" + (f"-{self.link_mbit:g}mbit" if self.link_mbit else "") if self.hosts else ""
        comp = f"-{self.grad_compression}" if self.grad_compression != "none" else ""
        data = f"-{self.data_format}" if self.data_format != "map" else ""
        sync = ("-syncbn" if self.sync_bn else "") + (f"-{self.sync}" if self.sync != "every-step" else "")
        sync += f"-ms{self.micro_shards}" if self.micro_shards else ""
        return f"{self.mode}{hosts}-x{self.nproc}-{self.precision}{comp}{sync}{data}"

    @property
    def label(self) -> str:
        """``ddp 2 host(s) x1 fp32 powersgd``: the row as the progress lines name it."""
        hosts = (
            f" {self.hosts} host(s)" + (f" at {self.link_mbit:g} Mbit/s" if self.link_mbit else "")
            if self.hosts
            else ""
        )
        comp = f" {self.grad_compression}" if self.grad_compression != "none" else ""
        data = f" {self.data_format}" if self.data_format != "map" else ""
        sync = (" syncbn" if self.sync_bn else "") + (f" {self.sync}" if self.sync != "every-step" else "")
        sync += f" micro-shards {self.micro_shards}" if self.micro_shards else ""
        return f"{self.mode}{hosts} x{self.nproc} {self.precision}{comp}{sync}{data}"


def plan(settings: BenchSettings, gpus: int) -> list[Configuration]:
    """The configurations of ``settings`` in order: each mode, each ``--nproc`` for DDP."""
    amp = "fp16" if gpus else "bf16"
    found: list[Configuration] = []
    for mode in settings.modes:
        if mode == "single":
            found.append(Configuration("single", 1, "fp32"))
        elif mode == "dp":
            reason = None if gpus >= 2 else f"DataParallel needs 2 or more visible GPUs, {gpus} visible"
            found.append(Configuration("dp", 1, "fp32", devices=max(gpus, 1), reason=reason))
        else:
            precision = amp if mode == "ddp-amp" else "fp32"
            found += [
                Configuration(
                    mode,
                    n,
                    precision,
                    grad_compression=comp,
                    hosts=h,
                    sync_bn=bn,
                    sync=sync,
                    reason=_fsdp_reason(settings.model, comp, bn)
                    if mode == "fsdp"
                    else _sync_reason(sync, comp, bn, precision) or _compression_reason(comp, precision, n * max(h, 1)),
                )
                for h in settings.hosts or (0,)
                for n in settings.nproc
                for comp in settings.grad_compression
                for bn in settings.sync_bn
                for sync in settings.sync
            ]
    if settings.links:  # every row on simulated hosts, once on each link
        found = [
            dataclasses.replace(c, link_mbit=link) if c.hosts else c
            for c in found
            for link in (settings.links if c.hosts else (None,))
        ]
    found = [dataclasses.replace(c, data_format=f) for c in found for f in settings.data_format]
    if settings.micro_shards:
        found = [dataclasses.replace(c, micro_shards=settings.micro_shards) for c in found]
    if settings.compare_exact:  # each plain fp32 DDP row, then the same row with micro_shards=W
        found = [x for c in found for x in ([c, _exact_twin(c)] if _has_exact_twin(c) else [c])]
    return found


def _has_exact_twin(config: Configuration) -> bool:
    return (
        config.mode == "ddp"
        and config.grad_compression == "none"
        and config.sync == "every-step"
        and not config.sync_bn
        and config.data_format == "map"
    )


def _exact_twin(config: Configuration) -> Configuration:
    """``config`` with ``micro_shards`` = its world size (a reason where that world size cannot be exact)."""
    world = config.world_size
    reason = config.reason
    if reason is None and world & (world - 1):
        reason = f"micro_shards needs a power-of-two world size, this row has {world}"
    return dataclasses.replace(config, micro_shards=world, reason=reason)


def _fsdp_reason(model: str, compression: str, sync_bn: bool = False) -> str | None:
    """Why strategy='fsdp' cannot run ``model`` with ``compression`` (what rt.setup refuses), or None."""
    if compression != "none":
        return "grad_compression is a DDP hook; fsdp reduce-scatters instead"
    if sync_bn:
        return "fsdp shards no BatchNorm, synchronised or not (--sync-batchnorm on is a DDP row)"

    try:
        fsdp.check(
            grad_compression=None,
            compile=False,
            sync_batchnorm=False,
            ddp_kwargs={},
            model=build_model(model, num_classes=10, in_channels=3, image_size=32),
        )
    except UsageError as exc:
        return f"{exc} (--model {model}; mlp and mlp-large run)"
    return None


def _sync_reason(sync: str, compression: str, sync_bn: bool, precision: str) -> str | None:
    """Why an infrequent ``sync`` row cannot run (what ``rt.setup`` refuses), or None."""
    if sync == "every-step":
        return None

    try:
        periodic_parts.check(
            sync,
            every=1,
            sync_dtype=None,
            strategy="ddp",
            grad_compression=None if compression == "none" else compression,
            sync_batchnorm=sync_bn,
            precision=precision,
        )
    except UsageError as exc:
        return str(exc)
    return None


def _compression_reason(choice: str, precision: str, world_size: int) -> str | None:
    """Why ``choice`` cannot run here (PowerSGD under fp16 loss scaling, one process), or None."""
    if choice == "none":
        return None
    if world_size == 1:
        return f"{choice} compresses what processes send each other; one process sends nothing"
    try:
        compression.check(choice, rank=2, start=None, backend=None, device=_cpu(), precision=precision, compile=False)
    except UsageError as exc:
        return str(exc)
    return None


def _cpu() -> Any:
    import torch

    return torch.device("cpu")
