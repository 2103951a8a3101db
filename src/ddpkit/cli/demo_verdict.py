"""What ``ddpkit demo`` concludes from its rows: the shares of a step, the closest configuration it measures, the check of the diagnosis's prediction, and the verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddpkit.bench.plan import BenchSettings, Configuration
from ddpkit.bench.run import measure
from ddpkit.parallel.exact_tree import threads_for


def shares(step: dict[str, Any]) -> dict[str, float]:
    """Shares of a mean step: compute, communication (the allreduce left exposed), waiting for the
    slowest rank, and data. They add up to 1."""
    phases, total = step["breakdown"], step["mean_step_seconds"]
    comm = step.get("comm") or {}
    exposed = comm.get("exposed_seconds")
    if exposed is None and comm:
        exposed = min(comm["allreduce_seconds"], phases["backward"])
    exposed = exposed or 0.0
    busy = phases["forward"] + phases["backward"] + phases["optimizer"]
    waiting = max(0.0, total - busy - phases["data_wait"])
    parts = {
        "compute": max(0.0, busy - exposed),
        "communication": min(exposed, busy),
        "waiting": waiting,
        "data": phases["data_wait"],
    }
    whole = sum(parts.values()) or 1.0
    return {name: value / whole for name, value in parts.items()}


def closest(rows: list[dict[str, Any]], gpus: int, runs: Path) -> dict[str, Any] | None:
    """Where DDP here runs slower than one process: the measured configuration that comes closest.

    Candidates are the DDP rows, the fixes measured for them, and ResNet-18 (a model with far more
    compute per step) measured as one process and as DDP, each against its own single process.
    None where DDP already runs faster.
    """

    single = next(r for r in rows if r["mode"] == "single")["step"]["samples_per_second"]
    ddp = [r for r in rows if r["mode"] == "ddp"]
    if gpus or not ddp or max(r["speedup"] for r in ddp) >= 1.0:
        return None
    found = [{"what": f"DDP x{r['processes']} {r['precision']} (the table)", "speedup": r["speedup"]} for r in ddp]
    found += [
        {
            "what": f"DDP x{r['processes']} {r['precision']} with {r['verify']['change']}",
            "speedup": r["verify"]["measured_samples_per_second"] / single,
        }
        for r in ddp
        if r.get("verify")
    ]
    nproc = ddp[0]["processes"]
    print(f"== resnet18: one process and DDP x{nproc}, measured as ddpkit bench does", flush=True)
    settings = BenchSettings(model="resnet18", data="synthetic", batch=32, steps=8, warmup=2, out=str(runs))
    alone = measure(Configuration("single", 1, "fp32"), settings, runs / "resnet18-single.json")
    together = measure(Configuration("ddp", nproc, "fp32"), settings, runs / f"resnet18-ddp-x{nproc}.json")
    found.append(
        {
            "what": f"ResNet-18, DDP x{nproc} fp32 against one process (`ddpkit bench --model resnet18 "
            f"--data synthetic --modes single,ddp --nproc {nproc}`)",
            "speedup": together["samples_per_second"] / alone["samples_per_second"],
        }
    )
    return max(found, key=lambda f: f["speedup"])


def exact_threads(rows: list[dict[str, Any]], nproc: int) -> int:
    """Intra-op threads of each micro-shard on this machine (what ``--micro-shards nproc`` sets)."""
    return threads_for(nproc, rows[0]["step"]["cores"])


def verdict(rows: list[dict[str, Any]], closest: dict[str, Any] | None = None) -> str:
    """Two or three sentences for this machine, from the measured rows; ``closest`` (see
    :func:`closest`) names the measured configuration nearest a speed-up where none shows one."""
    single = rows[0]
    ddp = next((r for r in rows if r["mode"] == "ddp" and r["precision"] == "fp32"), None)
    if ddp is None:
        return ""
    cores, threads, n = ddp["cores"], ddp["threads_per_process"], ddp["processes"]
    split = ", ".join(f"{name} {value:.0%}" for name, value in ddp["shares"].items() if value >= 0.005)
    bound = ddp["diagnosis"].split(";")[0].removeprefix("bound by ").split(" (")[0]
    said = [
        f"On this machine ({cores} cores, {n} processes of {threads} thread(s) each), DDP x{n} runs at "
        f"{ddp['speedup']:.2f}x the samples/s of one process: it is bound by {bound} (a step is {split})."
    ]
    fast = [r for r in rows if r["precision"] != "fp32" and "not accelerated" in r["diagnosis"]]
    for row in fast:
        said.append(f"{row['precision']} runs at {row['speedup']:.2f}x: {row['diagnosis'].split(':')[0]}.")
    if ddp["speedup"] < 1.0:
        said.append(
            "What would change it: more compute per step (a bigger model or batch), so the fixed "
            "per-step costs and the gradient exchange weigh less, and more cores, machines or GPUs "
            "to run on."
        )
        if closest is not None:
            if closest["speedup"] < 1:
                said.append(
                    f"The closest to a speed-up measured here is {closest['what']}: "
                    f"{closest['speedup']:.2f}x, {1 - closest['speedup']:.0%} short of one process's samples/s."
                )
            else:
                said.append(
                    f"A speed-up does show here with more compute per step: {closest['what']}, "
                    f"{closest['speedup']:.2f}x ({closest['speedup'] - 1:.0%} more samples/s than one process)."
                )
    else:
        said.append(f"{single['mode']} is the baseline; `ddpkit bench` explains each row in more detail.")
    exact = next((r for r in rows if r["mode"] == "single" and r.get("micro_shards")), None)
    if exact is not None and single.get("samples_per_second"):
        ratio = exact["samples_per_second"] / single["samples_per_second"]
        said.append(
            f"The same bits on 1 and {n} processes cost one process here: with --micro-shards "
            f"{exact['micro_shards']} it computes its shards one after another, at {ratio:.2f}x the samples/s "
            f"of one process on every core; the DDP rows run one shard a process and do not pay it."
        )
    return " ".join(said)


__all__ = ["closest", "exact_threads", "shares", "verdict"]
