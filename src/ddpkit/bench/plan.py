"""What ``ddpkit bench`` measures: its settings, their validation, and the rows they plan.

:class:`Settings` is what the command was asked (``parse_settings`` reads it from the command
line); :func:`plan` turns it into the table's rows, one :class:`Configuration` each, with the
reason a row cannot run on this machine where it cannot. Nothing here starts a process:
:mod:`ddpkit.bench.run` runs the rows.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddpkit._argparse import Parser
from ddpkit.errors import UsageError

MODES = ("single", "dp", "ddp", "ddp-amp", "fsdp")
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "auto")
MODELS = ("convnet", "mlp", "mlp-large", "resnet18", "tiny-lm")
SYNCS = ("every-step", "local-sgd", "diloco")
DATA = ("synthetic", "digits")


@dataclass(frozen=True)
class Settings:
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
    sync_dtype: str | None = None  # the infrequent sync's exchange: fp32 (None) or bf16
    sync_fragments: int = 1  # Streaming DiLoCo: fragments, each exchanged at its own step
    sync_delay: int = 0  # Streaming DiLoCo: steps an exchange runs in the background
    diagnose_verify: bool = False  # measure the fix each row's diagnosis recommends, against its prediction
    fault_tolerant: bool = False  # compare --fault-tolerant with restart-all around a kill (ddpkit.bench.ft)
    kill_at: int | None = None  # the step after which one process is killed
    checkpoint_every: int = 8  # restart-all's checkpoints, in steps
    min_step_s: float = 0.0  # each fault-tolerant bench step lasts at least this long
    micro_shards: int | None = None  # single and DDP rows with rt.setup(micro_shards=M)


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


def plan(settings: Settings, gpus: int) -> list[Configuration]:
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
    return found


def _fsdp_reason(model: str, compression: str, sync_bn: bool = False) -> str | None:
    """Why strategy='fsdp' cannot run ``model`` with ``compression`` (what rt.setup refuses), or None."""
    if compression != "none":
        return "grad_compression is a DDP hook; fsdp reduce-scatters instead"
    if sync_bn:
        return "fsdp shards no BatchNorm, synchronised or not (--sync-bn on is a DDP row)"
    from ddpkit.parallel.fsdp import check
    from ddpkit.recipes.models import build_model

    try:
        check(
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
    from ddpkit.parallel.periodic_parts import check

    try:
        check(
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
    from ddpkit.parallel.compression import check

    if choice == "none":
        return None
    if world_size == 1:
        return f"{choice} compresses what processes send each other; one process sends nothing"
    try:
        check(choice, rank=2, start=None, backend=None, device=_cpu(), precision=precision, compile=False)
    except UsageError as exc:
        return str(exc)
    return None


def _cpu() -> Any:
    import torch

    return torch.device("cpu")


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(dict.fromkeys(int(part) for part in text.split(",")))
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated integers such as 1,2,4, got {text!r}") from None
    if min(values) < 1:
        raise UsageError(f"{flag} values must be at least 1, got {text!r}")
    return values


def _links(text: str) -> tuple[float, ...]:
    """``--link-mbit 10,100``: positive Mbit/s values, in the order given, once each."""
    try:
        values = tuple(dict.fromkeys(float(part) for part in text.split(",")))
    except ValueError:
        raise UsageError(f"--link-mbit must be a positive number of Mbit/s, got {text!r}") from None
    if any(not v > 0 for v in values):
        raise UsageError(f"--link-mbit must be a positive number of Mbit/s, got {text!r}")
    return values


def parser() -> argparse.ArgumentParser:
    """The parser of ``ddpkit bench`` (read by :func:`parse_settings`)."""
    d = Settings()
    parser = Parser(
        prog="ddpkit bench",
        description="Measure throughput, scaling, memory and where "
        "each step's time goes, per mode, in fresh processes; writes bench.json, bench.md "
        "and scaling.png into --out.",
    )
    add = parser.add_argument
    add("--model", choices=MODELS, default=d.model, help=f"model (default {d.model})")
    add("--data", choices=DATA, default=d.data, help=f"data set (default {d.data})")
    add("--modes", default=",".join(d.modes), help=f"comma-separated {'|'.join(MODES)} (default all)")
    add("--nproc", default="2", help="comma-separated process counts of ddp and ddp-amp (default 2)")
    add("--batch", type=int, default=d.batch, help=f"samples per process per step (default {d.batch})")
    add("--steps", type=int, default=d.steps, help=f"timed steps (default {d.steps})")
    add("--warmup", type=int, default=d.warmup, help=f"untimed steps before them (default {d.warmup})")
    add("--seed", type=int, default=d.seed, help=f"seed of weights and data order (default {d.seed})")
    add("--lr", type=float, default=d.lr, help=f"SGD learning rate (default {d.lr})")
    add("--momentum", type=float, default=d.momentum, help=f"SGD momentum (default {d.momentum})")
    add("--out", default=d.out, help=f"output directory (default {d.out})")
    add(
        "--compare-raw",
        action="store_true",
        help="also run a plain PyTorch DDP loop and ddpkit interleaved "
        "(the first ddp/ddp-amp mode, at the largest --nproc) and compare step time, memory and weights",
    )
    add("--repeats", type=int, default=d.repeats, help=f"raw/ddpkit pairs of --compare-raw (default {d.repeats})")
    add(
        "--grad-compression",
        default="none",
        help=f"comma-separated {'|'.join(COMPRESSIONS)}: gradient "
        "compression of the ddp and ddp-amp modes, one row each (default none)",
    )
    add(
        "--hosts",
        default=None,
        help="comma-separated counts of simulated hosts (network namespaces "
        "on a bridge, needs root), --nproc processes each; needs --link-mbit",
    )
    add(
        "--link-mbit",
        default=None,
        help="each simulated host's link speed in Mbit/s (tc tbf); comma-separated "
        "speeds run every hosts row on each, one after the other (10000 stands in for an unshaped link)",
    )
    add(
        "--optimizer",
        choices=("sgd", "adamw"),
        default=d.optimizer,
        help=f"optimizer (default {d.optimizer}); "
        "adamw holds 2 state tensors per parameter, what sharding (fsdp) divides",
    )
    add(
        "--sync-bn",
        default="off",
        help="comma-separated off|on: ddp and ddp-amp rows with BatchNorm "
        "statistics over every process (SyncBatchNorm, ddpkit train's default), one row each (default off)",
    )
    add(
        "--sync",
        default="every-step",
        help=f"comma-separated {'|'.join(SYNCS)}: ddp and ddp-amp rows "
        "whose ranks meet every step, or train apart and meet every --sync-every steps, one row each "
        "(default every-step)",
    )
    add("--sync-every", type=int, default=None, help="optimizer steps between the syncs of local-sgd and diloco")
    add(
        "--sync-dtype",
        choices=("fp32", "bf16"),
        default=None,
        help="the exchange of local-sgd and diloco rows (default fp32)",
    )
    add(
        "--sync-fragments",
        type=int,
        default=1,
        help="local-sgd and diloco rows: the model in F fragments, "
        "each exchanged at its own step of the period (Streaming DiLoCo; default 1)",
    )
    add(
        "--sync-delay",
        type=int,
        default=0,
        help="local-sgd and diloco rows: inner steps each exchange runs in "
        "the background before it is applied (Streaming DiLoCo; default 0)",
    )
    add("--powersgd-rank", type=int, default=None, help="rank of the PowerSGD rows' factors (default: rt.setup's)")
    add(
        "--diagnose-verify",
        action="store_true",
        help="run the fix each row's diagnosis recommends "
        "(the one predicting the most samples/s) and print predicted vs measured samples/s; a prediction "
        "more than 30%% off is flagged as a diagnosis error",
    )
    add(
        "--fault-tolerant",
        action="store_true",
        help="instead of the table: kill one process after --kill-at "
        "and compare ddpkit run --fault-tolerant (it heals) with restart-all (--max-restarts, from the newest "
        "checkpoint) and an uninterrupted run; --nproc replicas, --batch per replica, --steps in all",
    )
    add(
        "--kill-at",
        type=int,
        default=None,
        metavar="STEP",
        help="with --fault-tolerant: the step after which process 1 is SIGKILLed",
    )
    add(
        "--checkpoint-every",
        type=int,
        default=8,
        help="with --fault-tolerant: restart-all's checkpoint interval in steps (default 8)",
    )
    add(
        "--min-step-s",
        type=float,
        default=0.0,
        metavar="S",
        help="with --fault-tolerant: each step lasts at "
        "least S seconds (the loop sleeps out the rest), standing in for a larger model's step (default 0)",
    )
    add(
        "--data-format",
        default="map",
        help="comma-separated map|shards: the data set as it is, or the same "
        "samples as a ddpkit.Shards stream of 16 shards, one row each (default map)",
    )
    add(
        "--micro-shards",
        type=int,
        default=None,
        metavar="M",
        help="every row trains with rt.setup(micro_shards=M): "
        "each global batch in M shards summed along one fixed tree, the same bits on any power-of-two --nproc "
        "dividing M (ddpkit.parallel.exact); the exchange is one all_gather after the backward passes",
    )
    return parser


def _check_micro_shards(
    opts: Any,
    modes: Sequence[str],
    compressions: Sequence[str],
    formats: Sequence[str],
    syncs: Sequence[str],
    syncs_of_rows: Sequence[str],
    hosts: Sequence[int],
) -> None:
    """What ``--micro-shards`` does not combine with, in one line (``rt.setup`` refuses the same)."""
    from ddpkit.parallel.exact_tree import check

    refused = [
        ("--modes dp or fsdp", set(modes) & {"dp", "fsdp"}),
        ("--compare-raw", opts.compare_raw),
        ("--fault-tolerant", opts.fault_tolerant),
        ("--data-format shards", "shards" in formats),
        ("--grad-compression", set(compressions) - {"none"}),
        ("--sync-bn on", "on" in syncs),
        ("--sync local-sgd or diloco", set(syncs_of_rows) - {"every-step"}),
    ]
    for flag, bad in refused:
        if bad:
            raise UsageError(f"--micro-shards does not combine with {flag}; drop one of the two")
    for n in _int_list(opts.nproc, "--nproc"):
        try:
            check(
                opts.micro_shards,
                world_size=n * max(hosts or (1,)),
                sync_batchnorm=False,
                grad_compression=None,
                strategy="ddp",
                sync="every-step",
                compile=False,
                ddp_kwargs={},
            )
        except UsageError as exc:
            raise UsageError(
                str(exc).replace("micro_shards=", "--micro-shards ").replace("micro_shards to", "--micro-shards to")
            ) from None


def parse_settings(argv: Sequence[str]) -> Settings:
    """Validated :class:`Settings` from ``ddpkit bench`` arguments.

    Raises:
        UsageError: unknown flag or mode, or a count out of range.
    """
    opts = parser().parse_args(argv)
    modes = tuple(dict.fromkeys(m.strip() for m in opts.modes.split(",")))
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise UsageError(f"unknown mode {unknown[0]!r} in --modes; choose from {', '.join(MODES)}")
    for flag, value, low in (
        ("--batch", opts.batch, 1),
        ("--steps", opts.steps, 1),
        ("--warmup", opts.warmup, 0),
        ("--repeats", opts.repeats, 1),
    ):
        if value < low:
            raise UsageError(f"{flag} must be at least {low}, got {value}")
    compressions = tuple(dict.fromkeys(c.strip() for c in opts.grad_compression.split(",")))
    unknown = [c for c in compressions if c not in COMPRESSIONS]
    if unknown:
        raise UsageError(
            f"unknown compression {unknown[0]!r} in --grad-compression; choose from {', '.join(COMPRESSIONS)}"
        )
    formats = tuple(dict.fromkeys(f.strip() for f in opts.data_format.split(",")))
    if set(formats) - {"map", "shards"}:
        raise UsageError(
            f"unknown data format {sorted(set(formats) - {'map', 'shards'})[0]!r} in --data-format; "
            "choose from map, shards"
        )
    syncs = tuple(dict.fromkeys(v.strip() for v in opts.sync_bn.split(",")))
    if set(syncs) - {"off", "on"}:
        raise UsageError(f"--sync-bn takes off, on or off,on, got {opts.sync_bn!r}")
    if opts.model == "tiny-lm" and opts.data != "synthetic":
        raise UsageError(f"--model tiny-lm trains on synthetic token sequences; drop --data {opts.data}")
    syncs_of_rows = tuple(dict.fromkeys(v.strip() for v in opts.sync.split(",")))
    unknown = [v for v in syncs_of_rows if v not in SYNCS]
    if unknown:
        raise UsageError(f"unknown sync {unknown[0]!r} in --sync; choose from {', '.join(SYNCS)}")
    if set(syncs_of_rows) - {"every-step"} and (opts.sync_every is None or opts.sync_every < 1):
        raise UsageError(
            "--sync local-sgd or diloco needs --sync-every H, the optimizer steps between syncs (1 or more)"
        )
    if opts.sync_every is not None and not set(syncs_of_rows) - {"every-step"}:
        raise UsageError("--sync-every sets how often local-sgd or diloco meet; add --sync every-step,diloco")
    if (opts.sync_fragments != 1 or opts.sync_delay != 0) and not set(syncs_of_rows) - {"every-step"}:
        raise UsageError(
            "--sync-fragments and --sync-delay stream the exchange of local-sgd or diloco; add --sync every-step,diloco"
        )
    if opts.sync_every is not None:
        from ddpkit.parallel.periodic_parts import check as check_sync

        check_sync(
            "diloco",
            every=opts.sync_every,
            sync_dtype=opts.sync_dtype,
            strategy="ddp",
            grad_compression=None,
            sync_batchnorm=False,
            precision="fp32",
            fragments=opts.sync_fragments,
            delay=opts.sync_delay,
        )
    hosts = _int_list(opts.hosts, "--hosts") if opts.hosts is not None else ()
    if hosts and opts.link_mbit is None:
        raise UsageError("--hosts needs --link-mbit M, the speed of each simulated host's link")
    if opts.link_mbit is not None and not hosts:
        raise UsageError("--link-mbit shapes the links of simulated hosts; add --hosts H")
    links = _links(opts.link_mbit) if opts.link_mbit is not None else ()
    if hosts and not {"ddp", "ddp-amp"} & set(modes):
        raise UsageError("--hosts runs DDP across simulated hosts; add ddp or ddp-amp to --modes")
    if opts.fault_tolerant:
        if opts.kill_at is None or not 1 <= opts.kill_at < opts.steps:
            raise UsageError("--fault-tolerant needs --kill-at STEP, a step between 1 and --steps - 1")
        counts = _int_list(opts.nproc, "--nproc")
        if len(counts) != 1 or len(hosts) > 1 or counts[0] * (hosts[0] if hosts else 1) < 2:
            raise UsageError("--fault-tolerant runs one --nproc (and at most one --hosts) of 2 or more replicas in all")
        if len(links) > 1:
            raise UsageError("--fault-tolerant runs on one --link-mbit; give one speed")
        if opts.checkpoint_every < 1:
            raise UsageError(f"--checkpoint-every must be at least 1, got {opts.checkpoint_every}")
        if opts.min_step_s < 0:
            raise UsageError(f"--min-step-s must be 0 or more seconds, got {opts.min_step_s}")
    elif opts.kill_at is not None:
        raise UsageError("--kill-at kills a process in --fault-tolerant's comparison; add --fault-tolerant")
    elif opts.min_step_s:
        raise UsageError("--min-step-s lengthens the steps of --fault-tolerant's comparison; add --fault-tolerant")
    if opts.micro_shards is not None:
        _check_micro_shards(opts, modes, compressions, formats, syncs, syncs_of_rows, hosts)
    settings = Settings(
        model=opts.model,
        data=opts.data,
        modes=modes,
        nproc=_int_list(opts.nproc, "--nproc"),
        batch=opts.batch,
        steps=opts.steps,
        warmup=opts.warmup,
        seed=opts.seed,
        lr=opts.lr,
        momentum=opts.momentum,
        out=opts.out,
        compare_raw=opts.compare_raw,
        repeats=opts.repeats,
        grad_compression=compressions,
        hosts=hosts,
        link_mbit=links[0] if links else None,
        links=links,
        data_format=formats,
        optimizer=opts.optimizer,
        diagnose_verify=opts.diagnose_verify,
        sync_bn=tuple(v == "on" for v in syncs),
        sync=syncs_of_rows,
        sync_every=opts.sync_every,
        powersgd_rank=opts.powersgd_rank,
        sync_dtype=opts.sync_dtype,
        sync_fragments=opts.sync_fragments,
        sync_delay=opts.sync_delay,
        fault_tolerant=opts.fault_tolerant,
        kill_at=opts.kill_at,
        checkpoint_every=opts.checkpoint_every,
        min_step_s=opts.min_step_s,
        micro_shards=opts.micro_shards,
    )
    if settings.compare_raw and not {"ddp", "ddp-amp"} & set(modes):
        raise UsageError("--compare-raw compares a DDP run; add ddp or ddp-amp to --modes")
    if settings.compare_raw and max(settings.nproc) * max(hosts or (1,)) < 2:
        raise UsageError("--compare-raw compares DDP runs of 2 or more processes; give --nproc 2")
    return settings
