"""``ddpkit bench``: throughput, scaling, memory and a per-step breakdown of each mode.

Every configuration runs in fresh processes (:mod:`ddpkit.bench_worker` under
``torch.distributed.run``, as ``ddpkit run`` starts it); this module only plans, launches and
reports. ``--compare-raw`` also runs a hand-written PyTorch DDP loop (:mod:`ddpkit._raw_ddp`)
and ddpkit interleaved, A B A B ..., so slow drift of the machine hits both alike::

    ddpkit bench --model convnet --data synthetic --modes single,ddp,ddp-amp --nproc 2 \\
        --batch 32 --steps 50 --warmup 5 --out runs/bench
    ddpkit bench --modes ddp --nproc 2 --compare-raw --repeats 5 --out runs/parity
    ddpkit bench --model resnet18 --modes ddp --hosts 1,2 --nproc 1 --link-mbit 100 \\
        --grad-compression none,powersgd --batch 16 --steps 5 --warmup 2 --out runs/link

``--hosts H`` runs each configuration on H simulated hosts (:mod:`ddpkit.netsim`: a network
namespace each, joined by a bridge, every link shaped to ``--link-mbit`` by ``tc``), ``--nproc``
processes per host, so the gradients cross a link as slow as real Ethernet between machines.

Statistics: per step, the world's step time is its slowest rank's; ``samples_per_second`` is
the global batch over the median of those, over the timed steps only. ``breakdown`` is the
mean seconds per step of each phase over ranks and steps, so its phases add up to at most
``mean_step_seconds``. ``comm.allreduce_gb_per_s`` is the gradient bytes over the median time
of one allreduce of all of them at once, timed after the steps (algorithm bandwidth). Memory
is in MiB: the peak RSS of the largest rank, and CUDA's max allocated on GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ddpkit.bench_report import PHASES, diagnose, write_outputs
from ddpkit.cliparse import Parser
from ddpkit.errors import DdpkitError, UsageError

MODES = ("single", "dp", "ddp", "ddp-amp", "fsdp")
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
HOST_PORT = 29500           # the rendezvous port on simulated host 0 (a fresh namespace: nothing else there)
MODELS = ("convnet", "mlp", "mlp-large", "resnet18")
DATA = ("synthetic", "digits")


@dataclass(frozen=True)
class Settings:
    """What ``ddpkit bench`` was asked to measure (validated)."""

    model: str = "convnet"
    data: str = "synthetic"
    modes: tuple[str, ...] = ("single", "dp", "ddp", "ddp-amp")
    nproc: tuple[int, ...] = (2,)
    batch: int = 32              # samples per process (per GPU for dp) per step
    steps: int = 50              # timed steps
    warmup: int = 5              # untimed steps before them
    seed: int = 0
    lr: float = 0.05
    momentum: float = 0.9
    out: str = "runs/bench"
    compare_raw: bool = False
    repeats: int = 3             # raw/ddpkit pairs of --compare-raw
    grad_compression: tuple[str, ...] = ("none",)
    hosts: tuple[int, ...] = ()  # simulated hosts per DDP configuration; () runs on this machine as is
    link_mbit: float | None = None
    data_format: tuple[str, ...] = ("map",)   # map: the Dataset; shards: the same samples as ddpkit.Shards
    optimizer: str = "sgd"


@dataclass(frozen=True)
class Configuration:
    """One row of the table: a mode, its processes, its precision and its devices."""

    mode: str
    nproc: int
    precision: str
    devices: int = 1             # GPUs one process drives (DataParallel), else 1
    reason: str | None = None    # why it cannot run here, when it cannot
    grad_compression: str = "none"
    hosts: int = 0               # simulated hosts (nproc processes each), 0: this machine as is
    data_format: str = "map"

    @property
    def world_size(self) -> int:
        return self.nproc * max(self.hosts, 1)

    @property
    def name(self) -> str:
        hosts = f"-h{self.hosts}" if self.hosts else ""
        comp = f"-{self.grad_compression}" if self.grad_compression != "none" else ""
        data = f"-{self.data_format}" if self.data_format != "map" else ""
        return f"{self.mode}{hosts}-x{self.nproc}-{self.precision}{comp}{data}"

    @property
    def label(self) -> str:
        hosts = f" {self.hosts} host(s)" if self.hosts else ""
        comp = f" {self.grad_compression}" if self.grad_compression != "none" else ""
        data = f" {self.data_format}" if self.data_format != "map" else ""
        return f"{self.mode}{hosts} x{self.nproc} {self.precision}{comp}{data}"


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
            found += [Configuration(mode, n, precision, grad_compression=comp, hosts=h,
                                    reason=_fsdp_reason(settings.model, comp) if mode == "fsdp"
                                    else _compression_reason(comp, precision, n * max(h, 1)))
                      for h in settings.hosts or (0,) for n in settings.nproc for comp in settings.grad_compression]
    return [dataclasses.replace(c, data_format=f) for c in found for f in settings.data_format]


def _fsdp_reason(model: str, compression: str) -> str | None:
    """Why strategy='fsdp' cannot run ``model`` with ``compression`` (what rt.setup refuses), or None."""
    if compression != "none":
        return "grad_compression is a DDP hook; fsdp reduce-scatters instead"
    from ddpkit.parallel.fsdp import check
    from ddpkit.recipes.models import build_model

    try:
        check(grad_compression=None, compile=False, sync_batchnorm=False, ddp_kwargs={},
              model=build_model(model, num_classes=10, in_channels=3, image_size=32))
    except UsageError as exc:
        return f"{exc} (--model {model}; mlp and mlp-large run)"
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


RAW_LOOP = "ddpkit._raw_ddp"
DDPKIT_LOOP = "ddpkit.bench_worker"


def run_loop(config: Configuration, settings: Settings, result: Path, *, target: str = DDPKIT_LOOP) -> dict[str, Any]:
    """Run the loop module ``target`` as ``config`` in fresh processes; return what its rank 0 wrote.

    ``target`` takes :func:`ddpkit.bench_worker.worker_parser`'s arguments and writes
    :func:`ddpkit.bench_worker.write_result`'s file: ddpkit's loop, the hand-written one
    (:data:`RAW_LOOP`), or another library's (``benchmarks/peers.py``).
    """
    from ddpkit.dist.torchrun import RunSpec, run

    args = ["--model", settings.model, "--data", settings.data, "--precision", config.precision,
            "--batch", str(settings.batch), "--steps", str(settings.steps), "--warmup", str(settings.warmup),
            "--seed", str(settings.seed), "--lr", repr(settings.lr), "--momentum", repr(settings.momentum),
            "--result", str(result), "--grad-compression", config.grad_compression,
            "--data-format", config.data_format, "--optimizer", settings.optimizer,
            "--strategy", "fsdp" if config.mode == "fsdp" else "ddp"]
    if config.mode == "dp":
        args.append("--data-parallel")
    result.unlink(missing_ok=True)
    if config.hosts:
        code = _run_on_hosts(config, settings, target, args)
    else:
        code = run(RunSpec(target, args, module=True, nproc_per_node=config.nproc))
    if code != 0 or not result.is_file():
        loop = {DDPKIT_LOOP: "", RAW_LOOP: "raw "}.get(target, f"{target} ")
        raise DdpkitError(f"bench {loop}{config.label} failed (exit code {code}); "
                          "see its output above")
    return json.loads(result.read_text())


def measure(config: Configuration, settings: Settings, result: Path) -> dict[str, Any]:
    """One bench row for ``config``: run it in fresh processes and summarise (no speed-up yet)."""
    return summarize(config, run_loop(config, settings, result))


def _run_on_hosts(config: Configuration, settings: Settings, target: str, args: list[str]) -> int:
    """``ddpkit run`` of ``target`` on each simulated host; the first failure's exit code, else 0.

    Each host is one node of a multi-node job whose rendezvous is host 0. When a host fails the
    others get a grace period to notice, then the simulation ends (it kills what is left).
    """
    import os
    import sys
    import time

    from ddpkit import netsim
    from ddpkit.dist.host import usable_cores

    with netsim.SimulatedHosts(config.hosts, float(settings.link_mbit or 0)) as sim:
        master = f"{sim.addresses[0]}:{HOST_PORT}"
        # NCCL would reach another GPU of this machine over shared memory or NVLink: the link is the point.
        env = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
        if "OMP_NUM_THREADS" not in os.environ:      # the hosts share this machine's cores
            env["OMP_NUM_THREADS"] = str(max(1, usable_cores() // config.world_size))
        procs = [sim.popen(host, [sys.executable, "-m", "ddpkit.cli", "run", "--nnodes", str(config.hosts),
                                  "--node-rank", str(host), "--master", master, "-n", str(config.nproc),
                                  "-m", target, *args], env={**env, **_gpus_of_host(host, config.nproc)})
                 for host in range(config.hosts)]
        failed_at = None
        while True:
            codes = [p.poll() for p in procs]
            if all(code is not None for code in codes):
                break
            if failed_at is None and any(code not in (None, 0) for code in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > 30:
                break                          # the simulation's close kills the rest
            time.sleep(0.5)
    return next((code for code in codes if code not in (None, 0)), 0 if None not in codes else 1)


def _gpus_of_host(host: int, nproc: int) -> dict[str, str]:
    """On a GPU machine each simulated host sees its own GPUs (local ranks count from 0 on each)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[host * nproc:(host + 1) * nproc])}


def summarize(config: Configuration, result: Mapping[str, Any]) -> dict[str, Any]:
    """One table row from a worker's per-rank measurements (no speed-up yet)."""
    ranks = result["ranks"]
    world_steps = [max(steps) for steps in zip(*(r["steps"] for r in ranks))]
    median_step = statistics.median(world_steps)
    count = len(ranks) * len(world_steps)
    breakdown = {phase: sum(r["phases"][k][i] for r in ranks for k in range(len(world_steps))) / count
                 for i, phase in enumerate(PHASES)}
    allreduce = ranks[0]["allreduce_seconds"]
    comm, overlap = None, None
    world = len(ranks)
    payload = statistics.fmean(r.get("payload_bytes_per_step", 0) for r in ranks)
    if allreduce is not None:
        grad_bytes = ranks[0]["grad_bytes"]
        sent = payload / grad_bytes if 0 < payload < grad_bytes else 1.0     # compressed: a fraction
        overlap, exposed, of_possible = _overlap(ranks, allreduce * sent)
        if sent < 1:
            # the backward under no_sync skips the hook, so what a compressed step's backward took
            # beyond it is the compressor's own work as well as the wait: no share of the wire's
            overlap = of_possible = None
        comm = {"grad_bytes_per_step": grad_bytes, "allreduce_seconds": allreduce,
                "allreduce_gb_per_s": grad_bytes / allreduce / 1e9 if allreduce > 0 else None,
                "exposed_seconds": exposed, "overlap_of_possible": of_possible}
    cuda = [r["peak_cuda_mb"] for r in ranks]
    return {
        "mode": config.mode, "nproc": config.nproc, "precision": config.precision, "applicable": True,
        "grad_compression": config.grad_compression, "hosts": config.hosts or None,
        "link_mbit": None, "world_size": world, "data_format": config.data_format,
        # what each rank hands to allreduce per step, and what a ring allreduce sends of it
        "payload_bytes_per_step": payload,
        "bytes_sent_per_step": payload * 2 * (world - 1) / world if world > 1 else 0.0,
        "device": result["device"], "devices": config.devices,
        "batch_per_process": result["batch_per_process"], "global_batch": result["global_batch"],
        "samples_per_second": result["global_batch"] / median_step,
        "step_seconds": median_step, "mean_step_seconds": statistics.fmean(world_steps),
        "speedup": None, "efficiency": None,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "peak_rss_mb_per_rank": [r["peak_rss_mb"] for r in ranks],
        # parameters + gradients + optimizer state this rank holds (DDP: all; fsdp: its shards)
        "state_bytes_per_rank": [r.get("state_bytes") for r in ranks],
        "peak_cuda_mb": max(cuda) if None not in cuda else None,
        "breakdown": breakdown, "comm": comm,
        # the share of the allreduce hidden behind the backward pass (None: not measured)
        "comm_overlap": overlap,
        "threads_per_process": ranks[0]["threads"], "cores": ranks[0]["cores"],
        "weights_sha256": ranks[0]["weights_sha256"],
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
    exposed = statistics.fmean(max(0.0, statistics.median(p[backward] for p in r["phases"]) - a)
                               for r, a in zip(ranks, alone))
    hidden = max(0.0, allreduce - exposed)
    possible = min(allreduce, statistics.fmean(alone))
    return min(1.0, hidden / allreduce), exposed, (min(1.0, hidden / possible) if possible > 0 else None)


def _not_applicable(config: Configuration, link_mbit: float | None = None) -> dict[str, Any]:
    return {"mode": config.mode, "nproc": config.nproc, "precision": config.precision,
            "grad_compression": config.grad_compression, "hosts": config.hosts or None, "link_mbit": link_mbit,
            "data_format": config.data_format,
            "applicable": False, "reason": config.reason, "samples_per_second": None,
            "speedup": None, "efficiency": None, "peak_rss_mb": None, "breakdown": None}


def _with_speedup(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Speed-up over single; efficiency per device doing the work (GPUs of dp, else processes)."""
    from ddpkit.report import add_speedup

    widths = [{**r, "processes": r["nproc"] * r.get("devices", 1) * (r.get("hosts") or 1)} for r in rows]
    return [{**row, "speedup": done["speedup"], "efficiency": done["efficiency"]}
            for row, done in zip(rows, add_speedup(widths))]


def compare_raw(settings: Settings, config: Configuration, runs: Path) -> dict[str, Any]:
    """Raw and ddpkit ``config`` interleaved ``settings.repeats`` times; ratios are ddpkit/raw."""
    pairs = []
    for i in range(1, settings.repeats + 1):
        pair = {}
        for loop in ("raw", "ddpkit"):
            print(f"bench: compare {i}/{settings.repeats} {loop} {config.label} ...", end="", flush=True)
            row = summarize(config, run_loop(config, settings, runs / f"compare-{i}-{loop}.json",
                                             target=RAW_LOOP if loop == "raw" else DDPKIT_LOOP))
            print(f" {row['samples_per_second']:.1f} samples/s", flush=True)
            pair[loop] = row
        pairs.append(pair)
    memory = "peak_cuda_mb" if pairs[0]["raw"]["peak_cuda_mb"] is not None else "peak_rss_mb"
    return {
        "mode": config.mode, "nproc": config.nproc, "precision": config.precision,
        "repeats": settings.repeats, "memory_metric": memory,
        "step_time_ratio": statistics.median(p["ddpkit"]["step_seconds"] / p["raw"]["step_seconds"] for p in pairs),
        "memory_ratio": statistics.median(p["ddpkit"][memory] / p["raw"][memory] for p in pairs),
        "weights_equal": all(p["ddpkit"]["weights_sha256"] == p["raw"]["weights_sha256"] for p in pairs),
        "comm_overlap": {loop: _median_or_none(p[loop]["comm_overlap"] for p in pairs) for loop in ("raw", "ddpkit")},
        "pairs": [{f"{loop}_{key}": p[loop][key] for loop in ("raw", "ddpkit")
                   for key in ("step_seconds", memory, "weights_sha256")} for p in pairs],
    }


def _median_or_none(values: Any) -> float | None:
    values = list(values)
    return None if None in values or not values else statistics.median(values)


def run_bench(settings: Settings) -> dict[str, Any]:
    """Run every configuration, then the raw comparison; returns what ``bench.json`` holds."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    _check_machine(settings, gpus)
    out = Path(settings.out)
    rows = []
    for config in plan(settings, gpus):
        if config.reason is not None:
            print(f"bench: {config.label}: not applicable ({config.reason})", flush=True)
            rows.append(_not_applicable(config, settings.link_mbit if config.hosts else None))
            continue
        print(f"bench: {config.label} ...", end="", flush=True)
        row = measure(config, settings, out / "runs" / f"{config.name}.json")
        rows.append({**row, "link_mbit": settings.link_mbit if config.hosts else None})
        print(f" {rows[-1]['samples_per_second']:.1f} samples/s", flush=True)
    rows = _with_speedup(rows)
    rows = [{**row, "diagnosis": diagnose(row, rows)} for row in rows]
    report: dict[str, Any] = {"settings": asdict(settings), "torch": torch.__version__,
                              "device": "cuda" if gpus else "cpu", "gpus": gpus, "configurations": rows}
    if settings.compare_raw:
        target = next((c for c in plan(settings, gpus) if c.mode in ("ddp", "ddp-amp") and c.reason is None
                       and c.nproc == max(settings.nproc) and c.hosts == max(settings.hosts or (0,))
                       and c.grad_compression == settings.grad_compression[0] and c.data_format == "map"), None)
        if target is None:
            raise UsageError(f"--compare-raw found no runnable DDP configuration with --grad-compression "
                             f"{settings.grad_compression[0]} at the largest --nproc; put a runnable one first")
        report["raw_vs_ddpkit"] = compare_raw(settings, target, out / "runs")
    return report


def _check_machine(settings: Settings, gpus: int) -> None:
    """Refuse what would only fail inside the workers, before any process starts."""
    from ddpkit.bench_worker import bench_dataset

    hosts = max(settings.hosts or (1,))
    if gpus and max(settings.nproc) * hosts > gpus:
        raise UsageError(f"--nproc {max(settings.nproc)}" + (f" x --hosts {hosts}" if settings.hosts else "")
                         + f" needs as many GPUs, {gpus} visible")
    if settings.compare_raw and settings.grad_compression[0] == "bf16" and not gpus:
        raise UsageError("--compare-raw with bf16 compression: torch's bf16_compress_hook, which the "
                         "hand-written loop uses, refuses CPUs; compare none, fp16 or powersgd here")
    if settings.hosts:
        from ddpkit import netsim

        netsim.check_available()
        netsim.remove_leftovers()        # of a bench killed before it could clean up (SIGKILL)
    if settings.data != "synthetic":
        runnable = [c for c in plan(settings, gpus) if c.reason is None]
        bench_dataset(settings.data, settings.batch * max((c.nproc * c.devices for c in runnable), default=1))


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(dict.fromkeys(int(part) for part in text.split(",")))
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated integers such as 1,2,4, got {text!r}") from None
    if min(values) < 1:
        raise UsageError(f"{flag} values must be at least 1, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    d = Settings()
    parser = Parser(prog="ddpkit bench", description="Measure throughput, scaling, memory and where "
                     "each step's time goes, per mode, in fresh processes; writes bench.json, bench.md "
                     "and scaling.png into --out.")
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
    add("--compare-raw", action="store_true", help="also run a plain PyTorch DDP loop and ddpkit interleaved "
        "(the first ddp/ddp-amp mode, at the largest --nproc) and compare step time, memory and weights")
    add("--repeats", type=int, default=d.repeats, help=f"raw/ddpkit pairs of --compare-raw (default {d.repeats})")
    add("--grad-compression", default="none", help=f"comma-separated {'|'.join(COMPRESSIONS)}: gradient "
        "compression of the ddp and ddp-amp modes, one row each (default none)")
    add("--hosts", default=None, help="comma-separated counts of simulated hosts (network namespaces "
        "on a bridge, needs root), --nproc processes each; needs --link-mbit")
    add("--link-mbit", type=float, default=None, help="each simulated host's link speed in Mbit/s (tc tbf)")
    add("--optimizer", choices=("sgd", "adamw"), default=d.optimizer, help=f"optimizer (default {d.optimizer}); "
        "adamw holds 2 state tensors per parameter, what sharding (fsdp) divides")
    add("--data-format", default="map", help="comma-separated map|shards: the data set as it is, or the same "
        "samples as a ddpkit.Shards stream of 16 shards, one row each (default map)")
    return parser


def parse_settings(argv: Sequence[str]) -> Settings:
    """Validated :class:`Settings` from ``ddpkit bench`` arguments.

    Raises:
        UsageError: unknown flag or mode, or a count out of range.
    """
    opts = _parser().parse_args(argv)
    modes = tuple(dict.fromkeys(m.strip() for m in opts.modes.split(",")))
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise UsageError(f"unknown mode {unknown[0]!r} in --modes; choose from {', '.join(MODES)}")
    for flag, value, low in (("--batch", opts.batch, 1), ("--steps", opts.steps, 1),
                             ("--warmup", opts.warmup, 0), ("--repeats", opts.repeats, 1)):
        if value < low:
            raise UsageError(f"{flag} must be at least {low}, got {value}")
    compressions = tuple(dict.fromkeys(c.strip() for c in opts.grad_compression.split(",")))
    unknown = [c for c in compressions if c not in COMPRESSIONS]
    if unknown:
        raise UsageError(f"unknown compression {unknown[0]!r} in --grad-compression; choose from "
                         f"{', '.join(COMPRESSIONS)}")
    formats = tuple(dict.fromkeys(f.strip() for f in opts.data_format.split(",")))
    if set(formats) - {"map", "shards"}:
        raise UsageError(f"unknown data format {sorted(set(formats) - {'map', 'shards'})[0]!r} in --data-format; "
                         "choose from map, shards")
    hosts = _int_list(opts.hosts, "--hosts") if opts.hosts is not None else ()
    if hosts and opts.link_mbit is None:
        raise UsageError("--hosts needs --link-mbit M, the speed of each simulated host's link")
    if opts.link_mbit is not None and not hosts:
        raise UsageError("--link-mbit shapes the links of simulated hosts; add --hosts H")
    if opts.link_mbit is not None and not opts.link_mbit > 0:
        raise UsageError(f"--link-mbit must be a positive number of Mbit/s, got {opts.link_mbit}")
    if hosts and not {"ddp", "ddp-amp"} & set(modes):
        raise UsageError("--hosts runs DDP across simulated hosts; add ddp or ddp-amp to --modes")
    settings = Settings(model=opts.model, data=opts.data, modes=modes, nproc=_int_list(opts.nproc, "--nproc"),
                        batch=opts.batch, steps=opts.steps, warmup=opts.warmup, seed=opts.seed, lr=opts.lr,
                        momentum=opts.momentum, out=opts.out, compare_raw=opts.compare_raw,
                        repeats=opts.repeats, grad_compression=compressions, hosts=hosts,
                        link_mbit=opts.link_mbit, data_format=formats, optimizer=opts.optimizer)
    if settings.compare_raw and not {"ddp", "ddp-amp"} & set(modes):
        raise UsageError("--compare-raw compares a DDP run; add ddp or ddp-amp to --modes")
    if settings.compare_raw and max(settings.nproc) * max(hosts or (1,)) < 2:
        raise UsageError("--compare-raw compares DDP runs of 2 or more processes; give --nproc 2")
    return settings


def cmd_bench(argv: Sequence[str]) -> int:
    """``ddpkit bench``: run, print the table, write bench.json, bench.md and scaling.png."""
    settings = parse_settings(argv)
    report = run_bench(settings)
    report["command"] = shlex.join(["ddpkit", "bench", *argv])
    paths = write_outputs(Path(settings.out), report)
    print(f"bench: wrote {', '.join(str(p) for p in paths)}")
    return 0
