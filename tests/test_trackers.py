"""W&B (offline), MLflow (local SQLite store) and TensorBoard: one run across crashes, each step once.

Every history is read back through the tracker's own API or files (:mod:`tracker_stores`). The
2-process run SIGKILLed mid-epoch after a checkpoint and resumed by ``--max-restarts`` is
``slow``; the in-process tests drive :class:`ddpkit.observe.trackers.Remote` through the same
calls a save, a crash and a resume make.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import ddpkit
from ddpkit.errors import UsageError
from ddpkit.observe import trackers
from ddpkit.observe.trackers import Remote
from helpers import BIN, ROOT, clean_env
from tracker_stores import mlflow_runs, tensorboard_history, wandb_history, wandb_runs, wandb_runs_settled

TRACKED = str(ROOT / "tests" / "scripts" / "tracked_train.py")


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _rows(steps: range) -> list[dict]:
    return [{"step": s, "loss": 1.0 / s, "acc": s / 100} for s in steps]


def test_names_take_a_list_or_commas_and_refuse_an_unknown_one():
    assert trackers.names("wandb, mlflow,wandb") == ("wandb", "mlflow")
    assert trackers.names(None) == ("tensorboard",) and trackers.names("") == ()
    with pytest.raises(UsageError, match=r"unknown tracker 'comet'; choose from tensorboard, wandb, mlflow"):
        trackers.names(["wandb", "comet"])
    with pytest.raises(UsageError, match="unknown tracker 'neptune'"):
        ddpkit.init(trackers="neptune", out_dir="unused")


def test_a_tracker_that_is_not_installed_is_one_line_at_init(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails
    with pytest.raises(UsageError, match=r"tracker 'wandb' is not installed .*pip install 'ddpkit\[wandb\]'"):
        ddpkit.init(trackers=("wandb",), out_dir=tmp_path)
    assert ddpkit.current() is None


def test_wandb_online_without_credentials_is_one_line(monkeypatch, tmp_path):
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    import wandb

    try:
        found = trackers.problem(("wandb",), tmp_path)
    finally:
        wandb.teardown()  # its settings, read from this environment, go with it
    assert found is not None and "WANDB_MODE=offline" in found and "\n" not in found


def test_an_mlflow_uri_that_cannot_open_is_one_line_before_any_process(monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    bad = f"sqlite:///{tmp_path}/a-file/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", bad)
    found = trackers.problem(("mlflow",), tmp_path)
    assert found is not None and found.startswith("tracker 'mlflow' cannot open tracking URI")
    done = subprocess.run(
        [
            str(BIN / "ddpkit"),
            "train",
            "--tracker",
            "tensorboard,mlflow",
            "--epochs",
            "1",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=clean_env(MLFLOW_TRACKING_URI=bad),
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"ddpkit train: error: {found}"]
    assert not (tmp_path / "run").exists()


def test_trackers_need_an_out_dir():
    with pytest.raises(UsageError, match=r"need ddpkit.init\(out_dir=\.\.\.\)"):
        ddpkit.init(trackers=("mlflow",))


def test_the_run_config_holds_settings_world_versions_commit_and_the_users(tmp_path):
    found = trackers.run_config({"seed": 3, "precision": "fp32", "config": {"ignored": 1}}, {"lr": 0.1}, 4)
    assert found["ddpkit.seed"] == 3 and found["ddpkit.precision"] == "fp32" and "ddpkit.config" not in found
    assert found["world_size"] == 4 and found["lr"] == 0.1
    assert found["ddpkit_version"] == ddpkit.__version__ and found["torch_version"] == torch.__version__
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    if head.returncode == 0:  # the tests run in ddpkit's checkout
        assert found["git_commit"] == head.stdout.strip()


@pytest.mark.timeout(180)
def test_a_crash_and_a_resume_make_one_run_with_every_step_once(offline, tmp_path):
    """Attempt 1 checkpoints at step 3, logs 4 and 5, then fails; attempt 2 loads step 3 and goes on.

    The rows of a checkpoint's own step wait in the checkpoint, so a row logged after the save in
    that step still joins its step, and the attempt that resumes sends them."""
    config = {"lr": 0.1, "world_size": 2}
    first = Remote(("wandb", "mlflow"), tmp_path, run_name="exp", config=config, deferred=True)
    for row in _rows(range(1, 4)):
        first.log(row)
    state = first.state_dict(3)  # what the checkpoint of step 3 holds
    ids = {k: v for k, v in state.items() if k != "rows"}
    assert set(ids) == {"wandb", "mlflow"} and state["rows"] == _rows(range(3, 4))
    first.saved(3)
    for row in _rows(range(4, 6)):
        first.log(row)  # after the checkpoint: held back
    first.close("FAILED")  # an uncaught exception ends attempt 1

    runs = mlflow_runs(tmp_path)
    assert len(runs) == 1 and runs[0]["status"] == "FAILED"
    assert [s for s, _ in runs[0]["history"]["loss"]] == [1, 2]  # step 3 waits in the checkpoint

    second = Remote(("wandb", "mlflow"), tmp_path, run_name="exp", config={**config, "world_size": 3}, deferred=True)
    second.load_state_dict(state, step=3)
    for row in _rows(range(4, 8)):
        second.log(row)
    with pytest.warns(UserWarning, match="params world_size differ"):
        held = second.state_dict(6)
    assert {k: v for k, v in held.items() if k != "rows"} == ids and held["rows"] == _rows(range(6, 7))
    second.saved(6)
    second.log({"step": 6, "val_loss": 0.25})  # logged after the save, in the checkpoint's step
    second.close("FINISHED")  # the rest (steps 6 and 7) at the end

    runs = mlflow_runs(tmp_path)
    assert len(runs) == 1 and runs[0]["id"] == ids["mlflow"] and runs[0]["status"] == "FINISHED"
    assert runs[0]["history"]["loss"] == [(r["step"], r["loss"]) for r in _rows(range(1, 8))]
    assert runs[0]["history"]["val_loss"] == [(6, 0.25)]
    assert runs[0]["params"]["lr"] == "0.1" and runs[0]["params"]["world_size"] == "2"  # MLflow keeps the first
    w = wandb_runs_settled(tmp_path)
    assert [r["id"] for r in w] == [ids["wandb"], ids["wandb"]]  # two attempts, one run
    assert wandb_history(w, "loss") == [(r["step"], r["loss"]) for r in _rows(range(1, 8))]
    assert [row["_step"] for run in w for row in run["rows"]] == list(range(1, 8))  # one W&B row a step
    assert wandb_history(w, "val_loss") == [(6, 0.25)]


@pytest.mark.timeout(120)
def test_wandb_writes_its_run_file_every_half_second_unless_told_otherwise(offline, monkeypatch, tmp_path):
    remote = Remote(("wandb",), tmp_path / "a")
    remote.log(_rows(range(1, 2))[0])
    assert remote._open["wandb"].settings.x_transaction_log_flush_interval == trackers.WANDB_FLUSH_S
    remote.close()
    import wandb

    wandb.teardown()  # wandb reads its environment once a process
    monkeypatch.setenv("WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL", "7")
    remote = Remote(("wandb",), tmp_path / "b")
    remote.log(_rows(range(1, 2))[0])
    assert remote._open["wandb"].settings.x_transaction_log_flush_interval == 7.0
    remote.close()
    wandb.teardown()


@pytest.mark.slow  # 7 s: make test-slow; make test keeps the rows a checkpoint covers
@pytest.mark.timeout(120)
def test_a_run_without_checkpoints_sends_rows_at_once(offline, tmp_path):
    remote = Remote(("mlflow",), tmp_path, deferred=False)
    for row in _rows(range(1, 3)):
        remote.log(row)
    assert [s for s, _ in mlflow_runs(tmp_path)[0]["history"]["loss"]] == [1, 2]
    remote.saved(2)  # the first save: from now on rows wait for checkpoints
    remote.log(_rows(range(3, 4))[0])
    assert [s for s, _ in mlflow_runs(tmp_path)[0]["history"]["loss"]] == [1, 2]
    remote.close()
    assert [s for s, _ in mlflow_runs(tmp_path)[0]["history"]["loss"]] == [1, 2, 3]


@pytest.mark.timeout(120)
def test_a_tracker_failing_mid_run_warns_once_and_the_others_go_on(offline, tmp_path):
    remote = Remote(("wandb", "mlflow"), tmp_path, deferred=False)
    remote.log(_rows(range(1, 2))[0])
    client = remote._open["mlflow"]
    client.log_batch = lambda *a, **k: (_ for _ in ()).throw(ConnectionError("server went away"))
    with pytest.warns(UserWarning, match=r"tracker 'mlflow' failed \(server went away\)"):
        remote.log(_rows(range(2, 3))[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: no second warning
        remote.log(_rows(range(3, 4))[0])
    remote.close()
    assert [s for s, _ in wandb_history(wandb_runs_settled(tmp_path), "loss")] == [1, 2, 3]


def _tracked(tmp_path: Path, name: str, *extra: str, restarts: int = 0) -> tuple[Path, str]:
    out = tmp_path / name
    done = subprocess.run(
        [
            str(BIN / "ddpkit"),
            "run",
            "-n",
            "2",
            "--max-restarts",
            str(restarts),
            TRACKED,
            "--out",
            str(out),
            "--result",
            str(out / "w.pt"),
            "--trackers",
            "tensorboard,wandb,mlflow",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=clean_env(WANDB_MODE="offline", WANDB_SILENT="true"),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out, done.stdout


@pytest.mark.slow  # two 2-process runs with three trackers (~70 s): make test-slow
@pytest.mark.timeout(420)
def test_a_run_killed_mid_epoch_and_restarted_is_one_run_with_each_step_once_in_every_tracker(tmp_path):
    whole, _ = _tracked(tmp_path, "whole")
    # checkpoint at 6, epoch of 8; rank 1 dies 2 s after step 8 (W&B writes its file every 0.5 s)
    killed, stdout = _tracked(tmp_path, "killed", "--kill-step", "8", "--kill-delay", "2", restarts=1)
    assert "attempt 1 starts at step 6 (resumed: True)" in stdout
    a, b = torch.load(whole / "w.pt", weights_only=True), torch.load(killed / "w.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = list(range(1, 21))
    for out in (whole, killed):
        runs = mlflow_runs(out)
        assert len(runs) == 1 and runs[0]["status"] == "FINISHED" and runs[0]["params"]["world_size"] == "2"
        assert [s for s, _ in runs[0]["history"]["loss"]] == steps
        assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == steps
        assert [s for s, _ in tensorboard_history(out, "loss")] == steps
    assert mlflow_runs(killed)[0]["history"]["loss"] == mlflow_runs(whole)[0]["history"]["loss"]
    assert tensorboard_history(killed, "loss") == tensorboard_history(whole, "loss")
    # only rank 0 opened a run: one offline run directory per attempt, all of one run id
    w_whole, w_killed = wandb_runs(whole), wandb_runs(killed)
    assert len(w_whole) == 1 and len(w_killed) == 2 and len({r["id"] for r in w_killed}) == 1
    assert wandb_history(w_killed, "loss") == wandb_history(w_whole, "loss")
    assert [s for s, _ in wandb_history(w_killed, "loss")] == steps
