"""Killed workers, restarts under the elastic agent, and resuming on another world size."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

import ddpkit
from ddpkit import checkpoint
from helpers import BIN, ROOT, clean_env, ddpkit as ddpkit_cli, kill_tree

import workers

SCRIPT = str(ROOT / "tests" / "scripts" / "elastic_train.py")


def _elastic(tmp_path: Path, name: str, *extra: str) -> dict:
    ckpt = tmp_path / f"{name}-ckpt"
    result_file = tmp_path / f"{name}.pt"
    result = ddpkit_cli("run", "-n", "2", "--max-restarts", "2", SCRIPT, "--checkpoints", str(ckpt),
                        "--result", str(result_file), *extra, timeout=140)
    assert result.returncode == 0, result.stderr[-4000:]
    return {"weights": torch.load(result_file, weights_only=True), "stdout": result.stdout, "ckpt": ckpt}


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _elastic(tmp_path_factory.mktemp("clean"), "clean")


@pytest.mark.timeout(300)
def test_sigkill_at_a_random_step_resumes_bitwise(uninterrupted, tmp_path):
    assert "done after 0 restart(s)" in uninterrupted["stdout"]
    step, rank = random.randint(2, 22), random.randint(0, 1)
    killed = _elastic(tmp_path, "killed", "--kill-step", str(step), "--kill-rank", str(rank))
    assert "done after 1 restart(s)" in killed["stdout"], f"step {step} rank {rank}"
    assert f"resumed at step {step - 1}" in killed["stdout"] or f"resumed at step {step}" in killed["stdout"]
    _assert_bitwise(killed["weights"], uninterrupted["weights"])


@pytest.mark.timeout(300)
def test_killed_twice_in_two_attempts_still_ends_bitwise(uninterrupted, tmp_path):
    first, second = random.randint(2, 10), random.randint(12, 22)
    killed = _elastic(tmp_path, "twice", "--kill-step", str(first), "--kill-rank", "1",
                      "--kill-again-step", str(second))
    assert "done after 2 restart(s)" in killed["stdout"], f"steps {first} and {second}"
    assert killed["stdout"].count("resumed at step") == 2
    _assert_bitwise(killed["weights"], uninterrupted["weights"])


@pytest.mark.timeout(300)
def test_sigkill_during_a_save_keeps_the_previous_checkpoint(uninterrupted, tmp_path):
    step = random.randint(3, 20)
    killed = _elastic(tmp_path, "insave", "--kill-step", str(step), "--kill-in-save")
    assert "done after 1 restart(s)" in killed["stdout"], f"step {step}"
    assert f"resumed at step {step - 1}" in killed["stdout"]     # the torn save was skipped
    _assert_bitwise(killed["weights"], uninterrupted["weights"])
    left = sorted(p.name for p in killed["ckpt"].iterdir())
    assert left == ["ckpt-step00000023.pt", "ckpt-step00000023.pt.sha256",
                    "ckpt-step00000024.pt", "ckpt-step00000024.pt.sha256"]    # no torn leftovers


def _train_args(out: Path) -> list[str]:
    return ["train", "--nproc", "2", "--epochs", "2", "--checkpoint-every", "3", "--max-restarts", "2",
            "--resume", "auto", "--out", str(out)]


def _final_weights(out: Path) -> tuple[dict, dict]:
    summary = json.loads((out / "summary.json").read_text())
    return summary, checkpoint.read(summary["final_checkpoint"])["user"]["model"]


def _kill_a_trainer(agent_pid: int, step: int) -> str | None:
    """SIGKILL one ``ddpkit train`` worker under the agent; say which and when, None if none yet."""
    try:
        trainers = [p for p in psutil.Process(agent_pid).children(recursive=True)
                    if "ddpkit.recipes.train" in " ".join(p.cmdline())]
        if not trainers:
            return None
        victim = random.choice(trainers)
        victim.send_signal(signal.SIGKILL)
    except psutil.Error:          # a process came or went while we looked: look again
        return None
    return f"pid {victim.pid} after checkpoint step {step}"


@pytest.mark.timeout(400)
def test_ddpkit_train_survives_a_killed_worker(tmp_path):
    clean = tmp_path / "clean"
    result = ddpkit_cli(*_train_args(clean), timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    reference_summary, reference = _final_weights(clean)

    out = tmp_path / "killed"
    target = random.randint(4, 30)            # of 46 steps: kill once a checkpoint at or past it exists
    log = tmp_path / "killed.log"             # a file, not a pipe: nobody blocks on a full pipe
    with open(log, "w") as sink:
        proc = subprocess.Popen([str(BIN / "ddpkit"), *_train_args(out)], stdout=sink,
                                stderr=subprocess.STDOUT, text=True, env=clean_env(), cwd=ROOT,
                                start_new_session=True)
    killed_at = None
    try:
        deadline = time.monotonic() + 120
        while killed_at is None and proc.poll() is None and time.monotonic() < deadline:
            steps = [int(p.name[9:17]) for p in (out / "checkpoints").glob("ckpt-step*.pt")] if out.exists() else []
            if steps and target <= max(steps) < 45:       # not after the last one: a resume must train
                killed_at = _kill_a_trainer(proc.pid, max(steps))
            time.sleep(0.02)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    output = log.read_text()
    assert killed_at is not None, f"no worker was killed (target step {target})\n{output[-3000:]}"
    assert proc.returncode == 0, f"killed at {killed_at}\n{output[-3000:]}"
    assert "resuming from" in output
    summary, weights = _final_weights(out)
    _assert_bitwise(weights, reference)
    assert summary["test_loss"] == reference_summary["test_loss"]
    assert summary["test_accuracy"] == reference_summary["test_accuracy"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1]          # no row twice after the restart


def _relative(a: dict, b: dict) -> float:
    keys = [k for k in a if a[k].is_floating_point()]
    flat_a = torch.cat([a[k].double().flatten() for k in keys])
    flat_b = torch.cat([b[k].double().flatten() for k in keys])
    return float((flat_a - flat_b).norm() / flat_b.norm())


@pytest.mark.timeout(400)
@pytest.mark.parametrize("new_world", [3, 1])
def test_checkpoint_of_two_processes_resumes_on(new_world, tmp_path):
    reference = ddpkit.launch(workers.train_steps, nprocs=2, args=(40,))[0]
    stopped = ddpkit.launch(workers.train_steps, nprocs=2, args=(40, 12, 100, True, 20, str(tmp_path)))
    assert stopped[0] == {"stopped": 20}
    resumed = ddpkit.launch(workers.train_steps, nprocs=new_world, args=(40, 12, 100, True, None, str(tmp_path)))[0]
    assert resumed["visited"] == reference["visited"][20:]          # the same global samples from step 21 on
    assert _relative(resumed["weights"], reference["weights"]) <= 1e-5
