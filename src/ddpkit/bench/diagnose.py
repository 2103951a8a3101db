"""What ``ddpkit bench`` found, in words: what bounds each configuration, and what would help.

The diagnosis names what bounds a configuration, in this order of blame: oversubscribed CPU
threads; SyncBatchNorm's collectives; the gradient exchange, by its cause (:mod:`ddpkit.bench.wire`: the link moving the bytes,
the per-call latency, or ranks waiting for the slowest); data loading; a batch too small to
amortise per-step costs; else compute. Thresholds are shares of the mean step time.

A fix is named only where the arithmetic predicts a gain, and with the samples/s it predicts
(:func:`recommendations`): compression only where the link itself takes a real share of the step
(bytes / measured link speed), since latency and waiting do not shrink with fewer bytes.
``ddpkit bench --diagnose-verify`` and ``ddpkit demo`` then measure the best fix of each row
(:func:`checked`): a prediction more than :data:`VERIFY_TOLERANCE` off is a diagnosis error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ddpkit.bench.wire import bus_bytes

# Diagnosis thresholds: shares of the mean step time, gains, and samples per process.
DATA_SHARE = 0.15  # data loading this large is worth workers or a faster source
COMM_SHARE = 0.25  # a gradient exchange costing this much of the step bounds it
LINK_SHARE = 0.10  # below this share of the step on the wire, fewer bytes cannot help: no compression
MIN_GAIN = 1.10  # a fix is named where it predicts at least this many times the samples/s
LOW_OVERLAP = 0.25  # hiding less than this of what backward could cover is named
SMALL_BATCH = 32  # below this, per-step fixed costs (Python, launches, latency) dominate
VERIFY_TOLERANCE = 0.30
"""A measured fix more than this far from its prediction (relative) is flagged as a diagnosis error."""


def exchange(row: Mapping[str, Any]) -> dict[str, Any] | None:
    """A row's gradient exchange: its parts, what the step loses to it, and what dominates.

    ``lost`` is what the step's backward took beyond a backward without gradient sync (every
    part not hidden behind compute), else the parts' sum; ``compute`` is the rest of the step;
    ``cause`` is ``"link"``, ``"latency"`` or ``"wait"``, whichever part is largest. None for a
    row without a measured exchange (one process, or a result from before the wire was probed).
    """
    comm = row.get("comm")
    if not comm or "transfer_s" not in comm:
        return None
    parts = {"link": comm["transfer_s"], "latency": comm["latency_s"], "wait": comm["wait_s"]}
    step = row["mean_step_seconds"]
    exposed = comm.get("exposed_seconds")
    lost = min(step, sum(parts.values()) if exposed is None else exposed)
    own = parts["link"] + parts["latency"]
    return {
        **parts,
        "lost": lost,
        "compute": max(step - lost, 1e-9),
        "step": step,
        # what of the exchange's own time (not the wait) the step did not hide
        "exposed_share": min(1.0, max(0.0, lost - parts["wait"]) / own) if own > 0 else 1.0,
        "cause": max(parts, key=parts.get),
    }


def recommendations(row: Mapping[str, Any], peers: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """The fixes worth naming for a row bound by its gradient exchange (or SyncBatchNorm's), best first.

    Each is ``{"change", "predicted_samples_per_second"}`` plus ``grad_compression`` or
    ``batch_factor`` (what to run to check it) and, where a row of ``peers`` already ran it,
    ``measured_samples_per_second``. A step is compute + what the exchange costs it: compression
    sending B bytes leaves the same compute, the wait, and B / link speed (and the calls'
    latency) exposed as much as today's transfer; doubling the per-process batch doubles the data
    and grows the forward and backward compute by the row's ``compute_scaling_2x`` (2 where not
    measured), not the exchange, the optimizer step or the loop's own work. A fix is named where it predicts :data:`MIN_GAIN` or more, and
    compression only where the link carries :data:`LINK_SHARE` of the step or more.
    """
    part = exchange(row)
    if part is None:
        return []
    rate, step, comm = row["samples_per_second"], part["step"], row["comm"]
    synced = comm.get("sync_batchnorm_seconds") or 0.0  # SyncBatchNorm's collectives, inside the phases
    if (part["lost"] + synced) / step < COMM_SHARE:
        return []
    found = []
    link = comm.get("link_bytes_per_s")
    exact = bool(row.get("micro_shards"))  # compression and infrequent syncs do not combine with it
    if part["cause"] == "link" and link and part["link"] / step >= LINK_SHARE and not exact:
        world = row.get("world_size") or row["nproc"] * (row.get("hosts") or 1)
        per_call = comm.get("latency_per_call_s") or 0.0
        calls = comm.get("calls_per_step") or 1
        current = row.get("grad_compression") or "none"
        for choice, sent in (
            ("powersgd", comm.get("powersgd_bytes_per_step")),
            ("fp16", comm["grad_bytes_per_step"] / 2),
        ):
            if choice == current or not sent or sent >= (row.get("payload_bytes_per_step") or 0):
                continue
            new_calls = calls * (2 if choice == "powersgd" and current != "powersgd" else 1)
            own = bus_bytes(sent, world) / link + new_calls * per_call
            predicted = rate * step / (part["compute"] + part["wait"] + own * part["exposed_share"])
            found.append(
                {
                    "change": f"grad_compression='{choice}'",
                    "grad_compression": choice,
                    "sends_bytes": sent,
                    "predicted_samples_per_second": predicted,
                }
            )
    if part["cause"] == "link" and link and row.get("sync", "every-step") == "every-step" and not exact:
        found += _infrequent(row, part, link, found)
    # twice the samples: the data doubles, the forward and backward compute grow by what the bench
    # measured on twice the batch (a small model's do not double: each call's fixed cost stays; 2x
    # where not measured); the exchange, the optimizer step and the loop's own work do not
    phases = row["breakdown"]
    growth = (row.get("compute_scaling_2x") or 2.0) - 1.0
    compute = max(0.0, phases["forward"] + phases["backward"] - part["lost"] - synced)
    scaling = phases["data_wait"] + compute * growth
    predicted = rate * 2 * step / (step + scaling)
    found.append(
        {
            "change": "a 2x per-process batch or accumulating 2 micro-batches",
            "batch_factor": 2,
            "predicted_samples_per_second": predicted,
        }
    )
    found = [f for f in found if f["predicted_samples_per_second"] >= MIN_GAIN * rate]
    for fix in found:
        peer = _measured(row, fix, peers)
        if peer is not None:
            fix["measured_samples_per_second"] = peer["samples_per_second"]
    return sorted(found, key=lambda f: -f["predicted_samples_per_second"])


DILOCO_PERIODS = (10, 50, 100, 200, 500)
"""The ``sync_every`` values a DiLoCo recommendation picks from: the shortest whose sync costs at
most a tenth of the compute of its period."""


def _infrequent(
    row: Mapping[str, Any], part: Mapping[str, Any], link: float, compressions: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """DiLoCo where even PowerSGD leaves the link a quarter of the step: the whole exchange once a period.

    A sync sends every weight once (bytes / link speed, and one call); spread over ``H`` steps it
    leaves the step's compute and a ``1 / H`` share of the sync.
    """
    comm = row["comm"]
    world = row.get("world_size") or row["nproc"] * (row.get("hosts") or 1)
    per_call = comm.get("latency_per_call_s") or 0.0
    if row.get("grad_compression") == "powersgd":  # does PowerSGD leave the link a quarter of the step?
        wire = part["link"] + part["latency"]
        step_with = part["step"]
    else:
        powersgd = next((f for f in compressions if f.get("grad_compression") == "powersgd"), None)
        if powersgd is None:
            return []
        wire = bus_bytes(powersgd["sends_bytes"], world) / link + 2 * (comm.get("calls_per_step") or 1) * per_call
        step_with = row["samples_per_second"] * part["step"] / powersgd["predicted_samples_per_second"]
    if wire < COMM_SHARE * step_with:
        return []
    sync = bus_bytes(comm["grad_bytes_per_step"], world) / link + per_call
    compute = part["compute"]
    every = next((h for h in DILOCO_PERIODS if sync / h <= 0.1 * compute), DILOCO_PERIODS[-1])
    predicted = row["samples_per_second"] * part["step"] / (compute + sync / every)
    return [
        {
            "change": f"sync='diloco', sync_every={every} (every weight once a period)",
            "sync": "diloco",
            "sync_every": every,
            "predicted_samples_per_second": predicted,
        }
    ]


def _measured(row: Mapping[str, Any], fix: Mapping[str, Any], peers: Sequence[Mapping[str, Any]]) -> Any:
    """The row of ``peers`` that already ran ``fix`` of ``row`` (same mode, processes, hosts, precision)."""
    if "sync" in fix:  # the same infrequent sync at the same period, uncompressed
        wanted = {"sync": fix["sync"], "sync_every": fix["sync_every"], "grad_compression": "none"}
    elif fix.get("grad_compression"):
        wanted = {"grad_compression": fix["grad_compression"], "sync": row.get("sync", "every-step")}
    else:
        return None
    return next(
        (
            p
            for p in peers
            if p is not row
            and p.get("applicable", True)
            and p.get("samples_per_second")
            and all(p.get(k, "every-step" if k == "sync" else None) == v for k, v in wanted.items())
            and all(
                p.get(k) == row.get(k)
                for k in ("mode", "nproc", "hosts", "link_mbit", "precision", "data_format", "sync_bn", "micro_shards")
            )
        ),
        None,
    )


def checked(fix: Mapping[str, Any], measured: float) -> dict[str, Any]:
    """``fix`` with what running it measured, its error and whether that is a diagnosis error."""
    predicted = fix["predicted_samples_per_second"]
    error = measured / predicted - 1.0
    return {
        **fix,
        "measured_samples_per_second": measured,
        "error": error,
        "diagnosis_error": abs(error) > VERIFY_TOLERANCE,
    }


def diagnose(row: Mapping[str, Any], peers: Sequence[Mapping[str, Any]] = ()) -> str:
    """One line on what bounds a configuration: threads, the link, latency, waiting, data, batch,
    or compute; where the exchange bounds it, the fixes of :func:`recommendations` with what each
    predicts. ``peers`` (the other rows) supply measured results where they exist."""
    if not row.get("applicable", True):
        return f"not applicable: {row.get('reason')}"
    slow = precision_note(row["precision"], row["device"])
    step, phases = row["mean_step_seconds"], row["breakdown"]
    threads, cores = row["threads_per_process"], row["cores"]
    nproc = row["nproc"] * (row.get("hosts") or 1)  # simulated hosts share this machine's cores
    found = []
    if row["device"] == "cpu" and cores and nproc * threads > cores:
        fix = (
            f"OMP_NUM_THREADS={cores // nproc} would fit"
            if nproc <= cores
            else f"more processes than cores: use at most {cores} per node"
        )
        found.append(f"CPU threads oversubscribed ({nproc} process(es) x {threads} threads on {cores} cores; {fix})")
    part = exchange(row)
    comm = row.get("comm") or {}
    synced = comm.get("sync_batchnorm_seconds") or 0.0
    if synced / step >= COMM_SHARE:
        batch = [f for f in recommendations(row, peers) if "batch_factor" in f]
        tip = (
            f" ({batch[0]['change']}: expect ~{batch[0]['predicted_samples_per_second']:.0f} samples/s)"
            if batch
            else ""
        )
        found.append(
            f"SyncBatchNorm's collectives ({comm['sync_batchnorm_calls']} a step, 2 per layer: "
            f"{synced * 1e3:.2f} ms = {synced / step:.0%} of the step, every rank waiting for the slowest "
            f"at each layer); what helps: fewer, larger steps{tip}; sync_batchnorm=False (--no-sync-bn) "
            "where a result that depends on the number of processes is acceptable"
        )
    bound = part is not None and part["lost"] / step >= COMM_SHARE
    if bound:
        found.append(_exchange_bound(row, part, recommendations(row, peers)))
    if phases["data_wait"] / step >= DATA_SHARE:
        found.append(f"data loading ({phases['data_wait'] / step:.0%} of the step waits for batches)")
    per_device = row["batch_per_process"] // row.get("devices", 1)
    if per_device < SMALL_BATCH:
        found.append(f"too-small per-process batch ({per_device} samples; fixed per-step costs dominate)")
    if not found:
        busy = (phases["forward"] + phases["backward"] + phases["optimizer"]) / step
        found.append(f"compute (forward+backward+optimizer {busy:.0%} of the step)")
    line = "bound by " + "; ".join(found)
    if part is not None and not bound:
        line += f"; gradient exchange {_parts(row, part)}"
    if comm.get("sync_batchnorm_calls") and synced / step < COMM_SHARE:
        line += (
            f"; SyncBatchNorm's {comm['sync_batchnorm_calls']} collectives a step (2 per layer) take "
            f"{synced * 1e3:.2f} ms = {synced / step:.0%} of it, waiting for the other ranks included"
        )
    return f"{slow}; {line}" if slow else line


def _parts(row: Mapping[str, Any], part: Mapping[str, Any]) -> str:
    """``1.20 ms = 9% of the step (0.06 MB of gradients on the link 0.05 ms at 1700.0 MB/s, 2 call(s)
    0.10 ms, waiting 1.05 ms)``."""
    comm = row["comm"]
    payload = row.get("payload_bytes_per_step") or comm["grad_bytes_per_step"]
    if row.get("sync", "every-step") != "every-step":
        what = f"{payload / 1e6:.2f} MB a step ({row['sync']}: every weight once in {row['sync_every']} steps)"
    elif payload < comm["grad_bytes_per_step"]:
        what = f"{payload / 1e6:.2f} MB after {row['grad_compression']}"
    else:
        what = f"{payload / 1e6:.2f} MB of gradients"
    speed = comm.get("link_bytes_per_s")
    text = (
        f"{part['lost'] * 1e3:.2f} ms = {part['lost'] / part['step']:.0%} of the step ({what} on the link "
        f"{part['link'] * 1e3:.2f} ms"
        + (f" at {speed / 1e6:.1f} MB/s" if speed else "")
        + f", {comm.get('calls_per_step') or 1} call(s) {part['latency'] * 1e3:.2f} ms, waiting "
        f"{part['wait'] * 1e3:.2f} ms)"
    )
    overlap = row.get("comm_overlap")
    if overlap is not None:
        text += f", {overlap:.0%} of the exchange hidden behind the backward pass"
    hidden = part["link"] + part["latency"] - (part["lost"] - part["wait"])
    if row.get("sync", "every-step") != "every-step" and hidden > 0.005 * part["step"]:
        text += f", {hidden * 1e3:.2f} ms of it a step behind the inner steps"
    return text


def _exchange_bound(row: Mapping[str, Any], part: Mapping[str, Any], fixes: Sequence[Mapping[str, Any]]) -> str:
    """The bound's phrase for a row whose gradient exchange costs it a real share of the step."""
    nproc, threads, cores = row["nproc"] * (row.get("hosts") or 1), row["threads_per_process"], row["cores"]
    tips = [
        f"{f['change']}"
        + (f" ({f['sends_bytes'] / 1e6:.2f} MB per step)" if f.get("sends_bytes") else "")
        + f": expect ~{f['predicted_samples_per_second']:.0f} samples/s"
        + (f" (measured {f['measured_samples_per_second']:.0f} here)" if "measured_samples_per_second" in f else "")
        for f in fixes
    ]
    if part["cause"] == "link":
        text = f"the link ({_parts(row, part)})"
        comm = row["comm"]
        of_possible = comm.get("overlap_of_possible")
        if of_possible is not None and of_possible < LOW_OVERLAP:
            # with every core computing, gloo's transfers take turns with the backward: no layout helps
            why = (
                f"on CPU, gloo's transfers compete with the backward pass for cores that {nproc} "
                f"process(es) x {threads} thread(s) already fill, as they would in any loop"
                if row["device"] == "cpu" and cores and nproc * threads >= cores
                else "gradient buckets reduced first-layers-first wait for the whole backward"
            )
            text += f"; the exchange hid only {of_possible:.0%} of what the backward pass could cover ({why})"
        return text + (f"; try {'; '.join(tips)}" if tips else "")
    crowded = row["device"] == "cpu" and cores and nproc * threads >= cores
    helps = ["fewer, larger steps" + (f" ({tips[0]})" if tips else "")]
    if part["cause"] == "wait":
        skew = row["comm"].get("skew_s") or 0.0
        text = (
            f"waiting for the slowest rank or a busy core ({part['wait'] * 1e3:.2f} ms a step; ranks end "
            f"their forward pass {skew * 1e3:.2f} ms apart on average; exchange {_parts(row, part)})"
        )
        if crowded:
            helps.append(
                f"fewer processes than cores ({nproc} process(es) x {threads} thread(s) fill {cores} "
                "cores, so a pause on one core stalls every rank)"
            )
        helps.append("pinning each process's threads to cores of its own (taskset, OMP_PROC_BIND=close)")
    else:
        text = (
            f"per-call latency ({row['comm'].get('calls_per_step') or 1} collective call(s) a step at "
            f"{row['comm']['latency_per_call_s'] * 1e3:.2f} ms each; exchange {_parts(row, part)})"
        )
        if crowded:
            helps.append(f"fewer processes than cores ({nproc} process(es) x {threads} thread(s) fill {cores} cores)")
    return f"{text}; what helps: {', '.join(helps)}"


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
            return (
                "bf16 is not accelerated on this CPU (no AVX512-BF16 or AMX flag): autocast only adds "
                "conversions, so expect it slower than fp32 here; CPUs with AMX (Xeon Sapphire Rapids "
                "and later) or GPUs with bf16 tensor cores (Ampere and later) run it faster"
            )
    if device == "cpu" and precision == "fp16":
        return (
            "fp16 is not accelerated on a CPU: expect it slower than fp32 here; GPUs with tensor "
            "cores run it 2x or more faster"
        )
    if device == "cuda" and precision == "bf16":
        import torch

        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            return "bf16 is not supported natively by this GPU (before Ampere): use fp16 here"
    return None


_BOUNDS = (
    ("bound by CPU threads", "thread-bound"),
    ("bound by SyncBatchNorm", "syncbn-bound"),
    ("bound by the link", "link-bound"),
    ("bound by waiting", "wait-bound"),
    ("bound by per-call latency", "latency-bound"),
    ("bound by data loading", "data-bound"),
    ("bound by too-small", "overhead-bound"),
    ("bound by compute", "compute-bound"),
)


def bound_word(diagnosis: str) -> str:
    """A word or two for a chart label: what bounds the row, from its diagnosis."""
    if "is not accelerated" in diagnosis or "not supported natively" in diagnosis:
        return f"{diagnosis.split()[0]} not accelerated"
    return next((word for phrase, word in _BOUNDS if phrase in diagnosis), "")
