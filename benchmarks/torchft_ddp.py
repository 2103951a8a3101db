"""torchft's own DDP example on the run ``ddpkit bench --fault-tolerant --hosts`` measures.

The loop of torchft's ``train_ddp.py`` (its README's example: ``torchft.DistributedDataParallel``,
``torchft.Optimizer``, torchft's ``DistributedSampler`` sharding the data by replica group, a
``Manager`` healing over ``PGTransport``), with what that example leaves to the user filled in
the same way ``ddpkit bench`` does: the model, data, seed, optimizer and batch of the bench's run,
a ``--steps`` end, and the events file :func:`ddpkit.bench.ft.measure` reads. Each replica group
is one process under ``torchrun --standalone --max-restarts 1`` on its own simulated host; torchft's
lighthouse runs on host 0 with the settings ``ddpkit run --fault-tolerant`` gives it.

    python benchmarks/torchft_ddp.py --hosts 3 --link-mbit 100 --model resnet18 --data synthetic \
        --batch 16 --steps 30 --kill-at 10 --out runs/torchft-ddp [--reference runs/ft/uninterrupted]

``--loop diloco --sync-every H`` runs torchft's ``DiLoCo`` instead (``sync_every=H``, an outer
Nesterov SGD of lr 0.7 and momentum 0.9 as ddpkit's defaults, the bench's optimizer inside) for
``--warmup`` + ``--steps`` steps, once, and reports its samples/s over the timed steps: the peer of
``ddpkit bench --sync diloco`` (issue 28).

Two runs (uninterrupted, and replica 1 SIGKILLed after step ``--kill-at``) go to ``--out``, with
``torchft_ddp.json``: for each, the wall time, samples/s, recovery and heal times, and the final
weights' largest relative difference from the uninterrupted run's (and from ``--reference``'s
``weights.pt``, ddpkit's uninterrupted run, where given). A run that fails is reported with the
last lines of its hosts' logs instead of numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

KILLED = 1
PORT = 29510


def worker(opts: argparse.Namespace) -> None:
    """One replica group: torchft's DDP example loop on the bench's model and data."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader
    from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    from ddpkit.bench.workload import bench_dataset
    from ddpkit.recipes.models import build_model

    group, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = open(os.path.join(opts.out, f"events-{group}.jsonl"), "a", encoding="utf-8")

    def event(**row: object) -> None:
        events.write(json.dumps({"who": group, "attempt": attempt, "t": time.time(), **row}) + "\n")
        events.flush()

    event(kind="process", step=0)
    info = bench_dataset(opts.data, opts.batch * groups, opts.model)
    torch.manual_seed(opts.seed)
    model = build_model(opts.model, num_classes=info.num_classes, in_channels=info.in_channels,
                        image_size=info.image_size)
    inner = torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=opts.momentum)
    sampler = DistributedSampler(info.dataset, replica_rank=group, num_replica_groups=groups, group_rank=0,
                                 num_replicas=1, shuffle=True, seed=opts.seed)
    loader = DataLoader(info.dataset, batch_size=opts.batch, sampler=sampler)

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    # the example gives gloo 5 s; a 25 MB bucket takes about 4 s at 100 Mbit/s, so 30 s (its manager's)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    # the replica group's store where peers reach it (torchrun --standalone's is on localhost), as
    # torchft's launchers give it: the host's address, and the host's name does not resolve across hosts
    host = os.environ["HOST_ADDRESS"]
    store = torch.distributed.TCPStore(host, 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"train_{opts.loop}_{group}", timeout=timedelta(seconds=120), rank=0, world_size=1,
                      use_async_quorum=opts.loop != "diloco",        # torchft's DiLoCo requires a synchronous quorum
                      store_addr=host, store_port=store.port,
                      checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu")),
                      hostname=host)
    if opts.loop == "diloco":
        _diloco(opts, manager, model, inner, loader, sampler, event)
        if group == 0:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                       os.path.join(opts.out, "weights.pt"))
        manager.shutdown(wait=False)
        return
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    started = False
    epoch = 0
    while manager.current_step() < opts.steps:
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad()
            if not started:
                started = True
                event(kind="start", step=manager.current_step())
            loss = F.cross_entropy(ddp(inputs), targets)
            loss.backward()
            before = manager.current_step()
            optimizer.step()
            if manager.current_step() == before:
                event(kind="redo", step=before)
                continue
            event(kind="step", step=manager.current_step(), local=len(targets), loss=float(loss.detach()))
            if attempt == 0 and group == KILLED and opts.kill_at is not None and manager.current_step() >= opts.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if manager.current_step() >= opts.steps:
                break
        epoch += 1
    event(kind="end", step=manager.current_step())
    if group == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                   os.path.join(opts.out, "weights.pt"))
    manager.shutdown(wait=False)


def _diloco(opts: argparse.Namespace, manager: Any, model: Any, inner: Any, loader: Any, sampler: Any,
            event: Any) -> None:
    """torchft's DiLoCo around the inner optimizer; the timed steps' seconds go to the events."""
    import torch
    import torch.nn.functional as F
    from torchft.local_sgd import DiLoCo

    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    steps, epoch, started = 0, 0, None
    with DiLoCo(manager, [model], inner, outer, sync_every=opts.sync_every, backup_device=torch.device("cpu"),
                pin_memory=False):
        while steps < opts.warmup + opts.steps:
            sampler.set_epoch(epoch)
            for inputs, targets in loader:
                if steps == opts.warmup:
                    started = time.perf_counter()
                inner.zero_grad()
                F.cross_entropy(model(inputs), targets).backward()
                inner.step()
                steps += 1
                event(kind="step", step=steps, local=len(targets))
                if steps >= opts.warmup + opts.steps:
                    break
            epoch += 1
    event(kind="timed", seconds=time.perf_counter() - started, steps=opts.steps, batch=opts.batch,
          syncs=manager.current_step())


_LIGHTHOUSE = """
import sys, time
from ddpkit.distributed import ft
from torchft._torchft import LighthouseServer
server = LighthouseServer(bind=sys.argv[1], min_replicas=1, join_timeout_ms=ft.JOIN_TIMEOUT_MS,
                          quorum_tick_ms=ft.QUORUM_TICK_MS, heartbeat_timeout_ms=ft.HEARTBEAT_TIMEOUT_MS)
print(server.address(), flush=True)
while True:
    time.sleep(3600)
"""


def launch(opts: argparse.Namespace, out: Path, kill: bool) -> dict[str, Any]:
    """One run on simulated hosts; its events measured, or its failure."""
    import shutil

    from ddpkit.bench import ft, netsim
    from ddpkit.distributed.host import usable_cores

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    args = ["--worker", "--out", str(out), "--loop", opts.loop, "--sync-every", str(opts.sync_every),
            "--warmup", str(opts.warmup), "--model", opts.model, "--data", opts.data, "--batch", str(opts.batch),
            "--steps", str(opts.steps), "--seed", str(opts.seed), "--lr", str(opts.lr), "--momentum", str(opts.momentum)]
    if kill:
        args += ["--kill-at", str(opts.kill_at)]
    with netsim.SimulatedHosts(opts.hosts, opts.link_mbit) as sim:
        lighthouse = sim.popen(0, [sys.executable, "-c", _LIGHTHOUSE, f"{sim.addresses[0]}:{PORT}"],
                               stdout=subprocess.PIPE, text=True, env={"RUST_LOG": "warn"})
        assert lighthouse.stdout is not None
        lighthouse.stdout.readline()
        logs = [open(out / f"host{h}.log", "w") for h in range(opts.hosts)]
        started = time.perf_counter()
        procs = [sim.popen(h, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                               "--max-restarts", "1", __file__, *args],
                           env={"REPLICA_GROUP_ID": str(h), "NUM_REPLICA_GROUPS": str(opts.hosts),
                                "TORCHFT_LIGHTHOUSE": f"http://{sim.addresses[0]}:{PORT}", "HOST_ADDRESS": sim.addresses[h],
                                "OMP_NUM_THREADS": str(max(1, usable_cores() // opts.hosts)), "RUST_LOG": "warn",
                                "PYTHONUNBUFFERED": "1"},
                           stdout=logs[h], stderr=subprocess.STDOUT)
                 for h in range(opts.hosts)]
        deadline = time.monotonic() + opts.timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.5)
        seconds = time.perf_counter() - started
        codes = [p.poll() for p in procs]
        for log in logs:
            log.close()
    rows = [json.loads(line) for path in sorted(out.glob("events-*.jsonl")) for line in path.read_text().splitlines()]
    found: dict[str, Any] = {"exit_codes": codes, "wall_s": round(seconds, 3)}
    if any(code != 0 for code in codes) or not (out / "weights.pt").exists():
        found["failed"] = "\n".join(f"host {h} (exit {code}): " + " | ".join(
            (out / f"host{h}.log").read_text().strip().splitlines()[-4:]) for h, code in enumerate(codes) if code != 0)
    try:
        found.update(ft.measure(rows, opts.kill_at if kill else None))
    except ValueError as exc:                 # no step of the killed replica: nothing to measure
        found["measure_error"] = str(exc)
    found["samples_per_s"] = round(found.get("samples", 0) / seconds, 1)
    found["steps_committed"] = max((r["step"] for r in rows if r["kind"] == "step"), default=0)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/torchft_ddp.py")
    add = parser.add_argument
    add("--worker", action="store_true", help=argparse.SUPPRESS)
    add("--out", required=True)
    add("--hosts", type=int, default=3)
    add("--link-mbit", type=float, default=100.0)
    add("--model", default="resnet18")
    add("--data", default="synthetic")
    add("--batch", type=int, default=16, help="per replica group (ddpkit bench's --batch)")
    add("--steps", type=int, default=30)
    add("--kill-at", type=int, default=None)
    add("--loop", choices=("ddp", "diloco"), default="ddp", help="torchft's DDP example, or its DiLoCo")
    add("--sync-every", type=int, default=200, help="--loop diloco: inner steps between syncs")
    add("--warmup", type=int, default=3, help="--loop diloco: untimed steps first")
    add("--seed", type=int, default=0)
    add("--lr", type=float, default=0.05)
    add("--momentum", type=float, default=0.9)
    add("--timeout", type=float, default=900.0, help="seconds a run may take before it is stopped")
    add("--reference", default=None, help="ddpkit's uninterrupted run folder (its weights.pt)")
    opts = parser.parse_args()
    if opts.worker:
        worker(opts)
        return
    import torch

    from ddpkit.bench.ft import rel_diff

    out = Path(opts.out)
    if opts.loop == "diloco":
        found = launch(opts, out / "diloco", kill=False)
        timed = [json.loads(line) for path in sorted((out / "diloco").glob("events-*.jsonl"))
                 for line in path.read_text().splitlines() if '"timed"' in line]
        if timed:
            found["timed_samples_per_s"] = opts.steps * opts.batch * opts.hosts / max(row["seconds"] for row in timed)
            found["syncs"] = min(row["syncs"] for row in timed)
        report = {"command": " ".join(sys.argv), **{k: v for k, v in vars(opts).items() if k != "worker"},
                  "runs": {"diloco": found}}
        (out / "torchft_diloco.json").write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(found, indent=2))
        return
    runs = {"uninterrupted": launch(opts, out / "uninterrupted", kill=False),
            "killed": launch(opts, out / "killed", kill=True)}
    weights = {k: out / k / "weights.pt" for k in runs}
    if weights["uninterrupted"].exists():
        base = torch.load(weights["uninterrupted"], weights_only=True)
        for kind, path in weights.items():
            if path.exists():
                runs[kind]["weights_rel_diff"] = rel_diff(base, torch.load(path, weights_only=True))
    if opts.reference:
        ddpkit_weights = torch.load(Path(opts.reference) / "weights.pt", weights_only=True)
        for kind, path in weights.items():
            if path.exists():
                runs[kind]["weights_rel_diff_vs_ddpkit"] = rel_diff(ddpkit_weights, torch.load(path, weights_only=True))
    report = {"command": " ".join(sys.argv), **{k: v for k, v in vars(opts).items() if k != "worker"}, "runs": runs}
    (out / "torchft_ddp.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
