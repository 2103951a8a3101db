"""The comparison table of the demo and benchmarks: markdown, JSON and a scaling chart.

A column is ``(key, header)`` or ``(key, header, fmt)``. ``fmt`` is a ``str.format``
template such as ``"{:.2f}x"`` or a callable ``value -> str``; without one, floats get four
significant digits. Missing or None values print as ``-``.

Example:
    >>> rows = add_speedup([{"mode": "single", "processes": 1, "samples_per_second": 100.0},
    ...                     {"mode": "ddp", "processes": 2, "samples_per_second": 185.0}])
    >>> print(markdown_table(rows, [("mode", "mode"), ("speedup", "speed-up", "{:.2f}x")]))
    | mode   | speed-up |
    | ------ | -------: |
    | single |    1.00x |
    | ddp    |    1.85x |
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Union

from ddpkit.errors import UsageError
from ddpkit._files import atomic_path

Formatter = Union[str, Callable[[Any], str]]
Column = Union[tuple[str, str], tuple[str, str, Formatter]]

SECONDS = "{:.2f}"
RATE = "{:.1f}"
SPEEDUP = "{:.2f}x"
PERCENT = "{:.1%}"  # for fractions in [0, 1]: 0.972 -> "97.2%"

COLUMNS: list[Column] = [
    ("mode", "mode"),
    ("processes", "processes"),
    ("precision", "precision"),
    ("wall_seconds", "wall s", SECONDS),
    ("samples_per_second", "samples/s", RATE),
    ("speedup", "speed-up vs single", SPEEDUP),
    ("test_accuracy", "test accuracy", PERCENT),
]
"""The demo comparison; rows carry these keys (``test_accuracy`` as a fraction)."""

MISSING = "-"


def add_speedup(rows: Sequence[Mapping[str, Any]], *, baseline_mode: str = "single",
                key: str = "samples_per_second") -> list[dict[str, Any]]:
    """Copy ``rows`` adding ``speedup`` (throughput over the baseline's) and ``efficiency``.

    The baseline is the first row whose ``mode`` is ``baseline_mode``; ``efficiency`` is
    speed-up per process, so perfect scaling reads 1.0. Rows that cannot be compared (no
    baseline, a missing or zero throughput or process count) get None rather than a guess.
    """
    base = next((r for r in rows if r.get("mode") == baseline_mode), None)
    base_rate = _positive(base.get(key)) if base is not None else None
    out = []
    for row in rows:
        rate = _positive(row.get(key))
        speedup = rate / base_rate if rate is not None and base_rate is not None else None
        processes = _positive(row.get("processes"))
        efficiency = speedup / processes if speedup is not None and processes is not None else None
        out.append({**row, "speedup": speedup, "efficiency": efficiency})
    return out


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """A GitHub-flavoured markdown table, padded so it also lines up on a terminal.

    Numeric columns are right-aligned (``---:``); the rest left-aligned.
    """
    cols = [_column(c) for c in columns]
    headers = [_escape(header) for _, header, _ in cols]
    body = [[_cell(row.get(key), fmt) for key, _, fmt in cols] for row in rows]
    right = [_is_numeric(row.get(key) for row in rows) for key, _, _ in cols]
    widths = [max(3, len(h), *(len(line[i]) for line in body)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)]
        return "| " + " | ".join(padded) + " |"

    separator = ["-" * (w - 1) + ":" if r else "-" * w for w, r in zip(widths, right)]
    return "\n".join([line(headers), "| " + " | ".join(separator) + " |", *map(line, body)])


def plot_scaling(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Bar chart of samples/s per run, each bar labelled with its speed-up (and a row's ``bound``,
    e.g. "0.63x — sync-bound", where it has one), saved as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = [r for r in rows if _finite(r.get("samples_per_second"))]
    fig = Figure(figsize=(max(5.0, 1.4 * len(runs) + 2), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if runs:
        labels = [_run_label(r) for r in runs]
        bars = ax.bar(labels, [r["samples_per_second"] for r in runs], color="tab:blue")
        notes = [(SPEEDUP.format(r["speedup"]) if _finite(r.get("speedup")) else "")
                 + (f" — {r['bound']}" if r.get("bound") else "") for r in runs]
        ax.bar_label(bars, labels=notes, padding=3)
        ax.margins(y=0.15)
    else:
        ax.text(0.5, 0.5, "no throughput measured", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("Throughput by mode (labels: speed-up vs single"
                 + (" — bound)" if any(r.get("bound") for r in runs) else ")"))
    ax.set_xlabel("mode × processes")
    ax.set_ylabel("samples/s")
    ax.grid(True, axis="y", alpha=0.3)
    target = Path(path)
    with atomic_path(target) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    return target


def write_report(out_dir: str | os.PathLike, rows: Sequence[Mapping[str, Any]], *, title: str,
                 columns: Sequence[Column] = COLUMNS, extra_markdown: str = "") -> dict[str, Path]:
    """Write ``report.md``, ``report.json`` and ``scaling.png`` into ``out_dir``.

    Everything is rendered before anything is written, and each file is replaced
    atomically, so a failure leaves an earlier report whole instead of half-overwritten.

    Returns:
        ``{"markdown": ..., "json": ..., "plot": ...}`` paths.

    Raises:
        UsageError: a row holds a value JSON cannot represent.
    """
    out = Path(out_dir)
    parts = [f"# {title}", markdown_table(rows, columns)]
    if extra_markdown.strip():
        parts.append(extra_markdown.strip())
    markdown = "\n\n".join(parts) + "\n"
    try:
        as_json = json.dumps([_strict(r) for r in rows], indent=2, allow_nan=False,
                             default=_json_default) + "\n"
    except (TypeError, ValueError) as exc:
        raise UsageError(f"report rows cannot be written as JSON: {exc}") from None
    paths = {"markdown": out / "report.md", "json": out / "report.json", "plot": out / "scaling.png"}
    plot_scaling(rows, paths["plot"])
    for key, text in (("markdown", markdown), ("json", as_json)):
        with atomic_path(paths[key]) as tmp:
            tmp.write_text(text, encoding="utf-8")
    return paths


# -- helpers ----------------------------------------------------------------------------
def _column(column: Sequence[Any]) -> tuple[str, str, Formatter | None]:
    if not isinstance(column, (tuple, list)) or len(column) not in (2, 3):
        raise UsageError(f"a column is (key, header) or (key, header, fmt), got {column!r}")
    key, header, *rest = column
    return str(key), str(header), rest[0] if rest else None


def _cell(value: Any, fmt: Formatter | None) -> str:
    if value is None:
        return MISSING
    if callable(fmt):
        text = fmt(value)
    elif fmt is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        text = fmt.format(value)
    elif isinstance(value, float):
        text = f"{value:.4g}"
    else:
        text = str(value)
    return _escape(text)


def _escape(text: str) -> str:
    """Keep a cell on one line and stop a ``|`` inside it from splitting the column."""
    return " ".join(str(text).split()).replace("|", r"\|")


def _is_numeric(values: Any) -> bool:
    present = [v for v in values if v is not None]
    return bool(present) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                 for v in present)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: Any) -> float | None:
    return float(value) if _finite(value) and value > 0 else None


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


__all__ = ["COLUMNS", "Column", "PERCENT", "RATE", "SECONDS", "SPEEDUP",
           "add_speedup", "markdown_table", "plot_scaling", "write_report"]
