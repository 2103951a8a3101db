"""Killed workers, restarts under the elastic agent, and resuming on another world size."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

import ddpkit
import workers
from ddpkit import checkpoint
from helpers import BIN, ROOT, clean_env, kill_tree
from helpers import ddpkit as ddpkit_cli

SCRIPT = str(ROOT / "tests" / "scripts" / "elastic_train.py")


class KillPoints(random.Random):
    """Random kill steps and victims that a failure can replay: ``note`` names the seed."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.note = f"replay with DDPKIT_TEST_SEED={seed}"


@pytest.fixture
def kill(request) -> KillPoints:
    """Kill points drawn from a printed seed; ``DDPKIT_TEST_SEED=<seed>`` replays a failure's."""
    seed = int(os.environ.get("DDPKIT_TEST_SEED") or random.SystemRandom().randrange(2**31))
    print(f"{request.node.name}: kill points from DDPKIT_TEST_SEED={seed}")
    return KillPoints(seed)


def _elastic(tmp_path: Path, name: str, *extra: str, note: str = "", restarts: int = 2) -> dict:
    ckpt = tmp_path / f"{name}-ckpt"
    result_file = tmp_path / f"{name}.pt"
    result = ddpkit_cli(
        "run",
        "-n",
        "2",
        "--max-restarts",
        str(restarts),
        SCRIPT,
        "--checkpoints",
        str(ckpt),
        "--result",
        str(result_file),
        *extra,
        timeout=140,
    )
    assert result.returncode == 0, f"{note}\n{result.stderr[-4000:]}"
    return {
        "weights": torch.load(result_file, weights_only=True),
        "stdout": result.stdout,
        "stderr": result.stderr,
        "ckpt": ckpt,
    }


def _assert_bitwise(a: dict, b: dict, where: str = "") -> None:
    assert a.keys() == b.keys(), where
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} {where}"


def _resumed_at(stdout: str) -> set[int]:
    """The steps every rank's final process started at (elastic_train prints one per rank)."""
    starts = re.findall(r"rank (\d+) started at step (\d+)", stdout)
    assert sorted(rank for rank, _ in starts) == ["0", "1"], stdout[-3000:]
    return {int(step) for _, step in starts}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _elastic(tmp_path_factory.mktemp("clean"), "clean")


@pytest.mark.timeout(300)
def test_sigkill_at_a_random_step_resumes_bitwise(uninterrupted, tmp_path, kill):
    assert "done after 0 restart(s)" in uninterrupted["stdout"]
    step, rank = kill.randint(2, 22), kill.randint(0, 1)
    where = f"step {step} rank {rank} ({kill.note})"
    killed = _elastic(tmp_path, "killed", "--kill-step", str(step), "--kill-rank", str(rank), note=where)
    assert "done after 1 restart(s)" in killed["stdout"], where
    # the newest complete checkpoint: step's or the one before; one older when rank 0 (the writer)
    # died with the one before still being written in the background
    assert _resumed_at(killed["stdout"]) in ({step - 2}, {step - 1}, {step}), where
    _assert_bitwise(killed["weights"], uninterrupted["weights"], where)
    # said once, by rank 0: the restart (torch says it only at INFO), and where the run goes on from
    said = killed["stderr"]
    assert said.count("ddpkit: restart 1 of 2: a worker failed") == 1, said[-3000:]
    (resumed,) = re.findall(r"ddpkit: resumed from (\S+): step (\d+), (?:inside|at the start of) epoch \d+\n", said)
    assert Path(resumed[0]).parent == killed["ckpt"] and {int(resumed[1])} == _resumed_at(killed["stdout"]), said
    assert "ddpkit: restart" not in uninterrupted["stderr"] and "ddpkit: resumed" not in uninterrupted["stderr"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_twice_in_two_attempts_still_ends_bitwise(uninterrupted, tmp_path, kill):
    first, second = kill.randint(2, 10), kill.randint(12, 22)
    where = f"steps {first} and {second} ({kill.note})"
    killed = _elastic(
        tmp_path, "twice", "--kill-step", str(first), "--kill-rank", "1", "--kill-again-step", str(second), note=where
    )
    assert "done after 2 restart(s)" in killed["stdout"], where
    assert killed["stdout"].count("resumed at step") == 2, where
    _assert_bitwise(killed["weights"], uninterrupted["weights"], where)


@pytest.mark.slow  # 10-16 s: make test-slow keeps make test under 15 minutes
@pytest.mark.timeout(300)
def test_sigkill_during_a_save_keeps_the_previous_checkpoint(uninterrupted, tmp_path, kill):
    step = kill.randint(3, 20)
    where = f"step {step} ({kill.note})"
    killed = _elastic(tmp_path, "insave", "--kill-step", str(step), "--kill-in-save", note=where)
    assert "done after 1 restart(s)" in killed["stdout"], where
    assert _resumed_at(killed["stdout"]) == {step - 1}, where  # the torn save was skipped
    _assert_bitwise(killed["weights"], uninterrupted["weights"], where)
    left = sorted(p.name for p in killed["ckpt"].iterdir())
    assert left == [
        "ckpt-step00000023.pt",
        "ckpt-step00000023.pt.sha256",
        "ckpt-step00000024.pt",
        "ckpt-step00000024.pt.sha256",
    ]  # no torn leftovers


def _holds_a_loss_scale(payload) -> bool:
    """Whether a checkpoint payload holds a GradScaler state (a ``scale`` entry) anywhere."""
    if isinstance(payload, dict):
        return "scale" in payload or any(_holds_a_loss_scale(v) for v in payload.values())
    if isinstance(payload, (list, tuple)):
        return any(_holds_a_loss_scale(v) for v in payload)
    return False


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fp16_under_ddp_survives_a_restart_bitwise(tmp_path, kill):
    """README: the GradScaler is checkpointed, so a killed fp16 run resumes to the same bits."""
    clean = _elastic(tmp_path, "fp16-clean", "--precision", "fp16", restarts=1)
    step, rank = kill.randint(2, 22), kill.randint(0, 1)
    where = f"fp16, step {step} rank {rank} ({kill.note})"
    killed = _elastic(
        tmp_path,
        "fp16-killed",
        "--precision",
        "fp16",
        "--kill-step",
        str(step),
        "--kill-rank",
        str(rank),
        restarts=1,
        note=where,
    )
    assert "done after 1 restart(s)" in killed["stdout"], where
    # as in the fp32 test: one older when rank 0 (the writer) died with the step before's
    # checkpoint still being written in the background
    assert _resumed_at(killed["stdout"]) in ({step - 2}, {step - 1}, {step}), where
    newest = checkpoint.latest(killed["ckpt"])
    assert newest is not None and _holds_a_loss_scale(checkpoint.read(newest)), where
    _assert_bitwise(killed["weights"], clean["weights"], where)


def _train_args(out: Path) -> list[str]:
    return [
        "train",
        "--nproc",
        "2",
        "--epochs",
        "2",
        "--checkpoint-every",
        "3",
        "--max-restarts",
        "2",
        "--resume",
        "auto",
        "--out",
        str(out),
    ]


def _final_weights(out: Path) -> tuple[dict, dict]:
    summary = json.loads((out / "summary.json").read_text())
    return summary, checkpoint.read(summary["final_checkpoint"])["user"]["model"]


def _kill_a_trainer(agent_pid: int, step: int, kill: KillPoints) -> str | None:
    """SIGKILL one ``ddpkit train`` worker under the agent; say which and when, None if none yet."""
    try:
        trainers = [
            p
            for p in psutil.Process(agent_pid).children(recursive=True)
            if "ddpkit.recipes.train" in " ".join(p.cmdline())
        ]
        if not trainers:
            return None
        victim = kill.choice(sorted(trainers, key=lambda p: p.pid))
        victim.send_signal(signal.SIGKILL)
    except psutil.Error:  # a process came or went while we looked: look again
        return None
    return f"pid {victim.pid} after checkpoint step {step}"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ddpkit_train_survives_a_killed_worker(tmp_path, kill):
    clean = tmp_path / "clean"
    result = ddpkit_cli(*_train_args(clean), timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    reference_summary, reference = _final_weights(clean)

    out = tmp_path / "killed"
    target = kill.randint(4, 30)  # of 46 steps: kill once a checkpoint at or past it exists
    log = tmp_path / "killed.log"  # a file, not a pipe: nobody blocks on a full pipe
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            [str(BIN / "ddpkit"), *_train_args(out)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            env=clean_env(),
            cwd=ROOT,
            start_new_session=True,
        )
    killed_at = None
    try:
        deadline = time.monotonic() + 120
        while killed_at is None and proc.poll() is None and time.monotonic() < deadline:
            steps = [int(p.name[9:17]) for p in (out / "checkpoints").glob("ckpt-step*.pt")] if out.exists() else []
            if steps and target <= max(steps) < 45:  # not after the last one: a resume must train
                killed_at = _kill_a_trainer(proc.pid, max(steps), kill)
            time.sleep(0.02)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    output = log.read_text()
    assert killed_at is not None, f"no worker was killed (target step {target}, {kill.note})\n{output[-3000:]}"
    where = f"killed {killed_at} ({kill.note})"
    assert proc.returncode == 0, f"{where}\n{output[-3000:]}"
    assert "ddpkit: resumed from" in output, where
    summary, weights = _final_weights(out)
    _assert_bitwise(weights, reference, where)
    assert summary["test_loss"] == reference_summary["test_loss"]
    assert summary["test_accuracy"] == reference_summary["test_accuracy"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1]  # no row twice after the restart


def _relative(a: dict, b: dict) -> float:
    keys = [k for k in a if a[k].is_floating_point()]
    flat_a = torch.cat([a[k].double().flatten() for k in keys])
    flat_b = torch.cat([b[k].double().flatten() for k in keys])
    return float((flat_a - flat_b).norm() / flat_b.norm())


@pytest.mark.timeout(400)
# Both slow (25 s, 21 s) for make test's budget; tests/test_streams.py resumes 2 on 3 in make test.
@pytest.mark.slow
@pytest.mark.parametrize("new_world", [3, 1])
def test_checkpoint_of_two_processes_resumes_on(new_world, tmp_path):
    reference = ddpkit.launch(workers.train_steps, nprocs=2, args=(40,))[0]
    stopped = ddpkit.launch(workers.train_steps, nprocs=2, args=(40, 12, 100, True, 20, str(tmp_path)))
    assert stopped[0] == {"stopped": 20}
    resumed = ddpkit.launch(workers.train_steps, nprocs=new_world, args=(40, 12, 100, True, None, str(tmp_path)))[0]
    assert resumed["visited"] == reference["visited"][20:]  # the same global samples from step 21 on
    assert _relative(resumed["weights"], reference["weights"]) <= 1e-5
