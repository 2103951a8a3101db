"""What ``ddpkit bench`` and ``ddpkit demo`` leave on disk: JSON, markdown and a scaling chart.

``ddpkit bench`` writes ``bench.json``, ``bench.md`` (its table, a diagnosis per configuration
and the raw comparison) and ``scaling.png`` with :func:`write_outputs`; ``ddpkit demo`` writes
``report.md``, ``report.json`` and ``scaling.png`` with :func:`write_report`. Every file is
replaced atomically.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ddpkit._files import atomic_path
from ddpkit.bench.diagnose import VERIFY_TOLERANCE
from ddpkit.bench.stopwatch import PHASES
from ddpkit.bench.table import COLUMNS, PERCENT, RATE, SPEEDUP, Column, finite, markdown_table
from ddpkit.errors import UsageError


def plot_scaling(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Bar chart of samples/s per run, each bar labelled with its speed-up (and a row's ``bound``,
    e.g. "0.63x — sync-bound", where it has one), saved as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = [r for r in rows if finite(r.get("samples_per_second"))]
    fig = Figure(figsize=(max(5.0, 1.4 * len(runs) + 2), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if runs:
        labels = [_run_label(r) for r in runs]
        # one position a row: rows that share a label (a mode with and without micro-shards) never stack
        bars = ax.bar(range(len(runs)), [r["samples_per_second"] for r in runs], color="tab:blue")
        ax.set_xticks(range(len(runs)), labels)
        notes = [
            (SPEEDUP.format(r["speedup"]) if finite(r.get("speedup")) else "")
            + (f" — {r['bound']}" if r.get("bound") else "")
            for r in runs
        ]
        ax.bar_label(bars, labels=notes, padding=3)
        ax.margins(y=0.15)
    else:
        ax.text(0.5, 0.5, "no throughput measured", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(
        "Throughput by mode (labels: speed-up vs single" + (" — bound)" if any(r.get("bound") for r in runs) else ")")
    )
    ax.set_xlabel("mode × processes")
    ax.set_ylabel("samples/s")
    ax.grid(True, axis="y", alpha=0.3)
    target = Path(path)
    with atomic_path(target) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    return target


def write_report(
    out_dir: str | os.PathLike,
    rows: Sequence[Mapping[str, Any]],
    *,
    title: str,
    columns: Sequence[Column] = COLUMNS,
    extra_markdown: str = "",
    opening: str = "",
) -> dict[str, Path]:
    """Write ``report.md``, ``report.json`` and ``scaling.png`` into ``out_dir``.

    Everything is rendered before anything is written, and each file is replaced
    atomically, so a failure leaves an earlier report whole instead of half-overwritten.

    Args:
        out_dir: the directory to write into.
        rows: the table's rows, written as they are to ``report.json``.
        title: the markdown page's heading.
        columns: the table's columns (see :mod:`ddpkit.bench.table`); the demo's by default.
        extra_markdown: text after the table (notes, diagnoses).
        opening: a paragraph between the heading and the table (what the page shows first).

    Returns:
        ``{"markdown": ..., "json": ..., "plot": ...}`` paths.

    Raises:
        UsageError: a row holds a value JSON cannot represent.
    """
    out = Path(out_dir)
    parts = [f"# {title}", *([opening.strip()] if opening.strip() else []), markdown_table(rows, columns)]
    if extra_markdown.strip():
        parts.append(extra_markdown.strip())
    markdown = "\n\n".join(parts) + "\n"
    try:
        as_json = json.dumps([_strict(r) for r in rows], indent=2, allow_nan=False, default=_json_default) + "\n"
    except (TypeError, ValueError) as exc:
        raise UsageError(f"report rows cannot be written as JSON: {exc}") from None
    paths = {"markdown": out / "report.md", "json": out / "report.json", "plot": out / "scaling.png"}
    plot_scaling(rows, paths["plot"])
    for key, text in (("markdown", markdown), ("json", as_json)):
        with atomic_path(paths[key]) as tmp:
            tmp.write_text(text, encoding="utf-8")
    return paths


def _run_label(row: Mapping[str, Any]) -> str:
    label = str(row.get("mode", "?"))
    if row.get("processes") is not None:
        label += f" ×{row['processes']}"
    if row.get("hosts"):
        label += f" ({row['hosts']} hosts)"
    if row.get("precision"):
        label += f"\n{row['precision']}"
    if row.get("grad_compression") not in (None, "none"):
        label += f" {row['grad_compression']}"
    if row.get("micro_shards") not in (None, "-", 0, 1):
        label += f"\nmicro-shards {row['micro_shards']}"
    return label


def _strict(row: Mapping[str, Any]) -> dict[str, Any]:
    """NaN and infinity become null: standard JSON has no spelling for them."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


def _json_default(value: Any) -> Any:
    """Tensors and NumPy scalars become plain numbers; paths become strings."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{type(value).__name__} {value!r} is not JSON serializable")


def row_label(row: Mapping[str, Any]) -> str:
    """``ddp 2 hosts x1 fp32 powersgd``: what tells one configuration from another."""
    hosts = f" {row['hosts']} hosts" if row.get("hosts") else ""
    comp = f" {row['grad_compression']}" if row.get("grad_compression") not in (None, "none") else ""
    data = f" {row['data_format']}" if row.get("data_format") not in (None, "map") else ""
    sync = (" syncbn" if row.get("sync_bn") else "") + (
        f" {row['sync']}/{row['sync_every']}" if row.get("sync") not in (None, "every-step") else ""
    )
    sync += f" micro-shards {row['micro_shards']}" if row.get("micro_shards") else ""
    return f"{row['mode']}{hosts} x{row['nproc']} {row['precision']}{comp}{sync}{data}"


def verified_line(outcome: Mapping[str, Any], markdown: bool = True) -> str:
    """``grad_compression='powersgd': predicted 120 samples/s, measured 110 (-8%)``, flagged where off."""
    line = (
        f"{outcome['change']}: predicted {outcome['predicted_samples_per_second']:.0f} samples/s, measured "
        f"{outcome['measured_samples_per_second']:.0f} ({outcome['error']:+.0%})"
    )
    flag = "**diagnosis error**" if markdown else "DIAGNOSIS ERROR"
    return line + (
        f" — {flag}: the prediction is more than {VERIFY_TOLERANCE:.0%} off" if outcome["diagnosis_error"] else ""
    )


def _mb(value: Any) -> str:
    return f"{value / 1e6:.2f}"


def _ms(value: Any) -> str:
    return f"{value * 1e3:.2f}"


def _markdown(report: Mapping[str, Any]) -> str:
    """bench.md: the table, a diagnosis per configuration, the raw comparison, how it was run."""
    rows = [
        {**r, "step_ms": r.get("step_seconds"), **{f"{p}_ms": (r.get("breakdown") or {}).get(p) for p in PHASES}}
        for r in report["configurations"]
    ]
    columns = [
        ("mode", "mode"),
        ("nproc", "processes"),
        ("precision", "precision"),
        ("grad_compression", "compression"),
        ("samples_per_second", "samples/s", RATE),
        ("speedup", "speed-up", SPEEDUP),
        ("efficiency", "efficiency", PERCENT),
        ("step_ms", "step ms", _ms),
        ("data_wait_ms", "data ms", _ms),
        ("forward_ms", "forward ms", _ms),
        ("backward_ms", "backward ms", _ms),
        ("optimizer_ms", "optimizer ms", _ms),
        ("peak_rss_mb", "peak RSS MB", "{:.0f}"),
        ("payload_bytes_per_step", "MB/step", _mb),
    ]
    if any(r.get("comm_overlap") is not None for r in rows):
        columns.append(("comm_overlap", "comm hidden", PERCENT))
    if any(r.get("data_format") not in (None, "map") for r in rows):
        columns[3:3] = [("data_format", "data")]
    if any(r.get("sync_bn") for r in rows):
        columns[3:3] = [("sync_bn", "sync BN")]
    if any(r.get("micro_shards") for r in rows):
        columns[3:3] = [("micro_shards", "micro-shards")]
    if any(r.get("sync") not in (None, "every-step") for r in rows):
        columns[3:3] = [("sync", "sync"), ("sync_every", "every")]
    if any(r.get("tokens_per_second") for r in rows):
        columns.insert(
            columns.index(("samples_per_second", "samples/s", RATE)) + 1, ("tokens_per_second", "tokens/s", RATE)
        )
    if any(r.get("hosts") for r in rows):
        columns[2:2] = [("hosts", "hosts"), ("link_mbit", "link Mbit/s", "{:g}")]
    if report["gpus"]:
        columns.append(("peak_cuda_mb", "peak CUDA MB", "{:.0f}"))
    s = report["settings"]
    parts = [
        "# ddpkit bench",
        f"`{report.get('command', 'ddpkit bench')}`",
        f"{s['model']} on {s['data']}, {s['batch']} samples per process per step, {s['warmup']} warm-up "
        f"+ {s['steps']} timed steps, SGD lr {s['lr']} momentum {s['momentum']}, seed {s['seed']}; "
        f"torch {report['torch']} on {report['device']}" + (f" ({report['gpus']} GPUs)." if report["gpus"] else "."),
        markdown_table(rows, columns),
        "samples/s: global batch / median step time (a step lasts as long as its slowest rank). "
        "step ms: that median. Phase columns: mean per step over ranks; backward includes the "
        "allreduce it waits for. Peak RSS: the largest rank's, in MiB. comm hidden: the share of "
        "the gradient exchange's own time (transfer + per-call latency, measured after the loop "
        "with every rank released together) that the backward pass hid (the step's backward "
        "against a backward with no gradient sync); waiting for a slower rank is never hidden.",
        "## Diagnosis",
        "\n".join(f"- {row_label(r)}: {r['diagnosis']}" for r in report["configurations"]),
    ]
    checked = [(r, r["verify"]) for r in report["configurations"] if r.get("verify")]
    if checked:
        parts += [
            "## Diagnosis checked by measuring it",
            "\n".join(f"- {row_label(r)}: {verified_line(v)}" for r, v in checked),
        ]
    raw = report.get("raw_vs_ddpkit")
    if raw:
        parts += [
            "## ddpkit vs hand-written PyTorch DDP",
            f"{raw['mode']} x{raw['nproc']} {raw['precision']}, {raw['repeats']} interleaved pairs "
            f"(raw, ddpkit, raw, ...): step-time ratio ddpkit/raw **{raw['step_time_ratio']:.3f}** "
            f"(median of pairs), peak-memory ratio ({raw['memory_metric']}) **{raw['memory_ratio']:.3f}**, "
            f"final weights bitwise equal: **{'yes' if raw['weights_equal'] else 'no'}**"
            + "".join(
                f", allreduce hidden behind backward ({loop}) {_pct(raw.get('comm_overlap', {}).get(loop))}"
                for loop in ("raw", "ddpkit")
            )
            + ". Both loops "
            "train on the data set cut to whole global batches, so ddpkit's order and sharding equal "
            "DistributedSampler's. The weights compared are rank 0's parameters and buffers at the "
            "end of training: ddpkit skips DDP's per-step buffer broadcast for BatchNorm statistics "
            "(rank 0's evolve as under it) and averages them across ranks only where they are read "
            "or saved, so after an evaluation or in a checkpoint they are the cross-rank average, "
            "not rank 0's copy.",
        ]
    return "\n\n".join(parts) + "\n"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def write_outputs(out: Path, report: Mapping[str, Any]) -> list[Path]:
    """Write bench.json, bench.md and scaling.png (skipped, with a note, without matplotlib)."""
    written = []
    for name, text in (
        ("bench.json", json.dumps(report, indent=2, allow_nan=False) + "\n"),
        ("bench.md", _markdown(report)),
    ):
        with atomic_path(out / name) as tmp:
            tmp.write_text(text, encoding="utf-8")
        written.append(out / name)
    try:
        plotted = [{**r, "processes": r["nproc"]} for r in report["configurations"]]
        written.append(plot_scaling(plotted, out / "scaling.png"))
    except ImportError:
        print("bench: scaling.png skipped: matplotlib is not installed (pip install matplotlib)", flush=True)
    return written
