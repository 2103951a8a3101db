"""The comparison table, speed-ups and the report files."""

from __future__ import annotations

import json
import re

import pytest

from ddpkit.bench.outputs import plot_scaling, write_report
from ddpkit.bench.table import COLUMNS, add_speedup, markdown_table
from ddpkit.errors import UsageError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

RUNS = [
    {
        "mode": "single",
        "processes": 1,
        "precision": "fp32",
        "wall_seconds": 12.345,
        "samples_per_second": 400.0,
        "test_accuracy": 0.9716,
    },
    {
        "mode": "ddp",
        "processes": 2,
        "precision": "fp32",
        "wall_seconds": 6.7,
        "samples_per_second": 740.0,
        "test_accuracy": 0.9721,
    },
    {
        "mode": "ddp",
        "processes": 4,
        "precision": "bf16",
        "wall_seconds": 4.01,
        "samples_per_second": 1333.3,
        "test_accuracy": None,
    },
]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]  # skip escaped \|


def test_speedup_is_the_exact_throughput_ratio_and_efficiency_per_process():
    rows = add_speedup(RUNS)
    assert [r["speedup"] for r in rows] == [1.0, 740.0 / 400.0, 1333.3 / 400.0]
    assert [r["efficiency"] for r in rows] == [1.0, 740.0 / 400.0 / 2, 1333.3 / 400.0 / 4]
    assert "speedup" not in RUNS[0], "input rows must not be modified"


def test_speedup_uses_the_first_baseline_and_none_when_missing():
    rows = [
        {"mode": "ddp", "processes": 2, "samples_per_second": 300.0},
        {"mode": "single", "processes": 1, "samples_per_second": 100.0},
        {"mode": "single", "processes": 1, "samples_per_second": 200.0},
        {"mode": "ddp", "processes": 2},
    ]
    out = add_speedup(rows)
    assert [r["speedup"] for r in out] == [3.0, 1.0, 2.0, None]
    assert out[0]["efficiency"] == 1.5 and out[3]["efficiency"] is None
    assert all(r["speedup"] is None and r["efficiency"] is None for r in add_speedup(rows, baseline_mode="cpu"))
    other = add_speedup(
        [{"mode": "single", "processes": 1, "tok": 10}, {"mode": "x", "processes": 2, "tok": 15}], key="tok"
    )
    assert other[1]["speedup"] == 1.5


def test_table_has_header_separator_and_a_row_per_input():
    rows = add_speedup(RUNS)
    lines = markdown_table(rows, COLUMNS).splitlines()
    assert len(lines) == 2 + len(rows)
    assert _cells(lines[0]) == [h for _, h, *_ in COLUMNS]
    assert all(set(c) <= set("-:") and c.count("-") >= 3 for c in _cells(lines[1]))
    assert _cells(lines[1])[0].endswith("-") and _cells(lines[1])[3].endswith(":")  # text left, numbers right
    assert len({len(line) for line in lines}) == 1, "columns should be padded to one width"


def test_cell_formats():
    lines = markdown_table(add_speedup(RUNS), COLUMNS).splitlines()
    assert _cells(lines[2]) == ["single", "1", "fp32", "12.35", "400.0", "1.00x", "97.2%"]
    assert _cells(lines[3]) == ["ddp", "2", "fp32", "6.70", "740.0", "1.85x", "97.2%"]
    assert _cells(lines[4])[-2:] == ["3.33x", "-"]  # None prints as a dash


def test_custom_formatters_and_escaping():
    rows = [{"name": "a|b", "x": 0.123456, "y": 3}]
    cols = [("name", "name"), ("x", "x"), ("y", "y", lambda v: f"<{v}>")]
    assert _cells(markdown_table(rows, cols).splitlines()[2]) == [r"a\|b", "0.1235", "<3>"]
    with pytest.raises(UsageError):
        markdown_table(rows, [("name",)])


def test_write_report_files_round_trip(tmp_path):
    rows = add_speedup(RUNS)
    paths = write_report(
        tmp_path / "out",
        rows,
        title="Digits: single vs DDP",
        columns=COLUMNS,
        extra_markdown="Measured on 2 CPU cores.",
    )
    assert set(paths) == {"markdown", "json", "plot"}
    assert json.loads(paths["json"].read_text()) == rows
    md = paths["markdown"].read_text()
    assert md.startswith("# Digits: single vs DDP\n") and "1.85x |" in md
    assert md.rstrip().endswith("Measured on 2 CPU cores.")
    png = paths["plot"].read_bytes()
    assert paths["plot"].name == "scaling.png" and png[:8] == PNG_SIGNATURE and len(png) > 5000
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["report.json", "report.md", "scaling.png"]


def test_write_report_keeps_old_files_when_rows_are_unserialisable(tmp_path):
    write_report(tmp_path, RUNS, title="first")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(UsageError, match="JSON"):
        write_report(tmp_path, [{**RUNS[0], "bad": object()}], title="second")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_nan_becomes_null_in_json(tmp_path):
    paths = write_report(tmp_path, [{"mode": "single", "processes": 1, "test_accuracy": float("nan")}], title="nan")
    assert json.loads(paths["json"].read_text())[0]["test_accuracy"] is None


def test_plot_scaling_without_throughput_still_draws(tmp_path):
    path = plot_scaling([{"mode": "single"}], tmp_path / "s.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
