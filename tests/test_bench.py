"""`ddpkit bench`: the structure and internal consistency of bench.json, never a wall-clock figure.

One tiny end-to-end run (mlp, batch 8, 2 + 4 steps, single + dp + ddp x2 without and with
PowerSGD, and one raw/ddpkit pair) feeds the structural checks; runs on simulated
hosts over a shaped link are slow tests; the diagnosis and statistics are also tested
on hand-made measurements, and bad input in-process through the CLI entry point.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddpkit import cli
from ddpkit.bench.diagnose import diagnose
from ddpkit.bench.plan import BenchSettings, Configuration, plan
from ddpkit.bench.stopwatch import PHASES
from ddpkit.bench.summary import summarize
from ddpkit.errors import UsageError
from ddpkit.recipes.models import build_model
from helpers import clean_env, kill_tree
from helpers import ddpkit as ddpkit_cli

PNG = b"\x89PNG\r\n\x1a\n"
ROW_KEYS = {
    "mode",
    "nproc",
    "precision",
    "samples_per_second",
    "speedup",
    "efficiency",
    "peak_rss_mb",
    "breakdown",
    "diagnosis",
}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out"
    result = ddpkit_cli(
        "bench",
        "--model",
        "mlp",
        "--data",
        "synthetic",
        "--modes",
        "single,dp,ddp",
        "--nproc",
        "2",
        "--batch",
        "8",
        "--steps",
        "4",
        "--warmup",
        "2",
        "--grad-compression",
        "none,powersgd",
        "--compare-raw",
        "--repeats",
        "1",
        "--out",
        str(out),
        timeout=220,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out, json.loads((out / "bench.json").read_text()), result.stdout


@pytest.mark.timeout(300)
def test_bench_writes_consistent_rows(bench):
    out, report, stdout = bench
    rows = {r["mode"]: r for r in report["configurations"]}
    assert [r["mode"] for r in report["configurations"]] == ["single", "dp", "ddp", "ddp"]
    sgd = report["configurations"][-1]
    rows["ddp"] = report["configurations"][2]
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
    assert ddp["comm"]["allreduce_seconds"] > 0 and "MB of gradients on the link" in ddp["diagnosis"]
    assert 0 <= ddp["comm_overlap"] <= 1 and "of the exchange hidden behind the backward pass" in ddp["diagnosis"]
    comm = ddp["comm"]
    assert min(comm["transfer_s"], comm["latency_s"], comm["wait_s"], comm["skew_s"]) >= 0
    assert comm["link_bytes_per_s"] is None or comm["link_bytes_per_s"] > 0
    assert comm["calls_per_step"] >= 1 and comm["latency_s"] == pytest.approx(
        comm["calls_per_step"] * comm["latency_per_call_s"]
    )
    assert single["comm_overlap"] is None
    assert single["comm"] is None
    assert ddp["grad_compression"] == "none" and ddp["payload_bytes_per_step"] == ddp["comm"]["grad_bytes_per_step"]
    assert ddp["bytes_sent_per_step"] == ddp["payload_bytes_per_step"]  # a ring of 2 sends it once
    assert sgd["grad_compression"] == "powersgd" and sgd["hosts"] is None and sgd["link_mbit"] is None
    assert 0 < sgd["payload_bytes_per_step"] * 10 < ddp["payload_bytes_per_step"]  # timed steps compress
    assert sgd["weights_sha256"] != ddp["weights_sha256"]
    if torch.cuda.device_count() < 2:
        assert rows["dp"]["applicable"] is False and rows["dp"]["samples_per_second"] is None
        assert "2 or more visible GPUs" in rows["dp"]["diagnosis"]
    markdown = (out / "bench.md").read_text()
    assert "| mode" in markdown and "## Diagnosis" in markdown and "## ddpkit vs hand-written" in markdown
    assert (out / "scaling.png").read_bytes()[:8] == PNG
    progress = [line for line in stdout.splitlines() if line.startswith("bench: ")]
    assert sum("samples/s" in line for line in progress) == 3 + 2  # three rows, one raw/ddpkit pair
    assert "ddp x2 fp32 powersgd: bound by" in markdown


@pytest.mark.timeout(300)
def test_compare_raw_matches_weights_bitwise(bench):
    _, report, _ = bench
    raw = report["raw_vs_ddpkit"]
    assert (raw["mode"], raw["nproc"], raw["precision"], raw["repeats"]) == ("ddp", 2, "fp32", 1)
    assert raw["weights_equal"] is True
    assert raw["step_time_ratio"] > 0 and raw["memory_ratio"] > 0
    assert len(raw["pairs"]) == 1
    assert {p["raw_weights_sha256"] for p in raw["pairs"]} == {p["ddpkit_weights_sha256"] for p in raw["pairs"]}
    assert all(0 <= raw["comm_overlap"][loop] <= 1 for loop in ("raw", "ddpkit"))  # both loops measured


def _wire(latency=0.0001, payload=None, link=None, probe_bytes=float(1 << 20)):
    """One rank's wire probe: every call the same (seconds)."""
    payload = latency if payload is None else payload
    return {
        "latency_calls": [latency] * 15,
        "payload_calls": [payload] * 15,
        "link_calls": [link if link is not None else payload] * 15,
        "link_probe_bytes": probe_bytes,
    }


def _result(steps_by_rank, phases_by_rank, allreduce=None, ready=None, calls=1):
    """A worker's result; ``allreduce``: seconds to move the 4 MB of gradients (latency 0.1 ms on top)."""
    probe = None if allreduce is None else _wire(payload=allreduce + 0.0001, probe_bytes=4_000_000.0)
    ranks = [
        {
            "steps": s,
            "phases": p,
            "peak_rss_mb": 100.0 + i,
            "peak_cuda_mb": None,
            "grad_bytes": 4_000_000,
            "payload_bytes_per_step": 4_000_000 if probe else 0,
            "wire": probe,
            "comm_calls": calls,
            "powersgd_bytes": 100_000,
            "ready_at": (ready or [[0.0] * len(s)] * len(steps_by_rank))[i],
            "threads": 1,
            "cores": 2,
            "weights_sha256": "x",
        }
        for i, (s, p) in enumerate(zip(steps_by_rank, phases_by_rank))
    ]
    return {"device": "cpu", "batch_per_process": 64, "global_batch": 64 * len(ranks), "ranks": ranks}


def test_summarize_takes_the_slowest_rank_per_step():
    phases = [[0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4], [0.2, 0.2, 0.3, 0.4]]
    slow = [[0.1, 0.2, 0.5, 0.4], [0.1, 0.2, 0.3, 0.4], [0.2, 0.2, 0.3, 0.4]]
    row = summarize(
        Configuration("ddp", 2, "fp32"), _result([[1.0, 1.0, 1.1], [1.2, 1.0, 1.1]], [phases, slow], allreduce=0.5)
    )
    assert row["step_seconds"] == 1.1 and row["samples_per_second"] == pytest.approx(128 / 1.1)
    assert row["mean_step_seconds"] == pytest.approx((1.2 + 1.0 + 1.1) / 3)
    assert row["breakdown"]["backward"] == pytest.approx((0.3 * 5 + 0.5) / 6)
    assert row["peak_rss_mb"] == 101.0 and row["peak_rss_mb_per_rank"] == [100.0, 101.0]
    assert row["comm"]["transfer_s"] == pytest.approx(0.5) and row["comm"]["latency_s"] == pytest.approx(0.0001)
    # a ring of 2 sends the 4 MB once in the 0.5 s the link took beyond its latency
    assert row["comm"]["link_bytes_per_s"] == pytest.approx(4_000_000 / 0.5)


def test_the_wire_counts_each_call_at_the_rank_released_last_and_ignores_busy_cores():
    from ddpkit.bench.wire import split, typical

    assert typical([1.0, 5.0, 2.0, 9.0]) == 1.5  # the faster half's median
    fast, late = _wire(latency=0.001, payload=0.003), _wire(latency=0.004, payload=0.006)
    late["payload_calls"][:8] = [0.040] * 8  # a core was busy: a scheduler tick or more
    ranks = [
        {"wire": fast, "comm_calls": 3, "ready_at": [1.000, 2.000]},
        {"wire": late, "comm_calls": 3, "ready_at": [1.002, 2.004]},
    ]
    parts = split(ranks, 1000.0)
    assert parts["latency_per_call_s"] == pytest.approx(0.001) and parts["latency_s"] == pytest.approx(0.003)
    assert parts["transfer_s"] == pytest.approx(0.002)
    assert parts["skew_s"] == pytest.approx(0.003)  # 2 ms, then 4 ms apart
    assert split([{"wire": None}, {"wire": fast}], 1000.0) is None


def test_diagnosis_names_what_bounds_a_run():
    compute = summarize(Configuration("single", 1, "fp32"), _result([[1.0]], [[[0.01, 0.3, 0.6, 0.09]]]))
    assert diagnose(compute).startswith("bound by compute (forward+backward+optimizer 99%")
    data = summarize(Configuration("single", 1, "fp32"), _result([[1.0]], [[[0.5, 0.2, 0.2, 0.1]]]))
    assert diagnose(data) == "bound by data loading (50% of the step waits for batches)"
    comm = summarize(Configuration("ddp", 2, "fp32"), _result([[1.0], [1.0]], [[[0, 0.2, 0.7, 0.1]]] * 2, 0.5))
    assert diagnose(comm).startswith(
        "bound by the link (500.10 ms = 50% of the step (4.00 MB of gradients on "
        "the link 500.00 ms at 8.0 MB/s, 1 call(s) 0.10 ms, waiting 0.00 ms)"
    )
    crowded = {**comm, "threads_per_process": 2}
    assert diagnose(crowded).startswith("bound by CPU threads oversubscribed (2 process(es) x 2 threads")


def test_an_exchange_behind_the_inner_steps_does_not_bound_a_periodic_row():
    """sync='diloco' with sync_delay: the link takes half a step's time on the whole model's bytes,
    but the steps wait only for what was left of each exchange when it landed."""

    def periodic(seconds_per_sync: float) -> dict:
        result = _result([[1.0] * 8, [1.0] * 8], [[[0, 0.2, 0.7, 0.1]] * 8] * 2, 0.5)
        result["sync"] = "diloco"
        for rank in result["ranks"]:
            rank["periodic"] = {"every": 8, "synced_steps": [False] * 7 + [True], "seconds_per_sync": seconds_per_sync}
        return summarize(Configuration("ddp", 2, "fp32"), result)

    behind, blocking = periodic(0.008), periodic(4.0)  # 1 ms a step left when it landed; the whole 0.5 s
    assert behind["comm"]["exposed_seconds"] == pytest.approx(0.001)
    assert "bound by the link" not in diagnose(behind) and diagnose(behind).startswith("bound by compute")
    assert "ms of it a step behind the inner steps" in diagnose(behind)
    assert blocking["comm"]["exposed_seconds"] == pytest.approx(0.5)
    assert diagnose(blocking).startswith("bound by the link") and "behind the inner steps" not in diagnose(blocking)


def test_comm_overlap_is_the_exchange_the_backward_hid():
    # backward 0.7 s in the step, 0.4 s alone: 0.3 s of a 0.5 s exchange left exposed, 0.2 s hidden
    phases = [[[0, 0.2, 0.7, 0.1]]] * 2
    result = _result([[1.0], [1.0]], phases, 0.4999)
    for rank in result["ranks"]:
        rank["backward_alone_seconds"] = 0.4
    row = summarize(Configuration("ddp", 2, "fp32"), result)
    assert row["comm"]["exposed_seconds"] == pytest.approx(0.3)
    assert row["comm_overlap"] == pytest.approx(0.2 / 0.5)
    assert row["comm"]["overlap_of_possible"] == pytest.approx(0.2 / 0.4)
    assert "40% of the exchange hidden behind the backward pass" in diagnose(row)
    assert "hid only" not in diagnose(row)
    for rank in result["ranks"]:  # backward alone 0.1 s: 0.6 exposed, nothing hidden
        rank["backward_alone_seconds"] = 0.1
    lost = summarize(Configuration("ddp", 2, "fp32"), result)
    assert lost["comm_overlap"] == 0.0 and lost["comm"]["overlap_of_possible"] == 0.0
    # what neither the bytes nor the call explains (0.1 s) is waiting
    assert lost["comm"]["wait_s"] == pytest.approx(0.1)
    assert "the exchange hid only 0% of what the backward pass could cover" in diagnose(lost)
    # 2 processes x 1 thread fill the 2 cores: the transfers compete with compute, whatever the layout
    assert "compete with the backward pass for cores that 2 process(es) x 1 thread(s) already fill" in diagnose(lost)
    assert "first-layers-first" not in diagnose(lost)
    spare = {**lost, "cores": 4}  # a core to spare: a low overlap points at the layout
    assert "(gradient buckets reduced first-layers-first wait for the whole backward)" in diagnose(spare)
    assert "compete" not in diagnose(spare)
    unmeasured = summarize(Configuration("ddp", 2, "fp32"), _result([[1.0], [1.0]], phases, 0.5))
    assert unmeasured["comm_overlap"] is None and "hidden behind" not in diagnose(unmeasured)
    for rank in result["ranks"]:  # compressed: exposed time includes the compressor's work
        rank["payload_bytes_per_step"] = 100_000
    compressed = summarize(Configuration("ddp", 2, "fp32", grad_compression="powersgd"), result)
    assert compressed["comm"]["exposed_seconds"] == pytest.approx(0.6)
    assert compressed["comm_overlap"] is None and compressed["comm"]["overlap_of_possible"] is None
    assert compressed["comm"]["wait_s"] == 0.0  # the skew only: the rest may be the compressor
    assert "hidden behind" not in diagnose(compressed)


def test_diagnosis_of_a_slow_link_names_the_fixes_with_what_they_predict():
    from ddpkit.bench.diagnose import recommendations

    comm = summarize(Configuration("ddp", 2, "fp32"), _result([[1.0], [1.0]], [[[0, 0.2, 0.7, 0.1]]] * 2, 0.5))
    alone = diagnose(comm)
    # step 1.0 s = 0.4999 compute + 0.5 transfer + 0.1 ms latency. PowerSGD's 0.1 MB: 0.0125 s and 2 calls;
    # fp16: 0.25 s; a 2x batch doubles forward (0.2 s) and the backward's compute (0.1999 s), not the
    # optimizer (0.1 s) or the exchange: 2 steps' samples in 1.3999 s
    assert "grad_compression='powersgd' (0.10 MB per step): expect ~250 samples/s" in alone
    assert "grad_compression='fp16' (2.00 MB per step): expect ~171 samples/s" in alone
    assert "a 2x per-process batch or accumulating 2 micro-batches: expect ~183 samples/s" in alone
    fixes = recommendations(comm)
    assert [f.get("grad_compression") for f in fixes][:1] == ["powersgd"]
    assert fixes[0]["predicted_samples_per_second"] == pytest.approx(128 / (0.4999 + 0.0125 + 0.0002), rel=1e-3)
    measured = {
        **comm,
        "grad_compression": "powersgd",
        "samples_per_second": 200.0,
        "payload_bytes_per_step": 100_000.0,
    }
    assert "(measured 200 here)" in diagnose(comm, [comm, measured])


def test_a_fix_measured_more_than_30_percent_off_its_prediction_is_a_diagnosis_error():
    from ddpkit.bench.diagnose import checked

    fix = {"change": "grad_compression='powersgd'", "predicted_samples_per_second": 100.0}
    assert checked(fix, 125.0)["diagnosis_error"] is False and checked(fix, 125.0)["error"] == pytest.approx(0.25)
    assert checked(fix, 131.0)["diagnosis_error"] is True and checked(fix, 69.0)["diagnosis_error"] is True


def test_plan_crosses_hosts_processes_and_compressions():
    settings = BenchSettings(
        modes=("single", "ddp", "ddp-amp"),
        nproc=(1,),
        hosts=(1, 2),
        grad_compression=("none", "powersgd"),
        link_mbit=100.0,
    )
    on_gpus = plan(settings, gpus=1)
    assert [c.label for c in on_gpus] == [
        "single x1 fp32",
        "ddp 1 host(s) x1 fp32",
        "ddp 1 host(s) x1 fp32 powersgd",
        "ddp 2 host(s) x1 fp32",
        "ddp 2 host(s) x1 fp32 powersgd",
        "ddp-amp 1 host(s) x1 fp16",
        "ddp-amp 1 host(s) x1 fp16 powersgd",
        "ddp-amp 2 host(s) x1 fp16",
        "ddp-amp 2 host(s) x1 fp16 powersgd",
    ]
    assert on_gpus[3].world_size == 2 and on_gpus[3].name == "ddp-h2-x1-fp32"
    refused = {c.label: c.reason for c in on_gpus if c.reason}
    assert list(refused) == [
        "ddp 1 host(s) x1 fp32 powersgd",
        "ddp-amp 1 host(s) x1 fp16 powersgd",
        "ddp-amp 2 host(s) x1 fp16 powersgd",
    ]
    assert "one process sends nothing" in refused["ddp 1 host(s) x1 fp32 powersgd"]
    assert "use precision='bf16'" in refused["ddp-amp 2 host(s) x1 fp16 powersgd"]


@pytest.mark.slow  # make test-slow: make test keeps the core of this family (its 15 minutes)
def test_plan_crosses_data_formats_and_a_shards_row_runs(tmp_path):
    settings = BenchSettings(modes=("single", "ddp"), nproc=(2,), data_format=("map", "shards"))
    assert [c.label for c in plan(settings, gpus=0)] == [
        "single x1 fp32",
        "single x1 fp32 shards",
        "ddp x2 fp32",
        "ddp x2 fp32 shards",
    ]
    result = ddpkit_cli(
        "bench",
        "--model",
        "mlp",
        "--modes",
        "single",
        "--data-format",
        "shards",
        "--batch",
        "8",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--out",
        str(tmp_path),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    row = json.loads((tmp_path / "bench.json").read_text())["configurations"][0]
    assert row["data_format"] == "shards" and row["samples_per_second"] > 0
    assert "| shards |" in (tmp_path / "bench.md").read_text()


@pytest.mark.slow  # 15 s: a 0.8M-parameter MLP with AdamW on 2 processes, twice (the bytes, not the size, are the point)
@pytest.mark.timeout(300)
def test_fsdp_holds_half_the_state_of_ddp_per_rank(tmp_path):
    result = ddpkit_cli(
        "bench",
        "--model",
        "mlp",
        "--data",
        "synthetic",
        "--modes",
        "ddp,fsdp",
        "--nproc",
        "2",
        "--optimizer",
        "adamw",
        "--batch",
        "8",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--out",
        str(tmp_path),
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {r["mode"]: r for r in json.loads((tmp_path / "bench.json").read_text())["configurations"]}
    ddp, fsdp = rows["ddp"]["state_bytes_per_rank"], rows["fsdp"]["state_bytes_per_rank"]
    assert len(ddp) == len(fsdp) == 2 and max(fsdp) <= 0.6 * min(ddp)
    params = sum(p.numel() for p in build_model("mlp", num_classes=10, in_channels=3, image_size=32).parameters())
    # fp32 AdamW: weights, gradients, 2 moments (ZeRO's 16 bytes), plus AdamW's scalar step counters
    assert 0 <= ddp[0] - 16 * params < 1024


def test_plan_crosses_sync_bn_for_ddp_rows_only():
    configs = plan(
        BenchSettings(model="convnet", modes=("single", "ddp", "fsdp"), nproc=(2,), sync_bn=(False, True)), gpus=0
    )
    assert [c.label for c in configs] == [
        "single x1 fp32",
        "ddp x2 fp32",
        "ddp x2 fp32 syncbn",
        "fsdp x2 fp32",
        "fsdp x2 fp32 syncbn",
    ]
    assert configs[2].name == "ddp-x2-fp32-syncbn" and configs[2].reason is None
    assert "fsdp shards no BatchNorm" in configs[4].reason


def test_plan_refuses_compression_under_fsdp():
    configs = plan(BenchSettings(model="mlp", modes=("fsdp",), nproc=(2,), grad_compression=("none", "fp16")), gpus=0)
    assert [c.label for c in configs] == ["fsdp x2 fp32", "fsdp x2 fp32 fp16"]
    assert configs[0].reason is None and "DDP hook" in configs[1].reason
    assert "BatchNorm" in plan(BenchSettings(model="convnet", modes=("fsdp",)), gpus=0)[0].reason


def test_plan_runs_dp_only_with_two_gpus():
    settings = BenchSettings(modes=("single", "dp", "ddp", "ddp-amp"), nproc=(1, 2))
    on_cpu = plan(settings, gpus=0)
    assert [c.label for c in on_cpu] == [
        "single x1 fp32",
        "dp x1 fp32",
        "ddp x1 fp32",
        "ddp x2 fp32",
        "ddp-amp x1 bf16",
        "ddp-amp x2 bf16",
    ]
    assert on_cpu[1].reason is not None and all(c.reason is None for c in on_cpu if c.mode != "dp")
    on_gpus = plan(settings, gpus=2)
    assert on_gpus[1].reason is None and on_gpus[1].devices == 2 and on_gpus[-1].precision == "fp16"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--modes", "single,zero"], "unknown mode 'zero'"),
        (["--nproc", "0"], "--nproc values must be at least 1"),
        (["--nproc", "two"], "--nproc takes comma-separated integers"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--batch", "0"], "--batch-size must be at least 1"),
        (["--model", "resnet50"], "invalid choice: 'resnet50'"),
        (["--compare-raw", "--modes", "single"], "add ddp or ddp-amp to --modes"),
        (["--compare-raw", "--nproc", "1"], "2 or more processes"),
        (["--grad-compression", "none,zip"], "unknown compression 'zip' in --grad-compression"),
        (["--hosts", "2"], "--hosts needs --link-mbit M"),
        (["--link-mbit", "100"], "add --hosts H"),
        (["--hosts", "2", "--link-mbit", "0"], "--link-mbit must be a positive number"),
        (["--hosts", "0", "--link-mbit", "10"], "--hosts values must be at least 1"),
        (["--hosts", "2", "--link-mbit", "10", "--modes", "single"], "add ddp or ddp-amp to --modes"),
        (["--data-format", "map,tar"], "unknown data format 'tar' in --data-format"),
        (["--sync-bn", "yes"], "--sync-batchnorm takes off, on or off,on, got 'yes'"),
    ],
    ids=[
        "mode",
        "nproc-0",
        "nproc-text",
        "steps-0",
        "batch-0",
        "model",
        "raw-no-ddp",
        "raw-one-process",
        "compression",
        "hosts-no-link",
        "link-no-hosts",
        "link-0",
        "hosts-0",
        "hosts-no-ddp",
        "data-format",
        "sync-bn",
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    code = cli.main(["bench", *argv, "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("ddpkit bench: error: "), err
    assert message in err
    assert not (tmp_path / "out").exists()


def netsim_usable() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


needs_netns = pytest.mark.skipif(not netsim_usable(), reason="simulated hosts need root and iproute2 (ip, tc)")


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(400)
def test_bench_on_simulated_hosts_over_a_shaped_link(tmp_path):
    from ddpkit.bench import netsim

    out = tmp_path / "out"
    result = ddpkit_cli(
        "bench",
        "--model",
        "mlp",
        "--modes",
        "ddp",
        "--hosts",
        "2",
        "--nproc",
        "1",
        "--link-mbit",
        "50",
        "--grad-compression",
        "none,powersgd",
        "--batch",
        "8",
        "--steps",
        "3",
        "--warmup",
        "2",
        "--out",
        str(out),
        timeout=380,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = json.loads((out / "bench.json").read_text())["configurations"]
    assert [(r["hosts"], r["link_mbit"], r["grad_compression"], r["world_size"]) for r in rows] == [
        (2, 50.0, "none", 2),
        (2, 50.0, "powersgd", 2),
    ]
    assert all(r["samples_per_second"] > 0 for r in rows)
    assert rows[1]["payload_bytes_per_step"] * 10 < rows[0]["payload_bytes_per_step"]
    assert "| hosts | link Mbit/s |" in (out / "bench.md").read_text().replace("  ", " ")
    assert netsim.leftovers() == {"namespaces": [], "links": []}


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_killed_hosts_bench_leaves_no_namespaces_links_or_processes(tmp_path, sig):
    from ddpkit.bench import netsim

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddpkit.cli",
            "bench",
            "--model",
            "resnet18",
            "--modes",
            "ddp",
            "--hosts",
            "2",
            "--nproc",
            "1",
            "--link-mbit",
            "5",
            "--batch",
            "4",
            "--steps",
            "50",
            "--warmup",
            "1",
            "--out",
            str(tmp_path / "out"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    try:
        deadline = time.monotonic() + 120
        while not _bench_workers() and time.monotonic() < deadline:  # the hosts are up and training
            time.sleep(0.5)
        assert _bench_workers() and netsim.leftovers(str(proc.pid))["namespaces"]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0
        assert netsim.leftovers(str(proc.pid)) == {"namespaces": [], "links": []}, err[-2000:]
        assert not _bench_workers(), err[-2000:]
    finally:
        kill_tree(proc.pid)
        netsim.remove_leftovers(str(proc.pid))


def _bench_workers() -> list[str]:
    """Live (not zombie) processes running ddpkit.bench.worker."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue
        if "-m ddpkit.bench.worker " in cmdline and state != "Z":
            found.append(cmdline)
    return found


RECORDED = Path(__file__).parent / "data" / "bench"
"""Workers' results recorded on this 2-core machine (2026-11-26): ResNet-18 on 2 simulated hosts at
100 Mbit/s, uncompressed and with PowerSGD (`ddpkit bench --model resnet18 --modes ddp --hosts 2
--nproc 1 --link-mbit 100 --grad-compression none,powersgd --batch 16 --steps 8 --warmup 2`), and
the ConvNet on loopback (`ddpkit bench --model convnet --data synthetic --modes ddp,ddp-amp --nproc
2`; the demo's DDP x2 step with SyncBatchNorm)."""


def _recorded(name: str, config: Configuration) -> dict:
    return summarize(config, json.loads((RECORDED / f"{name}.json").read_text()))


def test_a_link_bound_row_recommends_powersgd_with_a_prediction_its_measured_row_meets():
    from ddpkit.bench.diagnose import recommendations

    plain = _recorded("link-100mbit-resnet18", Configuration("ddp", 1, "fp32", hosts=2))
    powersgd = _recorded(
        "link-100mbit-resnet18-powersgd", Configuration("ddp", 1, "fp32", grad_compression="powersgd", hosts=2)
    )
    said = diagnose(plain, [plain, powersgd])
    assert said.startswith("bound by the link (") and "try grad_compression='powersgd' (0.33 MB per step)" in said
    assert plain["comm"]["transfer_s"] / plain["mean_step_seconds"] > 0.9
    assert plain["comm"]["link_bytes_per_s"] == pytest.approx(100e6 / 8, rel=0.15)  # the shaped link's speed
    best = recommendations(plain, [plain, powersgd])[0]
    assert best["grad_compression"] == "powersgd"
    assert best["measured_samples_per_second"] == powersgd["samples_per_second"]
    assert abs(powersgd["samples_per_second"] / best["predicted_samples_per_second"] - 1) <= 0.30


@pytest.mark.parametrize(
    "name, config",
    [
        ("loopback-convnet", Configuration("ddp", 2, "fp32")),
        ("loopback-convnet-bf16", Configuration("ddp-amp", 2, "bf16")),
        ("loopback-convnet-syncbn-waiting", Configuration("ddp", 2, "fp32", sync_bn=True)),
    ],
)
def test_a_row_whose_link_moves_the_payload_in_under_10_percent_of_its_step_never_names_compression(name, config):
    from ddpkit.bench.diagnose import recommendations

    row = _recorded(name, config)
    assert row["comm"]["transfer_s"] / row["mean_step_seconds"] < 0.10
    said = diagnose(row, [row])
    assert "compression" not in said and "powersgd" not in said and "fp16" not in said
    assert all("grad_compression" not in fix for fix in recommendations(row, [row]))


def test_a_wait_bound_row_says_so_and_names_what_helps():
    row = _recorded("loopback-convnet-syncbn-waiting", Configuration("ddp", 2, "fp32", sync_bn=True))
    said = diagnose(row, [row])
    assert said.startswith("bound by waiting for the slowest rank or a busy core (")
    comm = row["comm"]
    assert comm["wait_s"] > comm["transfer_s"] + comm["latency_s"]
    assert "fewer, larger steps (a 2x per-process batch or accumulating 2 micro-batches: expect ~" in said
    assert "fewer processes than cores (2 process(es) x 1 thread(s) fill 2 cores" in said
    assert "pinning each process's threads" in said
    latency = {**row, "comm": {**comm, "wait_s": 0.0, "latency_s": comm["exposed_seconds"]}}
    assert diagnose(latency, [latency]).startswith("bound by per-call latency (1 collective call(s) a step at ")


def test_diagnose_verify_measures_the_best_fix_once_and_flags_a_prediction_far_off(tmp_path, monkeypatch, capsys):
    from ddpkit.bench import run as bench_run

    row = summarize(Configuration("ddp", 2, "fp32"), _result([[1.0], [1.0]], [[[0, 0.2, 0.7, 0.1]]] * 2, 0.5))
    ran = []

    def measure(config, settings, result):
        ran.append((config.grad_compression, settings.batch, result.name))
        return {"samples_per_second": 100.0}

    monkeypatch.setattr(bench_run, "measure", measure)
    outcome = bench_run.verify(row, [row], BenchSettings(batch=64), tmp_path)
    assert ran == [("powersgd", 64, "verify-ddp-x2-fp32-powersgd.json")]  # the best fix, run once
    assert outcome["measured_samples_per_second"] == 100.0 and outcome["diagnosis_error"] is True  # 250 predicted
    printed = capsys.readouterr().out
    assert "grad_compression='powersgd': predicted 250 samples/s, measured 100 (-60%)" in printed
    assert "DIAGNOSIS ERROR: the prediction is more than 30% off" in printed
    already = {**row, "grad_compression": "powersgd", "samples_per_second": 240.0, "payload_bytes_per_step": 100_000.0}
    assert bench_run.verify(row, [row, already], BenchSettings(batch=64), tmp_path)["diagnosis_error"] is False
    assert len(ran) == 1  # a fix the table already ran is not run again
    quiet = summarize(Configuration("ddp", 2, "fp32"), _result([[1.0], [1.0]], [[[0, 0.4, 0.5, 0.1]]] * 2, 0.001))
    assert bench_run.verify(quiet, [quiet], BenchSettings(batch=64), tmp_path) is None  # nothing recommended
    from ddpkit.bench.outputs import _markdown

    markdown = _markdown(
        {
            "settings": dataclasses.asdict(BenchSettings()),
            "torch": "x",
            "device": "cpu",
            "gpus": 0,
            "configurations": [{**row, "diagnosis": "d", "verify": outcome}],
        }
    )
    assert "## Diagnosis checked by measuring it" in markdown and "**diagnosis error**" in markdown


def test_syncbatchnorm_s_collectives_bound_a_row_where_they_take_a_quarter_of_its_step():
    from ddpkit.bench.diagnose import bound_word, recommendations

    row = _recorded("loopback-convnet-syncbn-waiting", Configuration("ddp", 2, "fp32", sync_bn=True))
    step = row["mean_step_seconds"]
    heavy = {**row, "comm": {**row["comm"], "sync_batchnorm_calls": 4, "sync_batchnorm_seconds": 0.4 * step}}
    said = diagnose(heavy, [heavy])
    assert said.startswith("bound by SyncBatchNorm's collectives (4 a step, 2 per layer: ")
    assert "40% of the step" in said and "--no-sync-bn" in said and bound_word(said) == "syncbn-bound"
    light = {**row, "comm": {**row["comm"], "sync_batchnorm_calls": 4, "sync_batchnorm_seconds": 0.1 * step}}
    assert "SyncBatchNorm's 4 collectives a step (2 per layer) take" in diagnose(light, [light])
    # the collectives do not grow with the batch: a 2x batch predicts more where they weigh more
    gain = {r["change"]: r["predicted_samples_per_second"] for r in recommendations(heavy, [heavy])}
    plain = {r["change"]: r["predicted_samples_per_second"] for r in recommendations(row, [row])}
    batch = "a 2x per-process batch or accumulating 2 micro-batches"
    assert gain[batch] > plain[batch]


def test_several_link_speeds_run_every_hosts_row_on_each():
    from ddpkit.bench.flags import parse_settings

    settings = parse_settings(
        [
            "--modes",
            "single,ddp",
            "--hosts",
            "2",
            "--nproc",
            "1",
            "--link-mbit",
            "10,100",
            "--grad-compression",
            "none,powersgd",
        ]
    )
    assert settings.links == (10.0, 100.0) and settings.link_mbit == 10.0
    labels = [c.label for c in plan(settings, gpus=0)]
    assert labels == [
        "single x1 fp32",
        "ddp 2 host(s) at 10 Mbit/s x1 fp32",
        "ddp 2 host(s) at 100 Mbit/s x1 fp32",
        "ddp 2 host(s) at 10 Mbit/s x1 fp32 powersgd",
        "ddp 2 host(s) at 100 Mbit/s x1 fp32 powersgd",
    ]
    assert plan(settings, gpus=0)[2].name == "ddp-h2-100mbit-x1-fp32"
    with pytest.raises(UsageError, match="--link-mbit must be a positive number of Mbit/s, got '10,fast'"):
        parse_settings(["--modes", "ddp", "--hosts", "2", "--link-mbit", "10,fast"])


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(400)
def test_auto_chooses_powersgd_on_a_100_mbit_link(tmp_path):
    out = tmp_path / "out"
    result = ddpkit_cli(
        "bench",
        "--model",
        "resnet18",
        "--modes",
        "ddp",
        "--hosts",
        "2",
        "--nproc",
        "1",
        "--link-mbit",
        "100",
        "--grad-compression",
        "auto",
        "--batch",
        "8",
        "--steps",
        "2",
        "--warmup",
        "6",
        "--out",
        str(out),
        timeout=380,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    row = json.loads((out / "bench.json").read_text())["configurations"][0]
    decision = row["grad_compression_auto"]
    assert decision["choice"] == "powersgd", decision
    assert 8e6 < decision["link_bytes_per_s"] < 13e6  # the 100 Mbit/s link, as measured at setup
    assert "grad_compression='auto' chose 'powersgd'" in result.stderr


def test_the_2x_batch_prediction_grows_the_compute_by_what_was_measured_on_twice_the_batch():
    """A small model's compute does not double with its batch: the measured factor raises the
    prediction; without it the old assumption (doubling) holds."""
    from ddpkit.bench.diagnose import recommendations

    row = _recorded("loopback-convnet-syncbn-waiting", Configuration("ddp", 2, "fp32", sync_bn=True))
    assumed = {f["change"]: f["predicted_samples_per_second"] for f in recommendations(row, [row])}
    measured = {**row, "compute_scaling_2x": 1.2}
    grown = {f["change"]: f["predicted_samples_per_second"] for f in recommendations(measured, [measured])}
    change = "a 2x per-process batch or accumulating 2 micro-batches"
    assert change in assumed and grown[change] > assumed[change]
    doubled = {**row, "compute_scaling_2x": 2.0}
    assert {f["change"]: f["predicted_samples_per_second"] for f in recommendations(doubled, [doubled])}[
        change
    ] == pytest.approx(assumed[change])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no GPU")
def test_make_gpu_check_says_in_one_line_that_torch_sees_no_gpu(tmp_path):
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(root / "src")}
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "gpu_check.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().startswith("make gpu-check: torch ") and done.stderr.strip().endswith(
        "sees no CUDA GPU (CPU wheel, or no driver)"
    )
    assert len(done.stderr.strip().splitlines()) == 1


def _gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpu_check", Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bare_site(where: Path) -> Path:
    """A folder of links to torch, pytest and what they require, nothing else of this environment:
    what an image with CUDA torch and pytest holds (``python -S`` then sees no other package)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    site = where / "site"
    site.mkdir()
    todo, seen = ["torch", "pytest"], set()
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # (a requirement of another platform or Python)
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    return site


_TWO = """
import os, torch, ddpkit
rt = ddpkit.init(seed=0)
net = torch.nn.Linear(4, 2)
data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
model, opt = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
for x, y in rt.loader(data, global_batch_size=8):
    rt.backward(torch.nn.functional.cross_entropy(model(x), y))
    rt.step(opt)
count = ddpkit.evaluate(model, data, num_classes=2)["count"]
os.write(1, f"rank {rt.rank} evaluated {count}\\n".encode())  # one write: the ranks share the pipe
"""


@pytest.mark.slow  # 13 s: make test-slow (CI runs it)
@pytest.mark.timeout(300)
def test_the_gpu_check_runs_on_an_image_with_torch_and_pytest_alone(tmp_path):
    """``make gpu-check`` installs nothing. In a virtual environment of torch and pytest alone (no numpy,
    psutil, tqdm, scikit-learn; its children too): ddpkit imports, a 2-process job trains and evaluates
    (objects travel between ranks without numpy), a bench row runs, and the gpu tests collect. The
    files it hands pytest are every file that holds a gpu test; a part that runs past its limit keeps
    what it printed."""
    import venv

    root = Path(__file__).resolve().parent.parent
    check = _gpu_check()
    gpu_mark = re.compile(r"^@pytest\.mark\.gpu\b|^pytestmark\b[^\n]*(\n +[^\n]*)*pytest\.mark\.gpu\b", re.M)
    marked = sorted(f"tests/{p.name}" for p in (root / "tests").glob("test_*.py") if gpu_mark.search(p.read_text()))
    assert sorted(check.GPU_TESTS) == marked
    site = _bare_site(tmp_path)
    venv.create(tmp_path / "env", with_pip=False, system_site_packages=False)
    (next((tmp_path / "env" / "lib").glob("python3*/site-packages")) / "bare.pth").write_text(f"{site}\n")
    bare = str(tmp_path / "env" / "bin" / "python")
    env = {**clean_env(), "PYTHONPATH": str(root / "src"), "PYTHONWARNINGS": "ignore", "PYTHONNOUSERSITE": "1"}

    def runs(*command: str, timeout: float = 120) -> str:
        done = subprocess.run([bare, *command], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done.stdout

    probe = (
        "import importlib.util as u, ddpkit; print(u.find_spec('numpy'), u.find_spec('psutil'), u.find_spec('tqdm'))"
    )
    assert runs("-c", probe) == "None None None\n"
    (tmp_path / "two.py").write_text(_TWO)
    assert sorted(runs("-m", "ddpkit", "run", "-n", "2", "two.py").splitlines()) == [
        "rank 0 evaluated 32",
        "rank 1 evaluated 32",
    ]
    bench = "--model convnet --data synthetic --nproc 1 --steps 3 --warmup 1 --modes ddp --batch-size 8"
    runs("-m", "ddpkit", "bench", *bench.split(), "--out-dir", str(tmp_path / "bench"))
    assert json.loads((tmp_path / "bench" / "bench.json").read_text())
    collect = ["-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--rootdir", str(root)]
    env["PYTHONPATH"] += os.pathsep + str(root / "tests")
    listed = runs(*collect, *(str(root / name) for name in check.GPU_TESTS))
    assert "error" not in listed.lower() and listed.count("test_gpu.py::") >= 5, listed[-3000:]
    report: list[str] = []
    slow = [sys.executable, "-I", "-S", "-c", "import time; print('reached the slow part', flush=True); time.sleep(60)"]
    assert check._run("A part", slow, 8, tmp_path, report) is False  # 8 s: a bare start on a busy machine
    assert "reached the slow part" in (tmp_path / "a-part.log").read_text() and "(stopped after 8 s)" in report[4]
    assert report[0].startswith("### A part: FAILED (exit 124)")


def test_every_exchange_the_bench_takes_reaches_its_loops():
    """``ddpkit bench --sync-dtype`` is handed on to the loop that trains (its own parser): each value
    the bench accepts, the loop accepts too (int8 once reached the loop and stopped it)."""
    from ddpkit.bench.flags import parse_settings
    from ddpkit.bench.workload import worker_parser
    from ddpkit.parallel.periodic_parts import EXCHANGES

    required = ["--model", "tiny-lm", "--data", "synthetic", "--precision", "fp32", "--batch", "2", "--steps", "1"]
    for exchange in EXCHANGES:
        settings = parse_settings(["--sync", "diloco", "--sync-every", "4", "--sync-dtype", exchange])
        assert settings.sync_dtype == exchange
        loop = worker_parser("loop").parse_args(
            [*required, "--warmup", "0", "--result", "r.json", "--sync-dtype", exchange]
        )
        assert loop.sync_dtype == exchange
