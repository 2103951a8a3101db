"""Preemption: SIGTERM (or SLURM's SIGUSR1) becomes a checkpoint at the next step and exit code 75.

One process signalling itself (fast), and SIGTERM to ``ddpkit run -n 2`` mid-epoch, which must
save within torch's grace period, exit 75 and resume to the uninterrupted run's weights, bitwise.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from ddpkit import checkpoint
from ddpkit.distributed.preemption import EXIT_CODE, Preemption
from helpers import BIN, ROOT, clean_env, kill_tree, python

SCRIPT = str(ROOT / "tests" / "scripts" / "preempted.py")
TRACKED = str(ROOT / "tests" / "scripts" / "tracked_train.py")


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _run(tmp_path: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    return python(
        SCRIPT, "--checkpoints", str(tmp_path / "ckpt"), "--result", str(tmp_path / f"{name}.pt"), *extra, timeout=120
    )


def _newest_step(directory: Path) -> int:
    newest = checkpoint.latest(directory)
    assert newest is not None
    return int(re.search(r"step(\d+)", newest.name).group(1))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("whole")
    done = _run(out, "whole")
    assert done.returncode == 0, done.stderr[-3000:]
    return _weights(out / "whole.pt")


@pytest.mark.timeout(240)
def test_sigterm_saves_at_the_next_step_exits_75_and_resumes_bitwise(uninterrupted, tmp_path):
    stopped = _run(tmp_path, "stopped", "--signal-step", "5")
    assert stopped.returncode == EXIT_CODE, stopped.stderr[-3000:]
    assert "preempted (SIGTERM); saved" in stopped.stdout + stopped.stderr
    assert _newest_step(tmp_path / "ckpt") == 6  # agreed at the step after the signal, mid-epoch
    assert not (tmp_path / "stopped.pt").exists()
    resumed = _run(tmp_path, "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _bitwise(_weights(tmp_path / "resumed.pt"), uninterrupted)


@pytest.mark.timeout(120)
def test_a_signal_before_training_ends_the_process_as_without_ddpkit(tmp_path):
    done = _run(tmp_path, "early", "--signal-before-training")
    assert done.returncode == -signal.SIGTERM, done.stderr[-2000:]
    assert not (tmp_path / "ckpt").exists() or checkpoint.latest(tmp_path / "ckpt") is None


@pytest.mark.timeout(120)
def test_a_second_signal_during_the_save_leaves_a_whole_checkpoint(tmp_path):
    done = _run(tmp_path, "again", "--signal-step", "5", "--again-in-save")
    assert done.returncode == EXIT_CODE, done.stderr[-3000:]
    newest = checkpoint.latest(tmp_path / "ckpt")  # verified against its digest
    assert newest is not None and newest.name == "ckpt-step00000006.pt"


@pytest.mark.timeout(120)
def test_a_grace_period_too_short_for_the_save_leaves_the_previous_checkpoint_newest(tmp_path):
    done = _run(tmp_path, "killed", "--signal-step", "5", "--kill-in-save")
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert _newest_step(tmp_path / "ckpt") == 4


def test_preemption_keeps_a_handler_the_user_installed():
    mine = lambda signum, frame: None  # noqa: E731
    previous = signal.signal(signal.SIGUSR1, mine)
    term = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # whatever an earlier test left
    watch = Preemption()
    try:
        caught = watch.install()
        assert "SIGUSR1" not in caught and signal.getsignal(signal.SIGUSR1) is mine
        assert "SIGTERM" in caught
        watch.armed = True
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.received == signal.SIGTERM and watch.name == "SIGTERM"
    finally:
        watch.uninstall()
        restored = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGUSR1, previous)
        signal.signal(signal.SIGTERM, term)
    assert restored == signal.SIG_DFL


@pytest.mark.slow  # 10-16 s: make test-slow keeps make test under 15 minutes
@pytest.mark.timeout(300)
def test_sigterm_to_ddpkit_run_mid_epoch_saves_exits_75_and_resumes_bitwise(tmp_path):
    """The agent passes SIGTERM to both workers; they agree on a step, save within the grace period."""
    common = ["--steps", "16", "--trackers", ""]
    whole = subprocess.run(
        [
            str(BIN / "ddpkit"),
            "run",
            "-n",
            "2",
            TRACKED,
            "--out",
            str(tmp_path / "whole"),
            "--result",
            str(tmp_path / "whole.pt"),
            *common,
        ],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
        cwd=ROOT,
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = tmp_path / "stopped"
    proc = subprocess.Popen(
        [
            str(BIN / "ddpkit"),
            "run",
            "-n",
            "2",
            TRACKED,
            "--out",
            str(out),
            "--result",
            str(tmp_path / "stopped.pt"),
            *common,
            "--step-sleep",
            "0.3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # 8 steps an epoch: signal after step 3
            if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3:
                break
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        else:
            pytest.fail("the run never reached step 3")
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    # 75 only when the workers' save was on disk before the agent's grace period (30 s) ran out
    assert proc.returncode == EXIT_CODE, stderr[-3000:]
    assert f"the workers saved a checkpoint first, exit code {EXIT_CODE}" in stderr
    saved = _newest_step(out / "checkpoints")
    assert 3 <= saved < 16, f"saved at step {saved}, not before the run's end"  # asked about once a second
    assert f"preempted (SIGTERM); saved {out / 'checkpoints' / f'ckpt-step{saved:08d}.pt'}" in stdout + stderr
    resumed = subprocess.run(
        [
            str(BIN / "ddpkit"),
            "run",
            "-n",
            "2",
            TRACKED,
            "--out",
            str(out),
            "--result",
            str(tmp_path / "resumed.pt"),
            *common,
        ],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
        cwd=ROOT,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"starts at step {saved} (resumed: True)" in resumed.stdout
    assert _bitwise(_weights(tmp_path / "resumed.pt"), _weights(tmp_path / "whole.pt"))


@pytest.mark.slow  # ~25 s: make test-slow
@pytest.mark.timeout(240)
def test_ddpkit_train_saves_by_itself_when_preempted_and_resumes(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [str(BIN / "ddpkit"), "train", "--epochs", "40", "--out", str(out), "--tracker", ""],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
            assert time.monotonic() < deadline and proc.poll() is None, "no epoch ended"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)  # during epoch 1 (or later)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert proc.returncode == EXIT_CODE, stderr[-3000:]
    saved = _newest_step(out / "checkpoints")
    assert f"ddpkit: preempted (SIGTERM); saved {out / 'checkpoints' / f'ckpt-step{saved:08d}.pt'}" in stdout + stderr
    assert not (out / "summary.json").exists()
    resumed = subprocess.run(
        [str(BIN / "ddpkit"), "train", "--epochs", "2", "--out", str(out), "--tracker", "", "--resume", "auto"],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=ROOT,
        timeout=180,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"ddpkit: resumed from {out / 'checkpoints' / f'ckpt-step{saved:08d}.pt'}: step {saved}," in resumed.stderr
