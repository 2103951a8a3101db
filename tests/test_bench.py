"""`ddpkit bench`: the structure and internal consistency of bench.json, never a wall-clock figure.

One tiny end-to-end run (mlp, batch 8, 1 + 4 steps, single + dp + ddp x2, and two interleaved
raw/ddpkit pairs) feeds the structural checks; the diagnosis and statistics are also tested
on hand-made measurements, and bad input in-process through the CLI entry point.
"""

from __future__ import annotations

import json

import pytest
import torch

from ddpkit import cli
from ddpkit.bench import Configuration, Settings, plan, summarize
from ddpkit.bench_report import PHASES, diagnose
from ddpkit.recipes.models import build_model
from helpers import ddpkit as ddpkit_cli

PNG = b"\x89PNG\r\n\x1a\n"
ROW_KEYS = {"mode", "nproc", "precision", "samples_per_second", "speedup", "efficiency", "peak_rss_mb",
            "breakdown", "diagnosis"}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out"
    result = ddpkit_cli("bench", "--model", "mlp", "--data", "synthetic", "--modes", "single,dp,ddp",
                        "--nproc", "2", "--batch", "8", "--steps", "4", "--warmup", "1",
                        "--compare-raw", "--repeats", "2", "--out", str(out), timeout=220)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out, json.loads((out / "bench.json").read_text()), result.stdout


@pytest.mark.timeout(300)
def test_bench_writes_consistent_rows(bench):
    out, report, stdout = bench
    rows = {r["mode"]: r for r in report["configurations"]}
    assert [r["mode"] for r in report["configurations"]] == ["single", "dp", "ddp"]
    single, ddp = rows["single"], rows["ddp"]
    for row in (single, ddp):
        assert ROW_KEYS <= row.keys() and row["applicable"] is True and row["precision"] == "fp32"
        assert row["samples_per_second"] == pytest.approx(row["global_batch"] / row["step_seconds"])
        assert row["speedup"] == pytest.approx(row["samples_per_second"] / single["samples_per_second"])
        assert row["efficiency"] == pytest.approx(row["speedup"] / row["nproc"])
        assert set(row["breakdown"]) == set(PHASES) and min(row["breakdown"].values()) >= 0
        assert sum(row["breakdown"].values()) <= row["mean_step_seconds"] * (1 + 1e-9)
        assert len(row["peak_rss_mb_per_rank"]) == row["nproc"] and row["peak_rss_mb"] > 0
        assert row["diagnosis"].startswith("bound by ") and "\n" not in row["diagnosis"]
        assert "too-small per-process batch (8 samples" in row["diagnosis"]
    assert (single["nproc"], single["global_batch"], single["speedup"]) == (1, 8, 1.0)
    assert (ddp["nproc"], ddp["global_batch"]) == (2, 16)
    mlp = build_model("mlp", num_classes=10, in_channels=3, image_size=32)
    assert ddp["comm"]["grad_bytes_per_step"] == 4 * sum(p.numel() for p in mlp.parameters())
    assert ddp["comm"]["allreduce_seconds"] > 0 and "MB of gradients per step" in ddp["diagnosis"]
    assert single["comm"] is None
    if torch.cuda.device_count() < 2:
        assert rows["dp"]["applicable"] is False and rows["dp"]["samples_per_second"] is None
        assert "2 or more visible GPUs" in rows["dp"]["diagnosis"]
    markdown = (out / "bench.md").read_text()
    assert "| mode" in markdown and "## Diagnosis" in markdown and "## ddpkit vs hand-written" in markdown
    assert (out / "scaling.png").read_bytes()[:8] == PNG
    progress = [line for line in stdout.splitlines() if line.startswith("bench: ")]
    assert sum("samples/s" in line for line in progress) == 2 + 2 * 2   # two rows, two raw/ddpkit pairs


@pytest.mark.timeout(300)
def test_compare_raw_matches_weights_bitwise(bench):
    _, report, _ = bench
    raw = report["raw_vs_ddpkit"]
    assert (raw["mode"], raw["nproc"], raw["precision"], raw["repeats"]) == ("ddp", 2, "fp32", 2)
    assert raw["weights_equal"] is True
    assert raw["step_time_ratio"] > 0 and raw["memory_ratio"] > 0
    assert len(raw["pairs"]) == 2
    assert {p["raw_weights_sha256"] for p in raw["pairs"]} == {p["ddpkit_weights_sha256"] for p in raw["pairs"]}


def _result(steps_by_rank, phases_by_rank, allreduce=None):
    ranks = [{"steps": s, "phases": p, "peak_rss_mb": 100.0 + i, "peak_cuda_mb": None, "grad_bytes": 4_000_000,
              "allreduce_seconds": allreduce, "threads": 1, "cores": 2, "weights_sha256": "x"}
             for i, (s, p) in enumerate(zip(steps_by_rank, phases_by_rank))]
    return {"device": "cpu", "batch_per_process": 64, "global_batch": 64 * len(ranks), "ranks": ranks}


def test_summarize_takes_the_slowest_rank_per_step():
    phases = [[0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4], [0.2, 0.2, 0.3, 0.4]]
    slow = [[0.1, 0.2, 0.5, 0.4], [0.1, 0.2, 0.3, 0.4], [0.2, 0.2, 0.3, 0.4]]
    row = summarize(Configuration("ddp", 2, "fp32"),
                    _result([[1.0, 1.0, 1.1], [1.2, 1.0, 1.1]], [phases, slow], allreduce=0.5))
    assert row["step_seconds"] == 1.1 and row["samples_per_second"] == pytest.approx(128 / 1.1)
    assert row["mean_step_seconds"] == pytest.approx((1.2 + 1.0 + 1.1) / 3)
    assert row["breakdown"]["backward"] == pytest.approx((0.3 * 5 + 0.5) / 6)
    assert row["peak_rss_mb"] == 101.0 and row["peak_rss_mb_per_rank"] == [100.0, 101.0]
    assert row["comm"]["allreduce_gb_per_s"] == pytest.approx(4_000_000 / 0.5 / 1e9)


def test_diagnosis_names_what_bounds_a_run():
    compute = summarize(Configuration("single", 1, "fp32"), _result([[1.0]], [[[0.01, 0.3, 0.6, 0.09]]]))
    assert diagnose(compute).startswith("bound by compute (forward+backward+optimizer 99%")
    data = summarize(Configuration("single", 1, "fp32"), _result([[1.0]], [[[0.5, 0.2, 0.2, 0.1]]]))
    assert diagnose(data) == "bound by data loading (50% of the step waits for batches)"
    comm = summarize(Configuration("ddp", 2, "fp32"), _result([[1.0], [1.0]], [[[0, 0.2, 0.7, 0.1]]] * 2, 0.5))
    assert diagnose(comm).startswith("bound by communication (4.00 MB of gradients per step, allreduce "
                                     "500.00 ms at 0.01 GB/s = 50% of the step)")
    crowded = {**comm, "threads_per_process": 2}
    assert diagnose(crowded).startswith("bound by CPU threads oversubscribed (2 process(es) x 2 threads")


def test_plan_runs_dp_only_with_two_gpus():
    settings = Settings(modes=("single", "dp", "ddp", "ddp-amp"), nproc=(1, 2))
    on_cpu = plan(settings, gpus=0)
    assert [c.label for c in on_cpu] == ["single x1 fp32", "dp x1 fp32", "ddp x1 fp32", "ddp x2 fp32",
                                         "ddp-amp x1 bf16", "ddp-amp x2 bf16"]
    assert on_cpu[1].reason is not None and all(c.reason is None for c in on_cpu if c.mode != "dp")
    on_gpus = plan(settings, gpus=2)
    assert on_gpus[1].reason is None and on_gpus[1].devices == 2 and on_gpus[-1].precision == "fp16"


@pytest.mark.parametrize("argv, message", [
    (["--modes", "single,fsdp"], "unknown mode 'fsdp'"),
    (["--nproc", "0"], "--nproc values must be at least 1"),
    (["--nproc", "two"], "--nproc takes comma-separated integers"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--batch", "0"], "--batch must be at least 1"),
    (["--model", "resnet50"], "invalid choice: 'resnet50'"),
    (["--compare-raw", "--modes", "single"], "add ddp or ddp-amp to --modes"),
    (["--compare-raw", "--nproc", "1"], "2 or more processes"),
], ids=["mode", "nproc-0", "nproc-text", "steps-0", "batch-0", "model", "raw-no-ddp", "raw-one-process"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    code = cli.main(["bench", *argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("ddpkit bench: error: "), err
    assert message in err
    assert not (tmp_path / "out").exists()
