"""`ddpkit train` and `ddpkit demo` end to end in subprocesses, and their bad input."""

from __future__ import annotations

import io
import json
import os
import re
import sys

import pytest
import torch

import ddpkit
from ddpkit import cli
from ddpkit.cli.train import train_config
from ddpkit.errors import UsageError
from ddpkit.recipes import train as train_recipe
from ddpkit.recipes.config import TrainConfig
from ddpkit.recipes.models import build_model
from helpers import ddpkit as ddpkit_cli

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "run"
    result = ddpkit_cli(
        "train",
        "--model",
        "convnet",
        "--data",
        "digits",
        "--nproc",
        "2",
        "--epochs",
        "3",
        "--out",
        str(out),
        timeout=140,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_train_writes_every_output(trained):
    out, result = trained
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["precision"] == "fp32" and summary["epochs"] == 3
    assert summary["global_batch_size"] == 64 and summary["test_count"] == 360
    assert summary["test_accuracy"] >= 0.95
    assert summary["wall_seconds"] > 0 and summary["samples_per_second"] > 0
    assert summary["final_checkpoint"].endswith("ckpt-step00000069.pt")  # 1437 samples / 64 = 23 steps x 3
    assert summary["sync_bn"] is True  # the default where DDP trains a model with BatchNorm
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    assert rows[-1]["test_accuracy"] == summary["test_accuracy"]
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[:2] == ["step", "epoch"] and "test_loss" in header
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(out / "tensorboard"))
    assert (out / "loss.png").read_bytes()[:8] == PNG
    assert result.stdout.count("epoch 2: train_loss=") == 1  # printed on rank 0 only


@pytest.mark.slow  # 7 s: make test resumes scripts of its own (test_restarts, test_checkpoint)
def test_resume_auto_continues_a_finished_run(trained, tmp_path):
    out, _ = trained
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(out, copy)
    result = ddpkit_cli("train", "--nproc", "1", "--epochs", "4", "--out", str(copy), "--resume", "auto", timeout=140)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"ddpkit: resumed from {copy / 'checkpoints' / 'ckpt-step00000069.pt'}: step 69," in result.stderr
    summary = json.loads((copy / "summary.json").read_text())
    assert summary["steps"] == 92 and summary["world_size"] == 1
    rows = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3]


@pytest.mark.slow  # 17 s: make test-slow; make test resumes mid-epoch in test_loop_state's real loop
@pytest.mark.timeout(200)
def test_an_epoch_resumed_mid_way_counts_its_train_loss_over_every_step(tmp_path):
    """A checkpoint mid-epoch keeps the epoch's loss so far, summed over the ranks: resumed from step
    20 of 23 on 2 processes, the epoch's train_loss is the uninterrupted run's, not its last 3 steps'."""
    whole = tmp_path / "whole"
    common = ("--nproc", "2", "--epochs", "1", "--global-batch-size", "64", "--trackers", "tensorboard")
    done = ddpkit_cli("train", *common, "--checkpoint-every", "10", "--out-dir", str(whole), timeout=140)
    assert done.returncode == 0, done.stderr[-3000:]
    mid = whole / "checkpoints" / "ckpt-step00000020.pt"
    resumed = tmp_path / "resumed"
    done = ddpkit_cli("train", *common, "--resume", str(mid), "--out-dir", str(resumed), timeout=140)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ddpkit: resumed from {mid}: step 20, inside epoch 0" in done.stderr
    first, second = (json.loads((run / "metrics.jsonl").read_text().splitlines()[-1]) for run in (whole, resumed))
    assert second["train_loss"] == pytest.approx(first["train_loss"], rel=1e-12) and first["train_loss"] > 0.3
    assert second["test_accuracy"] == first["test_accuracy"]


def test_a_checkpoint_from_before_the_epoch_loss_was_kept_still_resumes(tmp_path):
    """Checkpoints of ddpkit train written before it kept ``epoch_loss`` resume without it."""
    path = tmp_path / "older.pt"
    rt = ddpkit.init(seed=0)
    model = build_model("convnet", num_classes=10, in_channels=1, image_size=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rt.save(path, {"model": model, "optimizer": optimizer, "recipe": {"model": "convnet"}})
    rt.close()
    rt = ddpkit.init(seed=1, resume=str(path))
    try:
        fresh = build_model("convnet", num_classes=10, in_channels=1, image_size=8)
        epoch_loss = train_recipe.EpochLoss(rt)
        state = {"model": fresh, "optimizer": torch.optim.SGD(fresh.parameters(), lr=0.1), "recipe": {}}
        state["epoch_loss"] = epoch_loss
        assert train_recipe._resume(rt, state, TrainConfig()) == path
        assert state["recipe"] == {"model": "convnet"} and state["epoch_loss"] is epoch_loss
        assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
        assert (epoch_loss.epoch, epoch_loss.total) == (-1, 0.0)
    finally:
        rt.close()
    # a fault-tolerant replica resumes later, in its first quorum: it reads which checkpoint it would take
    older = train_recipe._written_before_epoch_loss
    for run, kept in (("legacy", {}), ("newer", {"epoch_loss": epoch_loss})):
        rt = ddpkit.init(seed=0, checkpoint_dir=str(tmp_path / run / "checkpoints"))
        try:
            rt.checkpoint({"model": model, "optimizer": optimizer, "recipe": {}, **kept})
        finally:
            rt.close()
    assert older(TrainConfig(resume=str(path))) and not older(TrainConfig())
    assert older(TrainConfig(resume="auto", out_dir=str(tmp_path / "legacy")))
    assert older(TrainConfig(resume=str(tmp_path / "legacy" / "checkpoints")))
    assert not older(TrainConfig(resume="auto", out_dir=str(tmp_path / "newer")))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_train_with_powersgd_reaches_95_percent_and_records_it(tmp_path):
    out = tmp_path / "run"
    result = ddpkit_cli(
        "train",
        "--model",
        "convnet",
        "--data",
        "digits",
        "--nproc",
        "2",
        "--epochs",
        "3",
        "--grad-compression",
        "powersgd",
        "--out",
        str(out),
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["grad_compression"] == "powersgd" and summary["powersgd_rank"] == 2
    assert summary["test_accuracy"] >= 0.95


def _another_model_checkpoint(path):
    rt = ddpkit.init()
    model = build_model("mlp", num_classes=10, in_channels=1, image_size=8)
    rt.save(path, {"model": model, "optimizer": __import__("torch").optim.SGD(model.parameters(), lr=0.1)})
    rt.close()
    return path


BAD = [
    (["--model", "transformer"], "unknown model 'transformer'"),
    (["--data", "imagenet"], "unknown data 'imagenet'"),
    (["--data", "mnist"], "--data mnist needs --data-dir"),
    (["--data", "cifar10", "--data-dir", "/nonexistent/dir"], "is not a directory"),
    (["--nproc", "3", "--global-batch", "64"], "global batch 64 does not divide by --nproc 3"),
    (["--resume", "/nonexistent/ckpt.pt"], "--resume /nonexistent/ckpt.pt does not exist"),
    (["--precision", "fp8"], "unknown precision 'fp8'"),
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--nnodes", "0"], "--nnodes must be at least 1"),
    (["--batch", "8", "--global-batch", "16"], "not both"),
    (["--lr", "abc"], "invalid float value"),
    (["--config", "/nonexistent.yaml"], "config file /nonexistent.yaml not found"),
    (["--grad-compression", "int8"], "unknown grad_compression 'int8'; choose none, fp16, bf16, powersgd"),
    (["--grad-compression", "powersgd", "--precision", "fp16"], "use precision='bf16'"),
    (["--model", "tiny-lm"], "ddpkit bench's language-model workload"),
    (["--sync", "diloco", "--sync-every", "0"], "--sync-every H is a whole number of optimizer steps of at least 1"),
    (["--min-replicas", "2"], "--min-replicas is for fault-tolerant jobs: add --fault-tolerant"),
    (
        ["--fault-tolerant", "--nproc", "2", "--min-replicas", "3"],
        "--min-replicas 3 must be between 1 and the job's replicas (2)",
    ),
]


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"sync_every": 5}, "--sync-every sets how often --sync local-sgd or diloco meets"),
        ({"sync": "diloco", "sync_every": 5, "sync_batchnorm": True}, "drop --sync-batchnorm"),
        ({"sync": "local-sgd", "sync_every": 5, "strategy": "fsdp", "model": "mlp"}, "strategy='fsdp' shards"),
        (
            {"sync": "diloco", "sync_every": 5, "grad_compression": "powersgd"},
            "compresses a per-step gradient exchange",
        ),
        ({"sync": "diloco", "sync_every": 5, "precision": "fp16"}, "use bf16 or fp32"),
        ({"sync": "rarely", "sync_every": 5}, "unknown sync 'rarely'"),
    ],
    ids=["every-alone", "sync-bn", "fsdp", "compression", "fp16", "unknown"],
)
def test_infrequent_sync_flags_are_checked_before_anything_runs(settings, message):
    from ddpkit.recipes.config import check

    with pytest.raises(UsageError, match=message):
        check(TrainConfig(**settings))


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"fault_tolerant": True, "strategy": "fsdp", "model": "mlp"},
            "--fault-tolerant does not take --strategy fsdp",
        ),
        ({"fault_tolerant": True, "grad_compression": "powersgd"}, "use bf16 or fp16, or leave it out"),
        ({"fault_tolerant": True, "data_parallel": True}, "one process per replica"),
        ({"quorum_timeout": 5.0}, "--quorum-timeout is for fault-tolerant jobs"),
        ({"secret_file": "key"}, "--secret-file is for fault-tolerant jobs"),
    ],
    ids=["fsdp", "powersgd", "data-parallel", "quorum-timeout-alone", "secret-alone"],
)
def test_fault_tolerant_flags_are_checked_before_anything_runs(settings, message):
    from ddpkit.recipes.config import check

    with pytest.raises(UsageError, match=message) as caught:
        check(TrainConfig(**settings))
    assert "\n" not in str(caught.value)


def test_a_fault_tolerant_train_is_the_recipe_under_ddpkit_run_fault_tolerant(monkeypatch):
    """``ddpkit train --fault-tolerant`` hands the recipe to the same launcher as ``ddpkit run
    --fault-tolerant``, with its flags; a quorum timeout of no seconds is one line."""
    from ddpkit.cli import train as train_cli

    config = train_config(
        ["--fault-tolerant", "--nproc", "3", "--min-replicas", "2", "--max-restarts", "2", "--quorum-timeout", "30"]
    )
    spec = train_cli.fault_tolerant(config)
    assert (spec.target, spec.module, spec.target_args[0]) == ("ddpkit.recipes.train", True, "--config-json")
    assert TrainConfig.from_json(spec.target_args[1]) == config
    assert (spec.replicas, spec.min_replicas, spec.max_restarts, spec.quorum_timeout_s) == (3, 2, 2, 30.0)
    with pytest.raises(UsageError, match="--quorum-timeout must be a number of seconds above 0, got 0.0"):
        train_cli.fault_tolerant(train_config(["--fault-tolerant", "--quorum-timeout", "0"]))


@pytest.mark.slow  # 11 s: make test-slow; tests/test_periodic.py trains DiLoCo through rt.setup in make test
@pytest.mark.timeout(120)
@pytest.mark.parametrize("every", ["5", None])
def test_train_with_diloco_records_it_and_learns(tmp_path, every):
    out = tmp_path / "run"
    result = ddpkit_cli(
        "train",
        "--nproc",
        "2",
        "--epochs",
        "2",
        "--sync",
        "diloco",
        *(["--sync-every", every] if every else []),
        "--out",
        str(out),
        timeout=110,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the result depends on the number of processes" in result.stderr
    summary = json.loads((out / "summary.json").read_text())
    decision = summary["sync_decision"]
    chosen = decision["every"] if every is None else 5
    # DiLoCo's outer step with the period given; an average at the short period a link chooses
    outer = (0.7, 0.9) if every else (1.0, 0.0)
    assert (summary["sync"], summary["sync_every"], summary["outer_lr"], summary["outer_momentum"]) == (
        "diloco",
        chosen,
        *outer,
    )
    assert summary["sync_bn"] is False
    assert (decision is None) == (every is not None)
    assert result.stderr.count("sync='diloco' chose sync_every=") == (every is None)  # said once, when chosen
    assert summary["test_accuracy"] >= 0.8  # it learns (chance: 0.1); how well, BENCHMARKS.md


@pytest.mark.parametrize("args, message", BAD)
def test_bad_train_input_is_one_clear_line(tmp_path, capsys, args, message):
    """In this process (``cli.main``): the command, whole, is the first case's test below."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    code = cli.main(["train", "--out", str(out), "--overwrite", *args])
    stderr = capsys.readouterr().err
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], stderr
    assert "Traceback" not in stderr
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"


def test_bad_train_input_is_one_clear_line_from_the_command(tmp_path):
    """The command in a process of its own: nothing else reaches stderr (an import's warning)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    args, message = BAD[0]
    result = ddpkit_cli("train", "--out", str(out), "--overwrite", *args, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"


def test_checkpoint_of_another_model_is_refused_before_anything_runs(tmp_path):
    ckpt = _another_model_checkpoint(tmp_path / "mlp.pt")
    out = tmp_path / "out"
    result = ddpkit_cli("train", "--model", "convnet", "--resume", str(ckpt), "--out", str(out), timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is for another model" in lines[0] and "layer1.0.weight" in lines[0]
    assert not out.exists()


def test_an_out_holding_a_run_is_not_overwritten(trained):
    out, _ = trained
    before = (out / "summary.json").read_bytes()
    result = ddpkit_cli("train", "--out", str(out), timeout=60)
    assert result.returncode == 2 and "already holds a run" in result.stderr
    assert (out / "summary.json").read_bytes() == before


@pytest.mark.slow  # 7 s: make test-slow; make test keeps the refusal to write over a run
def test_overwrite_replaces_the_old_run_and_keeps_other_files(trained, tmp_path):
    import shutil

    out, _ = trained
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / "notes.txt").write_text("mine")
    old_steps = sorted(p.name for p in (copy / "checkpoints").glob("*.pt"))
    assert old_steps[-1] == "ckpt-step00000069.pt"
    result = ddpkit_cli(
        "train", "--nproc", "1", "--model", "mlp", "--epochs", "1", "--out", str(copy), "--overwrite", timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--overwrite removed" in result.stdout
    steps = sorted(p.name for p in (copy / "checkpoints").glob("*.pt"))
    assert steps == ["ckpt-step00000023.pt"]  # the old run's step 69 cannot outrank it
    rows = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0]
    assert json.loads((copy / "summary.json").read_text())["model"] == "mlp"
    assert (copy / "notes.txt").read_text() == "mine"


def test_config_files_and_flag_precedence(tmp_path):
    (tmp_path / "c.yaml").write_text("model: mlp\nepochs: 7\nglobal-batch: 32\nsync_bn: true\n")
    (tmp_path / "c.toml").write_text('model = "mlp"\nepochs = 2\nlr = 0.2\n')
    out = str(tmp_path / "o")
    config = train_config(["--config", str(tmp_path / "c.yaml"), "--epochs", "3", "--out", out])
    assert (config.model, config.epochs, config.samples_per_step, config.sync_batchnorm) == ("mlp", 3, 32, True)
    config = train_config(["--config", str(tmp_path / "c.toml"), "--out", out])
    assert (config.model, config.epochs, config.lr) == ("mlp", 2, 0.2)
    (tmp_path / "bad.yaml").write_text("modle: mlp\n")
    with pytest.raises(UsageError, match="unknown setting\\(s\\) modle"):
        train_config(["--config", str(tmp_path / "bad.yaml"), "--out", out])
    (tmp_path / "broken.toml").write_text("model = \n")
    with pytest.raises(UsageError, match="cannot be parsed"):
        train_config(["--config", str(tmp_path / "broken.toml"), "--out", out])


def test_sync_bn_is_on_by_default_only_where_ddp_trains_batchnorm_on_several_processes():
    from ddpkit.recipes.models import build_model
    from ddpkit.recipes.train import sync_bn_default

    convnet = build_model("convnet", num_classes=10, in_channels=1, image_size=8)
    mlp = build_model("mlp", num_classes=10, in_channels=1, image_size=8)
    assert sync_bn_default(TrainConfig(), convnet, world_size=2) is True
    assert sync_bn_default(TrainConfig(), convnet, world_size=1) is False
    assert sync_bn_default(TrainConfig(), mlp, world_size=2) is False
    assert sync_bn_default(TrainConfig(strategy="fsdp"), convnet, world_size=2) is False
    assert sync_bn_default(TrainConfig(data_parallel=True), convnet, world_size=2) is False


def test_scale_lr_and_per_process_batch(tmp_path):
    config = train_config(["--batch", "16", "--nproc", "2", "--scale-lr", "--lr", "0.05", "--out", str(tmp_path / "o")])
    assert config.samples_per_step == 32 and config.effective_lr == pytest.approx(0.1)


def test_the_worker_counts_the_nodes_the_job_runs_on(monkeypatch):
    """Under srun the nodes are SLURM's, not --nnodes: a per-process batch and --scale-lr count them."""
    from types import SimpleNamespace

    config = train_config(["--batch", "16", "--nproc", "2", "--scale-lr", "--lr", "0.05"])

    def on(world: int, replica: int | None = None, replicas: int = 1) -> SimpleNamespace:  # what placed() reads of rt
        return SimpleNamespace(
            world_size=world, replica=replica, _run=SimpleNamespace(world=SimpleNamespace(replicas=replicas))
        )

    four_nodes = train_recipe.placed(config, on(8))
    assert (four_nodes.nnodes, four_nodes.samples_per_step, four_nodes.effective_lr) == (4, 128, pytest.approx(0.4))
    assert train_recipe.placed(config, on(2)) is config and train_recipe.placed(config, on(1)) is config
    replicas = train_recipe.placed(config, on(1, replica=0, replicas=6))  # 3 nodes of 2 fault-tolerant replicas
    assert (replicas.nnodes, replicas.samples_per_step) == (3, 96)


@pytest.mark.slow  # 61 s: make test-slow (CI runs it)
@pytest.mark.timeout(400)
def test_demo_compares_modes_and_reaches_95_percent(tmp_path):
    out = tmp_path / "demo"
    result = ddpkit_cli("demo", "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| mode" in result.stdout and "speed-up vs single" in result.stdout
    report = json.loads((out / "report.json").read_text())
    rows = report["rows"] if isinstance(report, dict) else report
    assert [(r["mode"], r["processes"], r["precision"]) for r in rows][:1] == [("single", 1, "fp32")]
    assert {(r["mode"], r["processes"], r["precision"]) for r in rows} >= {("ddp", 2, "fp32"), ("ddp", 2, "bf16")}
    for row in rows:
        assert row["test_accuracy"] >= 0.95, row
        assert row["speedup"] == pytest.approx(row["samples_per_second"] / rows[0]["samples_per_second"])
    assert "| single" in (out / "report.md").read_text()
    assert (out / "scaling.png").read_bytes()[:8] == PNG and (out / "loss.png").read_bytes()[:8] == PNG
    _check_diagnoses(rows, out, result.stdout)
    _check_guarantee(rows, out, result.stdout)


def _check_guarantee(rows, out, stdout):
    """The opening line leads the printout and report.md; each row's distance from one process is in
    report.json; DDP x2 fp32 (--micro-shards 2) at the single process's bits, the hand-written loop far away."""
    guarantee = json.loads((out / "guarantee.json").read_text())
    opening = guarantee["opening"]
    assert opening.startswith("DDP x2 ends ") and "hand-written DDP with DistributedSampler" in opening
    assert f"\n\n{opening}\n\n" in stdout and stdout.index(opening) < stdout.index("| mode")  # before the table
    assert (out / "report.md").read_text().split("\n\n")[1] == opening
    ddp = next(r for r in rows if r["mode"] == "ddp" and r["precision"] == "fp32")
    exact = rows[1]  # rows[0]: one process on every core, the speed to beat
    assert rows[0]["micro_shards"] is None and exact["mode"] == "single" and exact["run"] == "single-x1-fp32-ms2"
    assert rows[0]["max_rel_diff_vs_single"] == exact["max_rel_diff_vs_single"] == 0.0
    assert ddp["micro_shards"] == 2 == exact["micro_shards"]
    assert "The same bits on 1 and 2 processes cost one process here: with --micro-shards 2" in stdout
    assert guarantee["max_rel_diff_vs_single"][ddp["run"]] == ddp["max_rel_diff_vs_single"]
    assert ddp["max_rel_diff_vs_single"] <= 1e-5  # the bound; with micro-shards it is 0
    assert ddp["max_rel_diff_vs_single"] == 0.0 and "bit for bit (max relative difference 0)" in opening
    assert "0 (bitwise) |" in stdout
    assert guarantee["hand_written_max_rel_diff_vs_single"] > 1e-3
    bf16 = next(r for r in rows if r["precision"] == "bf16")
    assert f"bf16's tolerance of {guarantee['bf16_tolerance']:g}" in opening and bf16["max_rel_diff_vs_single"] > 0
    for row in rows:  # each fix a diagnosis recommends is measured, against its prediction
        if row["verify"]:
            assert f"checked {row['run']}: {row['verify']['change']}: predicted " in stdout


def _check_diagnoses(rows, out, stdout):
    """Every row diagnosed (printed too), bf16 named where this CPU lacks it, a verdict naming DDP's bound."""
    from ddpkit.bench.diagnose import cpu_flags

    for row in rows:
        assert row["diagnosis"] and "\n" not in row["diagnosis"], row
        assert f"{row['run']}: {row['diagnosis']}" in stdout
        assert sum(row["shares"].values()) == pytest.approx(1.0) and row["threads_per_process"] >= 1
        assert row["bound"]
    bf16 = next(r for r in rows if r["precision"] == "bf16")
    native = bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert ("bf16 is not accelerated on this CPU" in bf16["diagnosis"]) is (
        not native and not torch.cuda.is_available()
    )
    ddp = next(r for r in rows if r["mode"] == "ddp" and r["precision"] == "fp32")
    bound = ddp["diagnosis"].split(";")[0].removeprefix("bound by ").split(" (")[0]
    markdown = (out / "report.md").read_text()
    verdict = markdown.split("## Verdict", 1)[1]
    assert f"DDP x2 runs at {ddp['speedup']:.2f}x" in verdict and f"bound by {bound}" in verdict
    assert verdict.strip() in stdout
    assert "## Diagnosis" in markdown and bf16["diagnosis"] in markdown


def test_demo_adds_data_parallel_only_with_two_gpus():
    from ddpkit.cli.demo import modes

    assert [m for m, _ in modes(2, gpus=0)] == ["single", "single", "ddp", "ddp"]
    with_gpus = modes(4, gpus=2)
    assert [m for m, _ in with_gpus] == ["single", "single", "dp", "ddp", "ddp"]
    assert with_gpus[2][1] == {"nproc": 1, "precision": "fp32", "data_parallel": True}
    assert [o["precision"] for _, o in with_gpus[3:]] == ["fp32", "bf16"]
    # every core first; then the micro-sharded single process and DDP rows, the same bits on 1 and 4
    assert [o.get("micro_shards") for _, o in with_gpus] == [None, 4, None, 4, 4]
    assert [o.get("micro_shards") for _, o in modes(3, gpus=0)] == [None, None, None]  # 3: not a power of two


def test_data_parallel_needs_two_gpus(tmp_path):
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has two GPUs: the refusal cannot happen here")
    with pytest.raises(UsageError, match="at least 2 visible GPUs"):
        from ddpkit.recipes.config import TrainConfig, validate

        validate(TrainConfig(data_parallel=True, out_dir=str(tmp_path / "o")))


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_shows_loss_and_samples_per_second_on_a_terminal(monkeypatch, tmp_path):
    terminal = _Tty()
    monkeypatch.setattr(sys, "stderr", terminal)
    config = train_config(["--model", "mlp", "--epochs", "1", "--out", str(tmp_path / "run")])
    summary = train_recipe.train(config)
    bar = terminal.getvalue()
    steps = summary["steps"]
    assert f"{steps}/{steps}" in bar and "loss=" in bar
    rates = [float(r) for r in re.findall(r"samples/s=(\d+)", bar)]
    assert rates and all(rate > 0 for rate in rates)


def test_bound_words_and_precision_notes():
    from ddpkit.bench.diagnose import bound_word, precision_note

    assert precision_note("bf16", "cpu", flags={"avx2"}).startswith("bf16 is not accelerated on this CPU")
    assert precision_note("bf16", "cpu", flags={"avx2", "amx_bf16"}) is None
    assert precision_note("fp16", "cpu", flags=set()).startswith("fp16 is not accelerated on a CPU")
    assert precision_note("fp32", "cpu", flags=set()) is None
    assert bound_word("bound by the link (...)") == "link-bound"
    assert bound_word("bound by waiting for the slowest rank or a busy core (...)") == "wait-bound"
    assert bound_word("bound by per-call latency (...)") == "latency-bound"
    assert bound_word("bound by compute (...)") == "compute-bound"
    assert bound_word(precision_note("bf16", "cpu", flags=set()) + "; bound by compute") == "bf16 not accelerated"


def test_the_verdict_names_the_bound_of_the_ddp_row():
    from ddpkit.cli.demo_verdict import verdict

    rows = [
        {"mode": "single", "processes": 1, "precision": "fp32", "speedup": 1.0, "diagnosis": "bound by compute"},
        {
            "mode": "ddp",
            "processes": 2,
            "precision": "fp32",
            "speedup": 0.63,
            "cores": 2,
            "threads_per_process": 1,
            "shares": {"compute": 0.6, "communication": 0.4},
            "diagnosis": "bound by waiting for the slowest rank or a busy core (3.10 ms ...); what helps: ...",
        },
    ]
    said = verdict(rows, {"what": "ResNet-18, DDP x2 fp32 against one process", "speedup": 0.68})
    assert said.startswith("On this machine (2 cores, 2 processes of 1 thread(s) each), DDP x2 runs at 0.63x")
    assert "bound by waiting for the slowest rank or a busy core (a step is compute 60%, communication 40%)" in said
    assert (
        "The closest to a speed-up measured here is ResNet-18, DDP x2 fp32 against one process: 0.68x, "
        "32% short of one process's samples/s."
    ) in said
    assert "closest" not in verdict(rows)
    faster = verdict(rows, {"what": "ResNet-18, DDP x2 fp32 against one process", "speedup": 1.04})
    assert (
        "A speed-up does show here with more compute per step: ResNet-18, DDP x2 fp32 against one process, "
        "1.04x (4% more samples/s than one process)."
    ) in faster
    assert "short of" not in faster


def test_overwrite_removes_only_what_a_run_writes(tmp_path):
    """A checkpoints/ or tensorboard/ of the user's own keeps its files: --overwrite once removed
    those directories whole (a model.pth of the user's beside the run's step checkpoints)."""
    from ddpkit.recipes.config import TrainConfig
    from ddpkit.recipes.train import clear_previous_run

    out = tmp_path / "run"
    (out / "checkpoints" / "ckpt-step00000004").mkdir(parents=True)  # a sharded step directory
    (out / "tensorboard").mkdir()
    run_files = [
        "checkpoints/ckpt-step00000002.pt",
        "checkpoints/ckpt-step00000002.pt.sha256",
        "checkpoints/.ckpt-step00000003.pt.tmp-4242",
        "checkpoints/ckpt-step00000004/manifest.json",
        "tensorboard/events.out.tfevents.1.host.1.0",
        "summary.json",
        "metrics.jsonl",
    ]
    own_files = ["checkpoints/mine.pth", "checkpoints/ckpt-step2-best.pt", "tensorboard/notes.txt", "notes.txt"]
    for name in run_files + own_files:
        (out / name).write_text(name)
    other = tmp_path / "other-run" / "ckpt-step00000050"
    other.mkdir(parents=True)
    (other / "manifest.json").write_text("theirs")
    (out / "checkpoints" / "ckpt-step00000050").symlink_to(other)  # a link to another run's step: the link goes
    removed = clear_previous_run(TrainConfig(out_dir=str(out), overwrite=True))
    assert not (out / "checkpoints" / "ckpt-step00000050").is_symlink()
    assert (other / "manifest.json").read_text() == "theirs"
    assert sorted(p.name for p in removed) == ["checkpoints", "metrics.jsonl", "summary.json", "tensorboard"]
    for name in own_files:
        assert (out / name).read_text() == name
    assert not any((out / name).exists() for name in run_files)
    assert not (out / "checkpoints" / "ckpt-step00000004").exists()
    (out / "tensorboard" / "notes.txt").unlink()
    (out / "tensorboard" / "events.out.tfevents.2.host.1.0").write_text("x")
    clear_previous_run(TrainConfig(out_dir=str(out), overwrite=True))
    assert not (out / "tensorboard").exists()  # emptied of the run's files: gone, as before
    assert clear_previous_run(TrainConfig(out_dir=str(out), overwrite=False)) == []
