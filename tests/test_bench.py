"""`ddpkit bench`: the structure and internal consistency of bench.json, never a wall-clock figure.

One tiny end-to-end run (mlp, batch 8, 2 + 4 steps, single + dp + ddp x2 without and with
PowerSGD, and one raw/ddpkit pair) feeds the structural checks; runs on simulated
hosts over a shaped link are slow tests; the diagnosis and statistics are also tested
on hand-made measurements, and bad input in-process through the CLI entry point.
"""

from __future__ import annotations

import json
import os
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
from ddpkit.bench.plan import Configuration, Settings, plan
from ddpkit.bench.stopwatch import PHASES
from ddpkit.bench.summary import summarize
from ddpkit.recipes.models import build_model
from helpers import clean_env, kill_tree
from helpers import ddpkit as ddpkit_cli

PNG = b"\x89PNG\r\n\x1a\n"
ROW_KEYS = {"mode", "nproc", "precision", "samples_per_second", "speedup", "efficiency", "peak_rss_mb",
            "breakdown", "diagnosis"}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out"
    result = ddpkit_cli("bench", "--model", "mlp", "--data", "synthetic", "--modes", "single,dp,ddp",
                        "--nproc", "2", "--batch", "8", "--steps", "4", "--warmup", "2",
                        "--grad-compression", "none,powersgd",
                        "--compare-raw", "--repeats", "1", "--out", str(out), timeout=220)
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
    assert ddp["comm"]["allreduce_seconds"] > 0 and "MB of gradients per step" in ddp["diagnosis"]
    assert 0 <= ddp["comm_overlap"] <= 1 and "hidden behind the backward pass" in ddp["diagnosis"]
    assert single["comm_overlap"] is None
    assert single["comm"] is None
    assert ddp["grad_compression"] == "none" and ddp["payload_bytes_per_step"] == ddp["comm"]["grad_bytes_per_step"]
    assert ddp["bytes_sent_per_step"] == ddp["payload_bytes_per_step"]              # a ring of 2 sends it once
    assert sgd["grad_compression"] == "powersgd" and sgd["hosts"] is None and sgd["link_mbit"] is None
    assert 0 < sgd["payload_bytes_per_step"] * 10 < ddp["payload_bytes_per_step"]    # timed steps compress
    assert sgd["weights_sha256"] != ddp["weights_sha256"]
    if torch.cuda.device_count() < 2:
        assert rows["dp"]["applicable"] is False and rows["dp"]["samples_per_second"] is None
        assert "2 or more visible GPUs" in rows["dp"]["diagnosis"]
    markdown = (out / "bench.md").read_text()
    assert "| mode" in markdown and "## Diagnosis" in markdown and "## ddpkit vs hand-written" in markdown
    assert (out / "scaling.png").read_bytes()[:8] == PNG
    progress = [line for line in stdout.splitlines() if line.startswith("bench: ")]
    assert sum("samples/s" in line for line in progress) == 3 + 2   # three rows, one raw/ddpkit pair
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
    assert all(0 <= raw["comm_overlap"][loop] <= 1 for loop in ("raw", "ddpkit"))    # both loops measured


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


def test_comm_overlap_is_the_allreduce_the_backward_hid():
    # backward 0.7 s in the step, 0.4 s alone: 0.3 s of a 0.5 s allreduce left exposed, 0.2 s hidden
    phases = [[[0, 0.2, 0.7, 0.1]]] * 2
    result = _result([[1.0], [1.0]], phases, 0.5)
    for rank in result["ranks"]:
        rank["backward_alone_seconds"] = 0.4
    row = summarize(Configuration("ddp", 2, "fp32"), result)
    assert row["comm"]["exposed_seconds"] == pytest.approx(0.3)
    assert row["comm_overlap"] == pytest.approx(0.2 / 0.5)
    assert row["comm"]["overlap_of_possible"] == pytest.approx(0.2 / 0.4)
    assert "40% of it hidden behind the backward pass" in diagnose(row)
    assert "hid only" not in diagnose(row)
    for rank in result["ranks"]:             # backward alone 0.1 s: 0.6 exposed, nothing hidden
        rank["backward_alone_seconds"] = 0.1
    lost = summarize(Configuration("ddp", 2, "fp32"), result)
    assert lost["comm_overlap"] == 0.0 and lost["comm"]["overlap_of_possible"] == 0.0
    assert "the allreduce hid only 0% of what the backward pass could cover" in diagnose(lost)
    # 2 processes x 1 thread fill the 2 cores: the transfers compete with compute, whatever the layout
    assert "compete with the backward pass for cores that 2 process(es) x 1 thread(s) already fill" in diagnose(lost)
    assert "first-layers-first" not in diagnose(lost)
    spare = {**lost, "cores": 4}               # a core to spare: a low overlap points at the layout
    assert "(gradient buckets reduced first-layers-first wait for the whole backward)" in diagnose(spare)
    assert "compete" not in diagnose(spare)
    unmeasured = summarize(Configuration("ddp", 2, "fp32"), _result([[1.0], [1.0]], phases, 0.5))
    assert unmeasured["comm_overlap"] is None and "hidden behind" not in diagnose(unmeasured)
    for rank in result["ranks"]:             # compressed: exposed time includes the compressor's work
        rank["payload_bytes_per_step"] = 100_000
    compressed = summarize(Configuration("ddp", 2, "fp32", grad_compression="powersgd"), result)
    assert compressed["comm"]["exposed_seconds"] == pytest.approx(0.6)
    assert compressed["comm_overlap"] is None and compressed["comm"]["overlap_of_possible"] is None
    assert "hidden behind" not in diagnose(compressed)


def test_diagnosis_of_a_slow_link_names_the_fixes_with_their_gain():
    comm = summarize(Configuration("ddp", 2, "fp32"), _result([[1.0], [1.0]], [[[0, 0.2, 0.7, 0.1]]] * 2, 0.5))
    alone = diagnose(comm)
    # step 1.0 s = 0.5 compute + 0.5 allreduce: fp16 leaves 0.75 s, a 2x batch 2 samples per 1.5 s
    assert "grad_compression='fp16' halves the bytes: expect ~171 samples/s" in alone
    assert "a 2x per-process batch or accumulating 2 micro-batches: expect ~171 samples/s" in alone
    assert "measure it with --grad-compression none,powersgd" in alone
    measured = {**comm, "grad_compression": "powersgd", "samples_per_second": 4 * comm["samples_per_second"],
                "payload_bytes_per_step": 100_000.0}
    assert "grad_compression='powersgd' measured 4.0x the samples/s (0.10 MB per step)" in diagnose(comm, [comm, measured])


def test_plan_crosses_hosts_processes_and_compressions():
    settings = Settings(modes=("single", "ddp", "ddp-amp"), nproc=(1,), hosts=(1, 2),
                        grad_compression=("none", "powersgd"), link_mbit=100.0)
    on_gpus = plan(settings, gpus=1)
    assert [c.label for c in on_gpus] == [
        "single x1 fp32", "ddp 1 host(s) x1 fp32", "ddp 1 host(s) x1 fp32 powersgd", "ddp 2 host(s) x1 fp32",
        "ddp 2 host(s) x1 fp32 powersgd", "ddp-amp 1 host(s) x1 fp16", "ddp-amp 1 host(s) x1 fp16 powersgd",
        "ddp-amp 2 host(s) x1 fp16", "ddp-amp 2 host(s) x1 fp16 powersgd"]
    assert on_gpus[3].world_size == 2 and on_gpus[3].name == "ddp-h2-x1-fp32"
    refused = {c.label: c.reason for c in on_gpus if c.reason}
    assert list(refused) == ["ddp 1 host(s) x1 fp32 powersgd", "ddp-amp 1 host(s) x1 fp16 powersgd",
                             "ddp-amp 2 host(s) x1 fp16 powersgd"]
    assert "one process sends nothing" in refused["ddp 1 host(s) x1 fp32 powersgd"]
    assert "use precision='bf16'" in refused["ddp-amp 2 host(s) x1 fp16 powersgd"]


def test_plan_crosses_data_formats_and_a_shards_row_runs(tmp_path):
    settings = Settings(modes=("single", "ddp"), nproc=(2,), data_format=("map", "shards"))
    assert [c.label for c in plan(settings, gpus=0)] == ["single x1 fp32", "single x1 fp32 shards",
                                                         "ddp x2 fp32", "ddp x2 fp32 shards"]
    result = ddpkit_cli("bench", "--model", "mlp", "--modes", "single", "--data-format", "shards",
                        "--batch", "8", "--steps", "3", "--warmup", "1", "--out", str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    row = json.loads((tmp_path / "bench.json").read_text())["configurations"][0]
    assert row["data_format"] == "shards" and row["samples_per_second"] > 0
    assert "| shards |" in (tmp_path / "bench.md").read_text()


@pytest.mark.slow      # 55 s: an 80M-parameter model with AdamW on 2 processes, twice
@pytest.mark.timeout(300)
def test_fsdp_holds_half_the_state_of_ddp_per_rank(tmp_path):
    result = ddpkit_cli("bench", "--model", "mlp-large", "--data", "synthetic", "--modes", "ddp,fsdp",
                        "--nproc", "2", "--optimizer", "adamw", "--batch", "8", "--steps", "4", "--warmup", "1",
                        "--out", str(tmp_path), timeout=280)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {r["mode"]: r for r in json.loads((tmp_path / "bench.json").read_text())["configurations"]}
    ddp, fsdp = rows["ddp"]["state_bytes_per_rank"], rows["fsdp"]["state_bytes_per_rank"]
    assert len(ddp) == len(fsdp) == 2 and max(fsdp) <= 0.6 * min(ddp)
    params = sum(p.numel() for p in build_model("mlp-large", num_classes=10, in_channels=3,
                                                image_size=32).parameters())
    # fp32 AdamW: weights, gradients, 2 moments (ZeRO's 16 bytes), plus AdamW's scalar step counters
    assert 0 <= ddp[0] - 16 * params < 1024


def test_plan_refuses_compression_under_fsdp():
    configs = plan(Settings(model="mlp", modes=("fsdp",), nproc=(2,), grad_compression=("none", "fp16")), gpus=0)
    assert [c.label for c in configs] == ["fsdp x2 fp32", "fsdp x2 fp32 fp16"]
    assert configs[0].reason is None and "DDP hook" in configs[1].reason
    assert "BatchNorm" in plan(Settings(model="convnet", modes=("fsdp",)), gpus=0)[0].reason


def test_plan_runs_dp_only_with_two_gpus():
    settings = Settings(modes=("single", "dp", "ddp", "ddp-amp"), nproc=(1, 2))
    on_cpu = plan(settings, gpus=0)
    assert [c.label for c in on_cpu] == ["single x1 fp32", "dp x1 fp32", "ddp x1 fp32", "ddp x2 fp32",
                                         "ddp-amp x1 bf16", "ddp-amp x2 bf16"]
    assert on_cpu[1].reason is not None and all(c.reason is None for c in on_cpu if c.mode != "dp")
    on_gpus = plan(settings, gpus=2)
    assert on_gpus[1].reason is None and on_gpus[1].devices == 2 and on_gpus[-1].precision == "fp16"


@pytest.mark.parametrize("argv, message", [
    (["--modes", "single,zero"], "unknown mode 'zero'"),
    (["--nproc", "0"], "--nproc values must be at least 1"),
    (["--nproc", "two"], "--nproc takes comma-separated integers"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--batch", "0"], "--batch must be at least 1"),
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
], ids=["mode", "nproc-0", "nproc-text", "steps-0", "batch-0", "model", "raw-no-ddp", "raw-one-process",
        "compression", "hosts-no-link", "link-no-hosts", "link-0", "hosts-0", "hosts-no-ddp", "data-format"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    code = cli.main(["bench", *argv, "--out", str(tmp_path / "out")])
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
    result = ddpkit_cli("bench", "--model", "mlp", "--modes", "ddp", "--hosts", "2", "--nproc", "1",
                        "--link-mbit", "50", "--grad-compression", "none,powersgd", "--batch", "8",
                        "--steps", "3", "--warmup", "2", "--out", str(out), timeout=380)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = json.loads((out / "bench.json").read_text())["configurations"]
    assert [(r["hosts"], r["link_mbit"], r["grad_compression"], r["world_size"]) for r in rows] == \
        [(2, 50.0, "none", 2), (2, 50.0, "powersgd", 2)]
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

    proc = subprocess.Popen([sys.executable, "-m", "ddpkit.cli", "bench", "--model", "resnet18", "--modes", "ddp",
                             "--hosts", "2", "--nproc", "1", "--link-mbit", "5", "--batch", "4", "--steps", "50",
                             "--warmup", "1", "--out", str(tmp_path / "out")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=clean_env())
    try:
        deadline = time.monotonic() + 120
        while not _bench_workers() and time.monotonic() < deadline:    # the hosts are up and training
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
