"""What ``ddpkit bench`` found, in words: a diagnosis per configuration, bench.md/json, a chart.

The diagnosis names what bounds a configuration, in this order of blame: oversubscribed CPU
threads, communication that cannot hide behind backward, data loading, a batch too small to
amortise per-step costs; else compute. Thresholds are shares of the mean step time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

PHASES = ("data_wait", "forward", "backward", "optimizer")

# Diagnosis thresholds: shares of the mean step time, and samples per process.
DATA_SHARE = 0.15      # data loading this large is worth workers or a faster source
COMM_SHARE = 0.25      # an allreduce of all gradients this large cannot hide behind backward
LOW_OVERLAP = 0.25     # hiding less than this of what backward could cover is named
SMALL_BATCH = 32       # below this, per-step fixed costs (Python, launches, latency) dominate


def diagnose(row: Mapping[str, Any], peers: Sequence[Mapping[str, Any]] = ()) -> str:
    """One line on what bounds a configuration: threads, communication, data, batch, or compute.

    When communication bounds it, the line names the fixes with their expected gain (see
    :func:`comm_fixes`); ``peers`` (the other rows) supply measured gains where they exist.
    """
    if not row.get("applicable", True):
        return f"not applicable: {row.get('reason')}"
    slow = precision_note(row["precision"], row["device"])
    step, phases, comm = row["mean_step_seconds"], row["breakdown"], row.get("comm")
    threads, cores = row["threads_per_process"], row["cores"]
    nproc = row["nproc"] * (row.get("hosts") or 1)      # simulated hosts share this machine's cores
    found = []
    if row["device"] == "cpu" and cores and nproc * threads > cores:
        fix = (f"OMP_NUM_THREADS={cores // nproc} would fit" if nproc <= cores
               else f"more processes than cores: use at most {cores} per node")
        found.append(f"CPU threads oversubscribed ({nproc} process(es) x {threads} threads on {cores} cores; {fix})")
    comm_text, comm_share = "", 0.0
    if comm is not None:
        seconds, ratio = comm_seconds(row)
        comm_share = seconds / step
        rate = comm["allreduce_gb_per_s"]
        sent = (f"{row['payload_bytes_per_step'] / 1e6:.2f} MB per step after {row['grad_compression']} "
                f"(of {comm['grad_bytes_per_step'] / 1e6:.2f} MB of gradients), allreduce ~" if ratio < 1
                else f"{comm['grad_bytes_per_step'] / 1e6:.2f} MB of gradients per step, allreduce ")
        comm_text = f"{sent}{seconds * 1e3:.2f} ms at {rate or 0:.2f} GB/s = {comm_share:.0%} of the step"
        overlap = row.get("comm_overlap")
        if overlap is not None:
            comm_text += f", {overlap:.0%} of it hidden behind the backward pass"
        if comm_share >= COMM_SHARE:
            of_possible = comm.get("overlap_of_possible")
            lost = ""
            if of_possible is not None and of_possible < LOW_OVERLAP:
                # with every core computing, gloo's transfers take turns with the backward: no layout helps
                why = (f"on CPU, gloo's transfers compete with the backward pass for cores that {nproc} "
                       f"process(es) x {threads} thread(s) already fill, as they would in any loop"
                       if row["device"] == "cpu" and cores and nproc * threads >= cores
                       else "gradient buckets reduced first-layers-first wait for the whole backward")
                lost = f"; the allreduce hid only {of_possible:.0%} of what the backward pass could cover ({why})"
            found.append(f"communication ({comm_text}){lost}; {comm_fixes(row, peers)}")
    if phases["data_wait"] / step >= DATA_SHARE:
        found.append(f"data loading ({phases['data_wait'] / step:.0%} of the step waits for batches)")
    per_device = row["batch_per_process"] // row.get("devices", 1)
    if per_device < SMALL_BATCH:
        found.append(f"too-small per-process batch ({per_device} samples; fixed per-step costs dominate)")
    if not found:
        busy = (phases["forward"] + phases["backward"] + phases["optimizer"]) / step
        found.append(f"compute (forward+backward+optimizer {busy:.0%} of the step)")
    line = "bound by " + "; ".join(found)
    line = line if not comm_text or comm_share >= COMM_SHARE else f"{line}; communication {comm_text}"
    return f"{slow}; {line}" if slow else line


def cpu_flags() -> set[str]:
    """This CPU's feature flags (Linux ``/proc/cpuinfo``); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def precision_note(precision: str, device: str, flags: set[str] | None = None) -> str | None:
    """Why ``precision`` runs no faster than fp32 on ``device``, or None where it is accelerated.

    bf16 needs AVX512-BF16 or AMX on a CPU (without them autocast only adds conversions); no CPU
    path here speeds up fp16; a GPU without bf16 support emulates it.
    """
    if device == "cpu" and precision == "bf16":
        flags = cpu_flags() if flags is None else flags
        if not flags & {"avx512_bf16", "amx_bf16"}:
            return ("bf16 is not accelerated on this CPU (no AVX512-BF16 or AMX flag): autocast only adds "
                    "conversions, so expect it slower than fp32 here; CPUs with AMX (Xeon Sapphire Rapids "
                    "and later) or GPUs with bf16 tensor cores (Ampere and later) run it faster")
    if device == "cpu" and precision == "fp16":
        return ("fp16 is not accelerated on a CPU: expect it slower than fp32 here; GPUs with tensor "
                "cores run it 2x or more faster")
    if device == "cuda" and precision == "bf16":
        import torch

        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            return "bf16 is not supported natively by this GPU (before Ampere): use fp16 here"
    return None


_BOUNDS = (("bound by CPU threads", "thread-bound"), ("bound by communication", "sync-bound"),
           ("bound by data loading", "data-bound"), ("bound by too-small", "overhead-bound"),
           ("bound by compute", "compute-bound"))


def bound_word(diagnosis: str) -> str:
    """A word or two for a chart label: what bounds the row, from its diagnosis."""
    if "is not accelerated" in diagnosis or "not supported natively" in diagnosis:
        return f"{diagnosis.split()[0]} not accelerated"
    return next((word for phrase, word in _BOUNDS if phrase in diagnosis), "")


def comm_seconds(row: Mapping[str, Any]) -> tuple[float, float]:
    """Seconds of allreduce per step and the fraction of the gradient bytes sent.

    The probe times an allreduce of every gradient; a compressed row sends a fraction of those
    bytes, so its share is the probe's time scaled by that fraction (bandwidth-bound links).
    """
    comm = row["comm"]
    payload, grads = row.get("payload_bytes_per_step"), comm["grad_bytes_per_step"]
    ratio = payload / grads if payload and grads and payload < grads else 1.0
    return comm["allreduce_seconds"] * ratio, ratio


def comm_fixes(row: Mapping[str, Any], peers: Sequence[Mapping[str, Any]] = ()) -> str:
    """What would cut a communication-bound step, each with its expected samples/s.

    A step is taken as compute + the allreduce (no overlap: an upper bound on the gain). A
    compression that sends a fraction r of the bytes leaves compute + r x allreduce; doubling
    the per-process batch (or accumulating 2 micro-batches) doubles compute, not the allreduce.
    A compression measured in ``peers`` (same mode, processes and hosts) is quoted as measured.
    """
    step, comm = row["mean_step_seconds"], comm_seconds(row)[0]
    rate = row["samples_per_second"]
    compute = max(step - comm, 1e-9)
    grad_bytes = row["comm"]["grad_bytes_per_step"]
    same = [p for p in peers if p.get("applicable", True) and p is not row and p.get("samples_per_second")
            and all(p.get(k) == row.get(k) for k in ("mode", "nproc", "hosts", "precision"))]
    tips = []
    for choice, ratio in (("powersgd", None), ("fp16", 0.5)):
        if choice == row.get("grad_compression"):
            continue
        peer = next((p for p in same if p.get("grad_compression") == choice), None)
        if peer is not None:
            tips.append(f"grad_compression='{choice}' measured {peer['samples_per_second'] / rate:.1f}x "
                        f"the samples/s ({peer['payload_bytes_per_step'] / 1e6:.2f} MB per step)")
        elif ratio is not None and (row.get("payload_bytes_per_step") or grad_bytes) >= grad_bytes:
            expect = rate * step / (compute + comm * ratio)
            tips.append(f"grad_compression='{choice}' halves the bytes: expect ~{expect:.0f} samples/s")
        elif ratio is None:
            tips.append("grad_compression='powersgd' (weight matrices as rank-2 factors, often 10x+ fewer "
                        "bytes; measure it with --grad-compression none,powersgd)")
    bigger = rate * 2 * step / (2 * compute + comm)
    tips.append(f"a 2x per-process batch or accumulating 2 micro-batches: expect ~{bigger:.0f} samples/s")
    return "try " + "; ".join(tips)


def row_label(row: Mapping[str, Any]) -> str:
    """``ddp 2 hosts x1 fp32 powersgd``: what tells one configuration from another."""
    hosts = f" {row['hosts']} hosts" if row.get("hosts") else ""
    comp = f" {row['grad_compression']}" if row.get("grad_compression") not in (None, "none") else ""
    data = f" {row['data_format']}" if row.get("data_format") not in (None, "map") else ""
    return f"{row['mode']}{hosts} x{row['nproc']} {row['precision']}{comp}{data}"


def _mb(value: Any) -> str:
    return f"{value / 1e6:.2f}"


def _ms(value: Any) -> str:
    return f"{value * 1e3:.2f}"


def _markdown(report: Mapping[str, Any]) -> str:
    """bench.md: the table, a diagnosis per configuration, the raw comparison, how it was run."""
    from ddpkit.report import PERCENT, RATE, SPEEDUP, markdown_table

    rows = [{**r, "step_ms": r.get("step_seconds"), **{f"{p}_ms": (r.get("breakdown") or {}).get(p) for p in PHASES}}
            for r in report["configurations"]]
    columns = [("mode", "mode"), ("nproc", "processes"), ("precision", "precision"),
               ("grad_compression", "compression"),
               ("samples_per_second", "samples/s", RATE), ("speedup", "speed-up", SPEEDUP),
               ("efficiency", "efficiency", PERCENT), ("step_ms", "step ms", _ms),
               ("data_wait_ms", "data ms", _ms), ("forward_ms", "forward ms", _ms),
               ("backward_ms", "backward ms", _ms), ("optimizer_ms", "optimizer ms", _ms),
               ("peak_rss_mb", "peak RSS MB", "{:.0f}"), ("payload_bytes_per_step", "MB/step", _mb)]
    if any(r.get("comm_overlap") is not None for r in rows):
        columns.append(("comm_overlap", "comm hidden", PERCENT))
    if any(r.get("data_format") not in (None, "map") for r in rows):
        columns[3:3] = [("data_format", "data")]
    if any(r.get("hosts") for r in rows):
        columns[2:2] = [("hosts", "hosts"), ("link_mbit", "link Mbit/s", "{:g}")]
    if report["gpus"]:
        columns.append(("peak_cuda_mb", "peak CUDA MB", "{:.0f}"))
    s = report["settings"]
    parts = ["# ddpkit bench", f"`{report.get('command', 'ddpkit bench')}`",
             f"{s['model']} on {s['data']}, {s['batch']} samples per process per step, {s['warmup']} warm-up "
             f"+ {s['steps']} timed steps, SGD lr {s['lr']} momentum {s['momentum']}, seed {s['seed']}; "
             f"torch {report['torch']} on {report['device']}"
             + (f" ({report['gpus']} GPUs)." if report["gpus"] else "."),
             markdown_table(rows, columns),
             "samples/s: global batch / median step time (a step lasts as long as its slowest rank). "
             "step ms: that median. Phase columns: mean per step over ranks; backward includes the "
             "allreduce it waits for. Peak RSS: the largest rank's, in MiB. comm hidden: the share of "
             "an allreduce of the step's gradients that the backward pass hid (the step's backward "
             "against a backward with no gradient sync, measured after the loop).",
             "## Diagnosis", "\n".join(f"- {row_label(r)}: {r['diagnosis']}" for r in report["configurations"])]
    raw = report.get("raw_vs_ddpkit")
    if raw:
        parts += ["## ddpkit vs hand-written PyTorch DDP",
                  f"{raw['mode']} x{raw['nproc']} {raw['precision']}, {raw['repeats']} interleaved pairs "
                  f"(raw, ddpkit, raw, ...): step-time ratio ddpkit/raw **{raw['step_time_ratio']:.3f}** "
                  f"(median of pairs), peak-memory ratio ({raw['memory_metric']}) **{raw['memory_ratio']:.3f}**, "
                  f"final weights bitwise equal: **{'yes' if raw['weights_equal'] else 'no'}**"
                  + "".join(f", allreduce hidden behind backward ({loop}) {_pct(raw.get('comm_overlap', {}).get(loop))}"
                            for loop in ("raw", "ddpkit")) + ". Both loops "
                  "train on the data set cut to whole global batches, so ddpkit's order and sharding equal "
                  "DistributedSampler's. The weights compared are rank 0's parameters and buffers at the "
                  "end of training: ddpkit skips DDP's per-step buffer broadcast for BatchNorm statistics "
                  "(rank 0's evolve as under it) and averages them across ranks only where they are read "
                  "or saved, so after an evaluation or in a checkpoint they are the cross-rank average, "
                  "not rank 0's copy."]
    return "\n\n".join(parts) + "\n"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def write_outputs(out: Path, report: Mapping[str, Any]) -> list[Path]:
    """Write bench.json, bench.md and scaling.png (skipped, with a note, without matplotlib)."""
    from ddpkit.report import plot_scaling
    from ddpkit._files import atomic_path

    written = []
    for name, text in (("bench.json", json.dumps(report, indent=2, allow_nan=False) + "\n"),
                       ("bench.md", _markdown(report))):
        with atomic_path(out / name) as tmp:
            tmp.write_text(text, encoding="utf-8")
        written.append(out / name)
    try:
        plotted = [{**r, "processes": r["nproc"]} for r in report["configurations"]]
        written.append(plot_scaling(plotted, out / "scaling.png"))
    except ImportError:
        print("bench: scaling.png skipped: matplotlib is not installed (pip install matplotlib)", flush=True)
    return written
