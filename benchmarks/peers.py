"""ddpkit against the hand-written loop, Lightning Fabric and Accelerate, each with its defaults,
on simulated hosts whose links are shaped (issue 16's table)::

    python benchmarks/peers.py --model resnet18 --hosts 2 --links 100,1000,10000 \\
        --batch 16 --steps 6 --warmup 2 --rounds 3 --out runs/peers

Every loop is started the same way (``ddpkit run`` of a module on each host of
:class:`ddpkit.bench.netsim.SimulatedHosts`, one process per host), builds the same model from the
same seed on the same data, and is timed by the same stopwatch (:mod:`ddpkit.bench.stopwatch`);
the loops run interleaved, one round after another, because this VM's speed drifts. Needs
root (network namespaces and ``tc``) and the two libraries: ``pip install -c constraints.txt
-e '.[peers]'``. ``--links 10000`` stands in for an unshaped link.

The Fabric and Accelerate loops below are what each library's documentation shows: Fabric's
``setup``/``setup_dataloaders``/``backward``, Accelerate's ``prepare``/``backward``, and for
PowerSGD Accelerate's ``DistributedDataParallelKwargs(comm_hook=POWER_SGD)`` at rank 2,
starting after the warm-up steps, as ddpkit's ``powersgd_start`` does here.

Infrequent sync (issue 28): Accelerate's ``LocalSGD`` (steps under ``no_sync``, the model
averaged every ``--sync-every`` steps, in fp32) against ``rt.setup(sync="local-sgd")`` and
``sync="diloco"`` (each rank's change exchanged in bf16)::

    python benchmarks/peers.py --model resnet18 --hosts 2 --links 10,10000 --rounds 1 \
        --loops "Accelerate LocalSGD,ddpkit local-sgd,ddpkit diloco" --sync-every 200 \
        --batch 8 --steps 200 --warmup 3 --out runs/peers-sync

A loop's sync steps are counted as ``ddpkit bench`` counts its own: the median step without a
sync, plus a sync's measured cost over its period.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# (name in the table, module that runs it, --grad-compression)
LOOPS = {
    "hand-written DDP": ("ddpkit.bench.raw_ddp", "none"),
    "Lightning Fabric (defaults)": ("peers:fabric", "none"),
    "Accelerate (defaults)": ("peers:accelerate", "none"),
    "ddpkit": ("ddpkit.bench.worker", "none"),
    "Accelerate + PowerSGD (rank 2)": ("peers:accelerate", "powersgd"),
    "ddpkit + PowerSGD (rank 2)": ("ddpkit.bench.worker", "powersgd"),
    # infrequent sync, every --sync-every steps (issue 28)
    "Accelerate LocalSGD": ("peers:accelerate_local_sgd", "none", "local-sgd"),
    "ddpkit local-sgd": ("ddpkit.bench.worker", "none", "local-sgd"),
    "ddpkit diloco": ("ddpkit.bench.worker", "none", "diloco"),
}
_RUN_LIMIT_S = 400
_PRECISION = {"fabric": {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"},
              "accelerate": {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}}


# -- the loops, run on every host ----------------------------------------------------------------

def _timed_steps(opts: Any, device: torch.device, batches: Iterator[Any], model: Any,
                 backward: Callable[[torch.Tensor], None], optimizer: Any) -> list[tuple[float, ...]]:
    from ddpkit.bench.stopwatch import mark

    marks = []
    for _ in range(opts.warmup + opts.steps):
        start = mark(device)
        inputs, targets = next(batches)
        fetched = mark(device)
        loss = F.cross_entropy(model(inputs), targets)
        forward = mark(device)
        backward(loss)
        done_backward = mark(device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks.append((start, fetched, forward, done_backward, mark(device)))
    return marks


def _forever(loader: Iterable[Any], set_epoch: Callable[[int], None]) -> Iterator[Any]:
    epoch = 0
    while True:
        set_epoch(epoch)
        yield from loader
        epoch += 1


def _finish(opts: Any, loop: str, marks: list, ddp: torch.nn.Module, device: torch.device,
            last: tuple[torch.Tensor, torch.Tensor], world_size: int, rank: int,
            extra: dict[str, Any] | None = None) -> None:
    import contextlib

    import torch.distributed as dist

    from ddpkit.bench.stopwatch import backward_alone, rank_stats, write_result

    payload = None
    if opts.grad_compression == "powersgd":      # what torch's hook hands to allreduce: P and Q, 1-D whole
        payload = _powersgd_payload(ddp.module, rank=2)
    stats = rank_stats(marks, opts.warmup, ddp, device, world_size, payload_bytes=payload)
    stats["backward_alone_seconds"] = backward_alone(ddp, *last, contextlib.nullcontext, device)
    stats.update(extra or {})
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, stats)
    if rank == 0:
        write_result(opts.result, gathered, loop=loop, world_size=world_size, device=device.type, devices=1,
                     precision=opts.precision, batch_per_process=opts.batch, global_batch=opts.batch * world_size)
    dist.barrier()


def _powersgd_payload(model: torch.nn.Module, rank: int) -> float:
    """What torch's ``powerSGD_hook`` hands to allreduce per step: P and Q of every matrix whose
    factors are at most half of it (its ``min_compression_rate=2``), the rest whole."""
    total = 0
    for p in model.parameters():
        n, m = p.shape[0], p.numel() // p.shape[0] if p.dim() >= 2 else 0
        total += (n + m) * rank if p.dim() >= 2 and (n + m) * rank * 2 < n * m else p.numel()
    return float(total * 4)


def fabric(opts: Any) -> None:
    """Lightning Fabric as its documentation writes a DDP loop, on its defaults."""
    from lightning_fabric import Fabric
    from torch.utils.data import DataLoader

    from ddpkit.bench.workload import bench_dataset, make_optimizer
    from ddpkit.recipes.models import build_model

    world_size, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    fab = Fabric(accelerator=accelerator, devices=local, num_nodes=world_size // local, strategy="ddp",
                 precision=_PRECISION["fabric"][opts.precision])
    fab.launch()
    info = bench_dataset(opts.data, opts.batch * world_size, opts.model)
    torch.manual_seed(opts.seed)
    model = build_model(opts.model, num_classes=info.num_classes, in_channels=info.in_channels,
                        image_size=info.image_size)
    model, optimizer = fab.setup(model, make_optimizer(model, opts))
    loader = fab.setup_dataloaders(DataLoader(info.dataset, batch_size=opts.batch, shuffle=True))
    batches = _forever(loader, loader.sampler.set_epoch)
    marks = _timed_steps(opts, fab.device, batches, model, fab.backward, optimizer)
    last = next(batches)
    _finish(opts, "fabric", marks, model._forward_module, fab.device, last, world_size, fab.global_rank)


def _accelerate_setup(opts: Any, handlers: list[Any]) -> tuple[Any, Any, Any, Any]:
    """Accelerate's ``Accelerator`` and the prepared model, optimizer and loader, as its docs write them."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from ddpkit.bench.workload import bench_dataset, make_optimizer
    from ddpkit.recipes.models import build_model

    acc = Accelerator(mixed_precision=_PRECISION["accelerate"][opts.precision], kwargs_handlers=handlers,
                      cpu=not torch.cuda.is_available())
    info = bench_dataset(opts.data, opts.batch * acc.num_processes, opts.model)
    torch.manual_seed(opts.seed)
    model = build_model(opts.model, num_classes=info.num_classes, in_channels=info.in_channels,
                        image_size=info.image_size)
    optimizer = make_optimizer(model, opts)
    loader = DataLoader(info.dataset, batch_size=opts.batch, shuffle=True)
    return (acc, *acc.prepare(model, optimizer, loader))


def accelerate(opts: Any) -> None:
    """Accelerate as its documentation writes a loop; PowerSGD through its DDP kwargs handler."""
    from accelerate import DistributedDataParallelKwargs
    from accelerate.utils import DDPCommunicationHookType

    from ddpkit.bench.workload import powersgd_start

    handlers = []
    if opts.grad_compression == "powersgd":
        handlers.append(DistributedDataParallelKwargs(
            comm_hook=DDPCommunicationHookType.POWER_SGD,
            comm_state_option={"matrix_approximation_rank": 2, "start_powerSGD_iter": powersgd_start(opts.warmup)}))
    acc, model, optimizer, loader = _accelerate_setup(opts, handlers)
    world_size = acc.num_processes
    batches = _forever(loader, loader.set_epoch)
    marks = _timed_steps(opts, acc.device, batches, model, acc.backward, optimizer)
    last = next(batches)
    _finish(opts, "accelerate", marks, model, acc.device, last, world_size, acc.process_index)


def accelerate_local_sgd(opts: Any) -> None:
    """Accelerate's ``LocalSGD`` as its documentation writes it: steps under ``no_sync``, the model
    averaged every ``--sync-every`` steps by ``local_sgd.step()``."""
    from accelerate.local_sgd import LocalSGD

    from ddpkit.bench.stopwatch import mark

    acc, model, optimizer, loader = _accelerate_setup(opts, [])
    world_size = acc.num_processes
    batches = _forever(loader, loader.set_epoch)
    marks = []
    with LocalSGD(accelerator=acc, model=model, local_sgd_steps=opts.sync_every, enabled=True) as local_sgd:
        for _ in range(opts.warmup + opts.steps):
            start = mark(acc.device)
            inputs, targets = next(batches)
            fetched = mark(acc.device)
            with acc.no_sync(model):
                loss = F.cross_entropy(model(inputs), targets)
                forward = mark(acc.device)
                acc.backward(loss)
                done_backward = mark(acc.device)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                local_sgd.step()
            marks.append((start, fetched, forward, done_backward, mark(acc.device)))
    last = next(batches)
    # LocalSGD averages at every local_sgd_steps-th step: those steps hold the sync, as ddpkit's rows count it
    every = opts.sync_every
    steps = [m[-1] - m[0] for m in marks]
    synced = [(i + 1) % every == 0 for i in range(len(marks))]
    plain = [t for t, s in zip(steps, synced) if not s] or steps
    at_sync = [t for t, s in zip(steps, synced) if s]
    periodic = {"every": every, "syncs": len(at_sync), "synced_steps": synced[opts.warmup:],
                "seconds_per_sync": max(0.0, statistics.fmean(at_sync) - statistics.median(plain)) if at_sync else 0.0,
                "bytes_per_sync": float(sum(p.numel() * p.element_size() for p in model.parameters()))}
    _finish(opts, "accelerate-local-sgd", marks, model, acc.device, last, world_size, acc.process_index,
            extra={"periodic": periodic})


# -- the driver ----------------------------------------------------------------------------------

def _measure(name: str, link: float, opts: Any, runs: Path) -> dict[str, Any]:
    from ddpkit.bench.plan import parse_settings, plan
    from ddpkit.bench.run import run_loop
    from ddpkit.bench.summary import summarize

    target, compression, *sync = LOOPS[name]
    module, _, loop = target.partition(":")
    periodic = ["--sync", sync[0], "--sync-every", str(opts.sync_every)] if sync else []
    settings = parse_settings(["--model", opts.model, "--data", "synthetic", "--modes", "ddp",
                               "--hosts", str(opts.hosts), "--nproc", "1", "--link-mbit", str(link),
                               "--batch", str(opts.batch), "--steps", str(opts.steps),
                               "--warmup", str(opts.warmup), "--grad-compression", compression, *periodic])
    config = plan(settings, gpus=0)[0]
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    result = runs / f"{slug}-{link:g}.json"
    os.environ["DDPKIT_PEER_LOOP"] = loop        # read by this module's worker entry below
    row = summarize(config, run_loop(config, settings, result, target=module))
    return {"loop": name, "link_mbit": link, "samples_per_second": row["samples_per_second"],
            "step_seconds": row["step_seconds"], "comm_overlap": row["comm_overlap"],
            "weights_sha256": row["weights_sha256"]}


def _table(rows: list[dict[str, Any]], links: list[float], steps_per_epoch: int) -> str:
    """Markdown: s/epoch (range over rounds) on the first link, median samples/s on each link."""
    head = ["loop"] + [f"s / epoch, {links[0]:g} Mbit/s"] + [f"samples/s, {link:g} Mbit/s" for link in links]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for name in LOOPS:
        if not any(r["loop"] == name for r in rows):
            continue
        cells = [name]
        for i, link in enumerate(links):
            mine = [r for r in rows if r["loop"] == name and r["link_mbit"] == link]
            done = [r for r in mine if "failed" not in r]
            if not done:
                cells += [f"failed ({len(mine)} of {len(mine)})" if mine else "–"] * (2 if i == 0 else 1)
                continue
            if i == 0:
                epochs = sorted(steps_per_epoch * r["step_seconds"] for r in done)
                cells.append(f"{epochs[0]:.1f}–{epochs[-1]:.1f}" if len(epochs) > 1 else f"{epochs[0]:.1f}")
            failed = f" ({len(mine) - len(done)} of {len(mine)} failed)" if len(done) < len(mine) else ""
            cells.append(f"{statistics.median(r['samples_per_second'] for r in done):.1f}{failed}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--links", default="100,1000,10000", help="Mbit/s of each host's link, comma-separated")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sync-every", type=int, default=50, help="steps between the syncs of the infrequent loops")
    parser.add_argument("--loops", default=",".join(LOOPS), help="names from the table, comma-separated")
    parser.add_argument("--out", default="runs/peers")
    parser.add_argument("--table", nargs="+", metavar="DIR",
                        help="run nothing: print the table of earlier runs' DIR/peers.json, together")
    opts = parser.parse_args()
    links = [float(x) for x in opts.links.split(",")]
    if opts.table:
        rows = [row for d in opts.table for row in json.loads((Path(d) / "peers.json").read_text())]
        print(_table(rows, links, opts.steps + opts.warmup))
        return 0
    names = [n for n in opts.loops.split(",") if n]
    unknown = [n for n in names if n not in LOOPS]
    if unknown:
        print(f"peers: unknown loop {unknown[0]!r}; choose from {', '.join(LOOPS)}", file=sys.stderr)
        return 2
    import importlib.util

    needed = {"Fabric": "lightning_fabric", "Accelerate": "accelerate"}
    missing = [module for word, module in needed.items()
               if any(word in name for name in names) and importlib.util.find_spec(module) is None]
    if missing:
        print(f"peers: {', '.join(missing)} not installed; pip install -c constraints.txt -e '.[peers]'",
              file=sys.stderr)
        return 2
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    rows = []
    for i in range(1, opts.rounds + 1):
        for link in links:
            for name in names:
                print(f"peers: round {i}/{opts.rounds} {link:g} Mbit/s {name} ...", end="", flush=True)
                try:
                    row = _measure(name, link, opts, out / f"round{i}")
                except Exception as exc:  # noqa: BLE001 — a peer that fails is a finding, not the end
                    print(f" failed: {exc}", flush=True)
                    rows.append({"loop": name, "link_mbit": link, "round": i, "failed": str(exc)})
                else:
                    print(f" {row['samples_per_second']:.1f} samples/s", flush=True)
                    rows.append({**row, "round": i})
                (out / "peers.json").write_text(json.dumps(rows, indent=1) + "\n")   # kept as it goes
    table = _table(rows, links, opts.steps + opts.warmup)
    (out / "peers.md").write_text(table + "\n")
    print(table)
    return 0


def _worker() -> int:
    import threading

    from ddpkit.bench.workload import worker_parser

    opts = worker_parser("python -m peers").parse_args()
    # a hang that the process group's timeout misses (torch's PowerSGD hook on gloo) ends the run
    stuck = threading.Timer(_RUN_LIMIT_S, lambda: (print(f"peers: no end after {_RUN_LIMIT_S} s; stopping",
                                                          file=sys.stderr, flush=True), os._exit(3)))
    stuck.daemon = True
    stuck.start()
    {"fabric": fabric, "accelerate": accelerate, "accelerate_local_sgd": accelerate_local_sgd}[
        os.environ["DDPKIT_PEER_LOOP"]](opts)
    return 0


if __name__ == "__main__":
    sys.exit(_worker() if "RANK" in os.environ else main())
