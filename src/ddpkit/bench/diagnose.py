"""What ``ddpkit bench`` found, in words: what bounds each configuration, and what would help.

The diagnosis names what bounds a configuration, in this order of blame: oversubscribed CPU
threads, communication that cannot hide behind backward, data loading, a batch too small to
amortise per-step costs; else compute. Thresholds are shares of the mean step time.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

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

