"""``ddpkit bench --fault-tolerant --kill-at STEP``: what one dead process costs, two ways.

Three runs of the same training (:mod:`ddpkit.bench.ft_worker`: ``--model`` on ``--data``, a
global batch of ``--batch`` times ``--nproc`` (times ``--hosts``), ``--steps`` steps), each in
fresh processes; with ``--hosts H --link-mbit M`` on H simulated hosts (network namespaces, each
link shaped to M Mbit/s, :mod:`ddpkit.bench.netsim`), ``--nproc`` on each, host 0 the master:

- ``uninterrupted``: ``ddpkit run --fault-tolerant -n N``, nobody killed: the reference;
- ``fault-tolerant``: the same, replica 1 SIGKILLed after step ``--kill-at``; it restarts and heals
  from a live peer while the others go on;
- ``restart-all``: ``ddpkit run -n N --max-restarts 1`` (torchrun's way), rank 1 SIGKILLed after
  the same step; every worker restarts and resumes from the newest checkpoint (one every
  ``--checkpoint-every`` steps).

For each: the wall time, the run's samples per second (its steps times the global batch, over
the wall time: steps trained again do not count), the time from the kill to the next
committed step (``recovery_s``), the time the restarted process took from its start to its first
committed step (``heal_s``), the steps trained twice, and the final weights' largest relative
difference from the uninterrupted run's. ``ft.json`` and ``ft.md`` go to ``--out``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ddpkit._files import write_text_atomic
from ddpkit.bench import netsim
from ddpkit.bench.run import HOST_PORT, gpus_of_hosts
from ddpkit.distributed import ft_heal
from ddpkit.distributed.host import usable_cores

TIMED = {"wall_s": 0.0, "samples_per_s": 0.0, "weights_rel_diff": 0.0, "samples_per_s_lost": 0.0}
"""The keys :func:`run` adds to each run's :func:`measure` (docs/reference/outputs.md lists them all)."""
KILLED = 1
"""The replica (or rank) the bench kills."""


def _launch(kind: str, settings: Any, out: Path, kill: bool) -> float:
    """Run one of the three; its wall time in seconds."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    n = settings.nproc[0]
    hosts = settings.hosts[0] if settings.hosts else 1
    worker = [
        "-m",
        "ddpkit.bench.ft_worker",
        "--out",
        str(out),
        "--model",
        settings.model,
        "--data",
        settings.data,
        "--batch",
        str(settings.batch * n * hosts),
        "--steps",
        str(settings.steps),
        "--seed",
        str(settings.seed),
        "--lr",
        str(settings.lr),
        "--momentum",
        str(settings.momentum),
        "--kill-who",
        str(KILLED),
        "--min-step-s",
        str(settings.min_step_s),
    ]
    if kill:
        worker += ["--kill-at", str(settings.kill_at)]
    if settings.sync[0] != "every-step":  # DiLoCo or local SGD, in all three runs
        worker += ["--sync", settings.sync[0], "--sync-every", str(settings.sync_every)]
        worker += ["--sync-fragments", str(settings.sync_fragments), "--sync-delay", str(settings.sync_delay)]
        worker += ["--sync-dtype", settings.sync_dtype] if settings.sync_dtype else []
    if kind == "restart-all":
        launcher = ["run", "-n", str(n), "--max-restarts", "1"]
        worker += ["--checkpoint-every", str(settings.checkpoint_every)]
    else:
        launcher = ["run", "--fault-tolerant", "-n", str(n), "--max-restarts", "1"]
    if hosts > 1:
        return _launch_on_hosts(kind, settings, out, [*launcher, *worker], hosts)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit", *launcher, *worker],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(
            f"bench --fault-tolerant: the {kind} run failed (exit {done.returncode}):\n" + done.stderr[-3000:]
        )
    return seconds


def _launch_on_hosts(kind: str, settings: Any, out: Path, command: list[str], hosts: int) -> float:
    """``command`` (``run ... -m ddpkit.bench.ft_worker ...``) as node I of ``hosts`` simulated hosts,
    each on a link of ``--link-mbit``; node 0's address is the master. Its wall time in seconds."""

    env = {"PYTHONUNBUFFERED": "1", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
    if "OMP_NUM_THREADS" not in os.environ:  # the hosts share this machine's cores
        env["OMP_NUM_THREADS"] = str(max(1, usable_cores() // (hosts * settings.nproc[0])))
    launcher, worker = command[: command.index("-m")], command[command.index("-m") :]
    if "--fault-tolerant" in launcher:  # the job's secret, the same file on every host
        secret = out / "secret"
        ft_heal.write_secret(str(secret))
        launcher += ["--secret-file", str(secret)]
    gpus = gpus_of_hosts(hosts, settings.nproc[0])  # each host's replicas their own GPUs
    with netsim.SimulatedHosts(hosts, float(settings.link_mbit)) as sim:
        master = f"{sim.addresses[0]}:{HOST_PORT}"
        logs = [open(out / f"node{host}.log", "w") for host in range(hosts)]
        started = time.perf_counter()
        nodes = [
            sim.popen(
                host,
                [
                    sys.executable,
                    "-m",
                    "ddpkit",
                    *launcher,
                    "--nnodes",
                    str(hosts),
                    "--node-rank",
                    str(host),
                    "--master",
                    master,
                    *worker,
                ],
                env={**env, **gpus[host]},
                stdout=logs[host],
                stderr=subprocess.STDOUT,
            )
            for host in range(hosts)
        ]
        codes = [node.wait() for node in nodes]
        seconds = time.perf_counter() - started
        for log in logs:
            log.close()
    if any(codes):
        tail = "\n".join((out / f"node{host}.log").read_text()[-1500:] for host, code in enumerate(codes) if code)
        raise RuntimeError(
            f"bench --fault-tolerant: the {kind} run failed on {hosts} hosts (exit codes {codes}):\n" + tail
        )
    return seconds


def _events(out: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in sorted(out.glob("events-*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "weights.pt", map_location="cpu", weights_only=True)


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference of the floating-point entries over their largest magnitude."""
    keys = [k for k in a if a[k].is_floating_point()]
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in keys)
    return diff / max(1e-30, max(float(a[k].double().abs().max()) for k in keys))


def measure(events: list[dict[str, Any]], kill_at: int | None) -> dict[str, Any]:
    """Recovery, heal and recomputation from one run's events (see the module's text)."""
    steps = [row for row in events if row["kind"] == "step"]
    found: dict[str, Any] = {"samples": sum(row["local"] for row in steps)}
    if kill_at is None:
        return found
    victim = [row for row in steps if row["who"] == KILLED and row["attempt"] == 0]
    died_step = max(row["step"] for row in victim)
    died = max(row["t"] for row in victim)
    later = [
        row["t"]
        for row in steps
        if row["step"] > died_step and row["t"] > died and not (row["who"] == KILLED and row["attempt"] == 0)
    ]
    found["killed_after_step"] = died_step
    found["recovery_s"] = round(min(later) - died, 3) if later else None
    back = [row for row in events if row["who"] == KILLED and row["attempt"] == 1]
    born = [row["t"] for row in back if row["kind"] == "process"]
    first = [row["t"] for row in back if row["kind"] == "step"]
    found["heal_s"] = round(min(first) - min(born), 3) if born and first else None
    found["rejoined_s_after_kill"] = round(min(first) - died, 3) if first else None
    seen_twice = {row["step"] for row in steps if row["attempt"] == 1 and row["step"] <= died_step}
    found["steps_trained_twice"] = len(seen_twice)
    return found


def run(settings: Any) -> dict[str, Any]:
    """The three runs and their measurements: what ``ft.json`` holds."""
    out = Path(settings.out)
    hosts = settings.hosts[0] if settings.hosts else 1
    apart = settings.sync[0] != "every-step"  # DiLoCo or local SGD
    if settings.hosts:
        netsim.check_available()
        netsim.remove_leftovers()  # of a bench killed before it could clean up (SIGKILL)
    rows: dict[str, Any] = {}
    for kind, kill in (("uninterrupted", False), ("fault-tolerant", True), ("restart-all", True)):
        where = out / kind
        seconds = _launch(kind, settings, where, kill)
        found = measure(_events(where), settings.kill_at if kill else None)
        found.update(TIMED)
        found["wall_s"] = round(seconds, 3)
        # the run's own samples: a step trained again after a restart adds nothing to it
        found["samples_per_s"] = round(settings.steps * settings.batch * settings.nproc[0] * hosts / seconds, 1)
        rows[kind] = found
    reference = _weights(out / "uninterrupted")
    for kind in rows:
        rows[kind]["weights_rel_diff"] = rel_diff(reference, _weights(out / kind))
    base = rows["uninterrupted"]["samples_per_s"]
    for kind in rows:
        rows[kind]["samples_per_s_lost"] = round(base - rows[kind]["samples_per_s"], 1)
    report = {
        "model": settings.model,
        "data": settings.data,
        "replicas": settings.nproc[0] * hosts,
        "hosts": hosts if settings.hosts else None,
        "link_mbit": settings.link_mbit if settings.hosts else None,
        "global_batch": settings.batch * settings.nproc[0] * hosts,
        "steps": settings.steps,
        "kill_at": settings.kill_at,
        "checkpoint_every": settings.checkpoint_every,
        "min_step_s": settings.min_step_s,
        "sync": settings.sync[0],
        "sync_every": settings.sync_every if apart else None,
        "sync_dtype": (settings.sync_dtype or "bf16") if apart else None,
        "runs": rows,
    }
    return report


def table(report: dict[str, Any]) -> str:
    """The report as a markdown table."""
    lines = [
        "| run | wall s | samples/s | lost samples/s | recovery s | heal s | steps twice | weights rel diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, row in report["runs"].items():
        cells = [
            kind,
            row["wall_s"],
            row["samples_per_s"],
            row["samples_per_s_lost"],
            row.get("recovery_s", "-"),
            row.get("heal_s", "-"),
            row.get("steps_trained_twice", "-"),
            f"{row['weights_rel_diff']:.1e}",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def write(report: dict[str, Any], out: Path) -> list[Path]:
    """``ft.json`` and ``ft.md`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "ft.json", out / "ft.md"
    write_text_atomic(json_path, json.dumps(report, indent=2) + "\n")
    write_text_atomic(md_path, f"`{report.get('command', '')}`\n\n{table(report)}\n")
    return [json_path, md_path]


__all__ = ["KILLED", "TIMED", "measure", "rel_diff", "run", "table", "write"]
