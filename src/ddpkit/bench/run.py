"""Running ``ddpkit bench``: each planned row in fresh processes, on this machine or on simulated hosts.

Every configuration runs its loop module (:mod:`ddpkit.bench.worker`, or the hand-written
:mod:`ddpkit.bench.raw_ddp`) under ``torch.distributed.run``, as ``ddpkit run`` starts it, and
reads back what its rank 0 wrote; :mod:`ddpkit.bench.summary` turns that into a row.
``--compare-raw`` runs the hand-written loop and ddpkit's interleaved, A B A B ..., so slow drift
of the machine hits both alike. With ``--hosts H`` every row runs on H simulated hosts
(:mod:`ddpkit.bench.netsim`), ``--nproc`` processes each, so the gradients cross a link shaped
like real Ethernet between machines.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ddpkit.bench import netsim
from ddpkit.bench.diagnose import checked, diagnose, recommendations
from ddpkit.bench.outputs import row_label, verified_line
from ddpkit.bench.plan import BenchSettings, Configuration, plan
from ddpkit.bench.summary import not_applicable, summarize, with_speedup
from ddpkit.bench.workload import bench_dataset
from ddpkit.distributed.host import usable_cores, visible_gpus
from ddpkit.distributed.torchrun import RunSpec, run
from ddpkit.errors import DdpkitError, UsageError

HOST_PORT = 29500  # the rendezvous port on simulated host 0 (a fresh namespace: nothing else there)
RAW_LOOP = "ddpkit.bench.raw_ddp"
DDPKIT_LOOP = "ddpkit.bench.worker"


def run_loop(
    config: Configuration, settings: BenchSettings, result: Path, *, target: str = DDPKIT_LOOP
) -> dict[str, Any]:
    """Run the loop module ``target`` as ``config`` in fresh processes; return what its rank 0 wrote.

    Args:
        config: the row: mode, processes, precision, compression, hosts, data format.
        settings: the bench's settings (model, data, batch, steps, seed, optimizer, link).
        result: the JSON file the loop's rank 0 writes (removed first).
        target: the loop module, run with ``-m``. It takes
            :func:`ddpkit.bench.workload.worker_parser`'s arguments and writes
            :func:`ddpkit.bench.stopwatch.write_result`'s file: ddpkit's loop, the hand-written one
            (:data:`RAW_LOOP`), or another library's (``benchmarks/peers.py``).

    Raises:
        DdpkitError: the loop failed or wrote no result.
    """
    args = [
        "--model",
        settings.model,
        "--data",
        settings.data,
        "--precision",
        config.precision,
        "--batch",
        str(settings.batch),
        "--steps",
        str(settings.steps),
        "--warmup",
        str(settings.warmup),
        "--seed",
        str(settings.seed),
        "--lr",
        repr(settings.lr),
        "--momentum",
        repr(settings.momentum),
        "--result",
        str(result),
        "--grad-compression",
        config.grad_compression,
        "--data-format",
        config.data_format,
        "--optimizer",
        settings.optimizer,
        "--strategy",
        "fsdp" if config.mode == "fsdp" else "ddp",
    ]
    if config.mode == "dp":
        args.append("--data-parallel")
    if config.sync_bn:
        args.append("--sync-bn")
    if config.sync != "every-step":
        args += ["--sync-every", str(settings.sync_every)] if settings.sync_every is not None else []
        args += [
            "--sync",
            config.sync,
            "--sync-fragments",
            str(settings.sync_fragments),
            "--sync-delay",
            str(settings.sync_delay),
        ]
        if settings.sync_dtype is not None:
            args += ["--sync-dtype", settings.sync_dtype]
    if settings.powersgd_rank is not None and config.grad_compression == "powersgd":
        args += ["--powersgd-rank", str(settings.powersgd_rank)]
    if config.micro_shards:
        if target != DDPKIT_LOOP:  # the hand-written loop and the peers have no micro-shards
            raise DdpkitError(f"bench: {config.label} runs ddpkit's own loop only; it has no {target} row")
        args += ["--micro-shards", str(config.micro_shards)]
    result.unlink(missing_ok=True)
    if config.hosts:
        code = _run_on_hosts(config, settings, target, args)
    else:
        code = run(RunSpec(target, args, module=True, nproc_per_node=config.nproc))
    if code != 0 or not result.is_file():
        loop = {DDPKIT_LOOP: "", RAW_LOOP: "raw "}.get(target, f"{target} ")
        raise DdpkitError(f"bench {loop}{config.label} failed (exit code {code}); see its output above")
    return json.loads(result.read_text())


def measure(config: Configuration, settings: BenchSettings, result: Path) -> dict[str, Any]:
    """One bench row for ``config``: run it in fresh processes and summarise (no speed-up yet)."""
    return summarize(config, run_loop(config, settings, result))


def _run_on_hosts(config: Configuration, settings: BenchSettings, target: str, args: list[str]) -> int:
    """``ddpkit run`` of ``target`` on each simulated host; the first failure's exit code, else 0.

    Each host is one node of a multi-node job whose rendezvous is host 0. When a host fails the
    others get a grace period to notice, then the simulation ends (it kills what is left).
    """
    import sys
    import time

    gpus = gpus_of_hosts(config.hosts, config.nproc)
    with netsim.SimulatedHosts(config.hosts, float(config.link_mbit or settings.link_mbit or 0)) as sim:
        master = f"{sim.addresses[0]}:{HOST_PORT}"
        # NCCL would reach another GPU of this machine over shared memory or NVLink: the link is the point.
        env = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
        if "OMP_NUM_THREADS" not in os.environ:  # the hosts share this machine's cores
            env["OMP_NUM_THREADS"] = str(max(1, usable_cores() // config.world_size))
        procs = [
            sim.popen(
                host,
                [
                    sys.executable,
                    "-m",
                    "ddpkit.cli",
                    "run",
                    "--nnodes",
                    str(config.hosts),
                    "--node-rank",
                    str(host),
                    "--master",
                    master,
                    "-n",
                    str(config.nproc),
                    "-m",
                    target,
                    *args,
                ],
                env={**env, **gpus[host]},
            )
            for host in range(config.hosts)
        ]
        failed_at = None
        while True:
            codes = [p.poll() for p in procs]
            if all(code is not None for code in codes):
                break
            if failed_at is None and any(code not in (None, 0) for code in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > 30:
                break  # the simulation's close kills the rest
            time.sleep(0.5)
    return next((code for code in codes if code not in (None, 0)), 0 if None not in codes else 1)


def gpus_of_hosts(hosts: int, nproc: int) -> list[dict[str, str]]:
    """Each simulated host's environment on a GPU machine: GPUs of its own (local ranks count from 0 on
    each). Hosts past the last GPU are refused in one line before any starts (they would train on the
    CPU beside hosts on CUDA)."""
    ids = visible_gpus()
    if not ids:
        return [{} for _ in range(hosts)]
    if len(ids) < hosts * nproc:
        raise UsageError(
            f"ddpkit bench: {hosts} simulated hosts of {nproc} process(es) need {hosts * nproc} GPUs, and "
            f"{len(ids)} are visible; use fewer hosts or processes, or hide the GPUs (CUDA_VISIBLE_DEVICES=) "
            "to bench on the CPU"
        )
    return [{"CUDA_VISIBLE_DEVICES": ",".join(ids[host * nproc : (host + 1) * nproc])} for host in range(hosts)]


def compare_raw(settings: BenchSettings, config: Configuration, runs: Path) -> dict[str, Any]:
    """Raw and ddpkit ``config`` interleaved ``settings.repeats`` times; ratios are ddpkit/raw."""
    pairs = []
    for i in range(1, settings.repeats + 1):
        pair = {}
        for loop in ("raw", "ddpkit"):
            print(f"bench: compare {i}/{settings.repeats} {loop} {config.label} ...", end="", flush=True)
            row = summarize(
                config,
                run_loop(
                    config,
                    settings,
                    runs / f"compare-{i}-{loop}.json",
                    target=RAW_LOOP if loop == "raw" else DDPKIT_LOOP,
                ),
            )
            print(f" {row['samples_per_second']:.1f} samples/s", flush=True)
            pair[loop] = row
        pairs.append(pair)
    memory = "peak_cuda_mb" if pairs[0]["raw"]["peak_cuda_mb"] is not None else "peak_rss_mb"
    return {
        "mode": config.mode,
        "nproc": config.nproc,
        "precision": config.precision,
        "repeats": settings.repeats,
        "memory_metric": memory,
        "step_time_ratio": statistics.median(p["ddpkit"]["step_seconds"] / p["raw"]["step_seconds"] for p in pairs),
        "memory_ratio": statistics.median(p["ddpkit"][memory] / p["raw"][memory] for p in pairs),
        "weights_equal": all(p["ddpkit"]["weights_sha256"] == p["raw"]["weights_sha256"] for p in pairs),
        "comm_overlap": {loop: _median_or_none(p[loop]["comm_overlap"] for p in pairs) for loop in ("raw", "ddpkit")},
        "pairs": [
            {
                f"{loop}_{key}": p[loop][key]
                for loop in ("raw", "ddpkit")
                for key in ("step_seconds", memory, "weights_sha256")
            }
            for p in pairs
        ],
    }


def verify(
    row: dict[str, Any], rows: list[dict[str, Any]], settings: BenchSettings, runs: Path
) -> dict[str, Any] | None:
    """Measure the fix ``row``'s diagnosis predicts the most of; its prediction against the measurement.

    A fix another row already ran (a compression in the table) is not run again. None where the
    diagnosis recommends nothing. The outcome is printed, and flagged where the prediction is more
    than :data:`ddpkit.bench.diagnose.VERIFY_TOLERANCE` off.

    Args:
        row: a measured, diagnosed row.
        rows: every row of the bench (fixes some of them already measured).
        settings: the bench's settings; a 2x-batch fix runs them with the batch doubled.
        runs: where the fix's worker result is written.
    """
    import dataclasses

    fixes = recommendations(row, rows) if row.get("applicable", True) else []
    if not fixes:
        return None
    fix = fixes[0]
    config = Configuration(
        row["mode"],
        row["nproc"],
        row["precision"],
        devices=row.get("devices", 1),
        grad_compression="none" if "sync" in fix else fix.get("grad_compression", row["grad_compression"]),
        hosts=row.get("hosts") or 0,
        data_format=row.get("data_format", "map"),
        sync_bn=bool(row.get("sync_bn")),
        sync=fix.get("sync", row.get("sync") or "every-step"),
        link_mbit=row.get("link_mbit"),
        micro_shards=row.get("micro_shards"),
    )
    label = f"{config.label}{' x' + str(fix['batch_factor']) + ' batch' if 'batch_factor' in fix else ''}"
    measured = fix.get("measured_samples_per_second")
    if measured is None:
        factor = fix.get("batch_factor", 1)
        batch = (row.get("batch_per_process") or settings.batch) // max(1, row.get("devices", 1))
        tried = dataclasses.replace(
            settings, batch=batch * factor, sync_every=fix.get("sync_every", settings.sync_every)
        )
        print(f"bench: verify {label} ...", end="", flush=True)
        name = f"verify-{config.name}" + (f"-batch{batch * factor}" if factor != 1 else "")
        measured = measure(config, tried, runs / f"{name}.json")["samples_per_second"]
        print(f" {measured:.1f} samples/s", flush=True)
    outcome = checked(fix, measured)
    print(f"bench: {row_label(row)}: {verified_line(outcome, markdown=False)}", flush=True)
    return outcome


def exact_ratio(plain: dict[str, Any], exact: dict[str, Any]) -> float | None:
    """Samples/s of a micro-shard row over its plain twin's (None: not twins, or either did not run)."""
    twins = (
        exact.get("micro_shards")
        and not plain.get("micro_shards")
        and all(plain.get(k) == exact.get(k) for k in ("mode", "nproc", "precision", "hosts", "link_mbit"))
    )
    if not twins or not plain.get("samples_per_second") or not exact.get("samples_per_second"):
        return None
    return exact["samples_per_second"] / plain["samples_per_second"]


def _median_or_none(values: Any) -> float | None:
    values = list(values)
    return None if None in values or not values else statistics.median(values)


def run_bench(settings: BenchSettings) -> dict[str, Any]:
    """Run every configuration, then the raw comparison; returns what ``bench.json`` holds."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    _check_machine(settings, gpus)
    out = Path(settings.out)
    rows = []
    for config in plan(settings, gpus):
        if config.reason is not None:
            print(f"bench: {config.label}: not applicable ({config.reason})", flush=True)
            rows.append(not_applicable(config, (config.link_mbit or settings.link_mbit) if config.hosts else None))
            continue
        print(f"bench: {config.label} ...", end="", flush=True)
        row = measure(config, settings, out / "runs" / f"{config.name}.json")
        rows.append({**row, "link_mbit": (config.link_mbit or settings.link_mbit) if config.hosts else None})
        print(f" {rows[-1]['samples_per_second']:.1f} samples/s", flush=True)
    rows = with_speedup(rows)
    rows = [{**row, "diagnosis": diagnose(row, rows)} for row in rows]
    if settings.compare_exact:
        for plain, exact in zip(rows, rows[1:]):
            ratio = exact_ratio(plain, exact)
            if ratio is not None:
                exact["exact_vs_plain"] = ratio
                print(
                    f"bench: micro-shards {exact['micro_shards']} on {exact['nproc']} process(es): "
                    f"{ratio:.2f}x plain DDP's samples/s",
                    flush=True,
                )
    if settings.diagnose_verify:
        rows = [{**row, "verify": verify(row, rows, settings, out / "runs")} for row in rows]
    report: dict[str, Any] = {
        "settings": asdict(settings),
        "torch": torch.__version__,
        "device": "cuda" if gpus else "cpu",
        "gpus": gpus,
        "configurations": rows,
    }
    if settings.compare_raw:
        target = next(
            (
                c
                for c in plan(settings, gpus)
                if c.mode in ("ddp", "ddp-amp")
                and c.reason is None
                and c.nproc == max(settings.nproc)
                and c.hosts == max(settings.hosts or (0,))
                and c.grad_compression == settings.grad_compression[0]
                and c.data_format == "map"
                and not c.sync_bn
                and c.sync == "every-step"
                and not c.micro_shards
            ),
            None,
        )
        if target is None:
            raise UsageError(
                f"--compare-raw found no runnable DDP configuration with --grad-compression "
                f"{settings.grad_compression[0]} at the largest --nproc; put a runnable one first"
            )
        report["raw_vs_ddpkit"] = compare_raw(settings, target, out / "runs")
    return report


def _check_machine(settings: BenchSettings, gpus: int) -> None:
    """Refuse what would only fail inside the workers, before any process starts."""
    hosts = max(settings.hosts or (1,))
    if gpus and max(settings.nproc) * hosts > gpus:
        raise UsageError(
            f"--nproc {max(settings.nproc)}"
            + (f" x --hosts {hosts}" if settings.hosts else "")
            + f" needs as many GPUs, {gpus} visible"
        )
    if settings.compare_raw and settings.grad_compression[0] == "auto":
        raise UsageError(
            "--compare-raw with auto compression: the hand-written loop has no such choice; "
            "compare none, fp16, bf16 or powersgd"
        )
    if settings.compare_raw and settings.grad_compression[0] == "bf16" and not gpus:
        raise UsageError(
            "--compare-raw with bf16 compression: torch's bf16_compress_hook, which the "
            "hand-written loop uses, refuses CPUs; compare none, fp16 or powersgd here"
        )
    if settings.hosts:
        netsim.check_available()
        netsim.remove_leftovers()  # of a bench killed before it could clean up (SIGKILL)
    if settings.data != "synthetic":
        runnable = [c for c in plan(settings, gpus) if c.reason is None]
        bench_dataset(
            settings.data, settings.batch * max((c.nproc * c.devices for c in runnable), default=1), settings.model
        )
