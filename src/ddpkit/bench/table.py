"""The comparison tables of the demo and the bench: columns, cells, speed-up, markdown.

A column is ``(key, header)`` or ``(key, header, fmt)``. ``fmt`` is a ``str.format``
template such as ``"{:.2f}x"`` or a callable ``value -> str``; without one, floats get four
significant digits. Missing or None values print as ``-``. :mod:`ddpkit.bench.outputs` writes
the tables into files, with a scaling chart.

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

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ddpkit.errors import UsageError

Formatter = str | Callable[[Any], str]
Column = tuple[str, str] | tuple[str, str, Formatter]

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


def add_speedup(
    rows: Sequence[Mapping[str, Any]], *, baseline_mode: str = "single", key: str = "samples_per_second"
) -> list[dict[str, Any]]:
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
    return bool(present) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present)


def finite(value: Any) -> bool:
    """A real number (not a bool), neither NaN nor infinite: one that can be plotted and compared."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: Any) -> float | None:
    return float(value) if finite(value) and value > 0 else None


__all__ = ["COLUMNS", "Column", "PERCENT", "RATE", "SECONDS", "SPEEDUP", "add_speedup", "finite", "markdown_table"]
