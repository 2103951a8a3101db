"""A real SLURM cluster of one host: munge, slurmctld and slurmd from a generated slurm.conf.

`.ci/run` installs Debian's slurm-wlm and munge when it runs as root; elsewhere this test
skips and says why. The job is the script `ddpkit slurm` prints, submitted with sbatch.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from ddpkit.distributed.host import free_port
from helpers import BIN, EXAMPLES, ROOT, clean_env, kill_tree

SCRIPTS = ROOT / "tests" / "scripts"

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo")


def _slurm_conf(root: Path) -> str:
    host = socket.gethostname().split(".")[0]
    cpus = len(os.sched_getaffinity(0))
    ports = {free_port()}
    while len(ports) < 2:  # two calls may return the same free port
        ports.add(free_port())
    ctld_port, slurmd_port = sorted(ports)
    return "\n".join(
        [
            "ClusterName=ddpkit-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd.pid",
            f"SlurmctldLogFile={root}/slurmctld.log",
            f"SlurmdLogFile={root}/slurmd.log",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "MpiDefault=none",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def _wait_for_a_stopping_munged(timeout_s: float = 15.0) -> None:
    """A munged without its socket is on its way out (the previous test stopped it): wait until it
    has gone, so the next cluster starts one of its own instead of finding a dying one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        running = subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0
        if not running or Path(MUNGE_SOCKET).exists():
            return
        time.sleep(0.2)


MUNGE_SOCKET = "/run/munge/munge.socket.2"


@pytest.fixture
def slurm_cluster(tmp_path):
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        pytest.skip(
            f"SLURM is not installed ({', '.join(missing)} missing); as root, "
            "apt-get install slurm-wlm munge (.ci/run does)"
        )
    if os.geteuid() != 0:
        pytest.skip("running slurmd and munged for a test needs root")
    root = tmp_path / "slurm"
    for sub in ("state", "spool"):
        (root / sub).mkdir(parents=True)
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root))
    env = clean_env(SLURM_CONF=str(conf))
    started = []
    _wait_for_a_stopping_munged()
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        subprocess.run(["munged", "--force"], capture_output=True, timeout=30)
        started.append("munged")
    for daemon in ("slurmctld", "slurmd"):
        result = subprocess.run([daemon, "-f", str(conf)], capture_output=True, text=True, env=env, timeout=30)
        if result.returncode != 0:
            pytest.skip(f"{daemon} did not start here: {result.stderr.strip()[:200]}")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=env)
            if state.stdout.strip() == "idle":
                break
            time.sleep(0.5)
        else:
            pytest.skip(f"the SLURM node never became idle: {(root / 'slurmd.log').read_text()[-500:]}")
        yield root, env
    finally:
        for pid_file in ("slurmd.pid", "slurmctld.pid"):
            path = root / pid_file
            if path.exists():
                kill_tree(int(path.read_text().strip()))
        if "munged" in started:
            subprocess.run(["pkill", "-x", "munged"], capture_output=True)
            deadline = time.monotonic() + 15  # gone before the next test looks for one
            while time.monotonic() < deadline and subprocess.run(["pgrep", "-x", "munged"]).returncode == 0:
                time.sleep(0.2)


@pytest.mark.slow  # 44 s: make test's budget; make test-slow (and CI) runs it
@pytest.mark.timeout(300)
def test_training_submitted_with_sbatch_finishes_with_the_expected_world(slurm_cluster):
    root, env = slurm_cluster
    script = subprocess.run(
        [
            str(BIN / "ddpkit"),
            "slurm",
            "--nodes",
            "1",
            "--nproc-per-node",
            "2",
            "--cpus-per-task",
            str(len(os.sched_getaffinity(0))),
            "--time",
            "10",
            str(EXAMPLES / "train_digits.py"),
            "--epochs",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert script.returncode == 0, script.stderr
    job = root / "job.sh"
    job.write_text(script.stdout)
    submitted = subprocess.run(
        ["sbatch", "--wait", "--chdir", str(root), str(job)], capture_output=True, text=True, env=env, timeout=240
    )
    outputs = list(root.glob("ddpkit-*.out"))
    log = outputs[0].read_text() if outputs else ""
    assert submitted.returncode == 0, submitted.stderr + log[-3000:]
    final = re.findall(r"world_size=(\d+) test_accuracy=([\d.]+) test_count=(\d+)", log)
    assert len(final) == 1 and final[0][0] == "2" and final[0][2] == "360", log[-3000:]
    assert float(final[0][1]) >= 0.95


def _job_state(job: str, env: dict) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env, timeout=30)
    return dict(re.findall(r"(\w+)=(\S+)", shown.stdout))


@pytest.mark.slow  # two training runs and a requeue (SLURM's ~2 min hold on it released at once): make test-slow
@pytest.mark.timeout(600)
def test_requeue_job_signalled_mid_epoch_saves_is_requeued_and_ends_bitwise(slurm_cluster, tmp_path):
    from tracker_stores import mlflow_runs, wandb_history, wandb_runs

    root, env = slurm_cluster
    env = {**env, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    script_args = ["--trackers", "wandb,mlflow", "--steps", "16"]
    reference = tmp_path / "reference"
    done = subprocess.run(
        [
            str(BIN / "ddpkit"),
            "run",
            "-n",
            "2",
            str(SCRIPTS / "tracked_train.py"),
            "--out",
            str(reference),
            "--result",
            str(reference / "w.pt"),
            *script_args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    out = tmp_path / "requeued"
    made = subprocess.run(
        [
            str(BIN / "ddpkit"),
            "slurm",
            "--nodes",
            "1",
            "--nproc-per-node",
            "2",
            "--requeue",
            "--time",
            "10",
            "--preempt-signal-s",
            "60",
            "--cpus-per-task",
            str(len(os.sched_getaffinity(0))),
            str(SCRIPTS / "tracked_train.py"),
            "--out",
            str(out),
            "--result",
            str(out / "w.pt"),
            *script_args,
            "--step-sleep",
            "0.4",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    assert "#SBATCH --signal=B:USR1@60" in made.stdout and "#SBATCH --requeue" in made.stdout
    (root / "job.sh").write_text(made.stdout)
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--chdir", str(root), str(root / "job.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    log = lambda: "\n".join(p.read_text() for p in root.glob("ddpkit-*.out"))  # noqa: E731
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # mid-epoch: 8 steps an epoch, signal after step 4
            rows = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
            if len(rows) >= 4:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the job never trained: {_job_state(job, env)} {log()[-2000:]}")
        signalled = subprocess.run(
            ["scancel", "--signal=USR1", "--batch", job], capture_output=True, text=True, env=env, timeout=30
        )
        assert signalled.returncode == 0, signalled.stderr
        deadline = time.monotonic() + 400
        released = False
        while time.monotonic() < deadline:
            state = _job_state(job, env)
            if (
                state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
                and state.get("Restarts") != "0"
            ):
                break
            if not released and state.get("JobState") == "PENDING" and state.get("Restarts") != "0":
                # SLURM holds a requeued job ~2 minutes (its BeginTime); an administrator's
                # "start it now" ends the wait, and nothing of ddpkit's part changes. Only once
                # the node is idle again (slurmd revoked the killed attempt's credential and ran
                # its epilog) and a whole second later: a launch whose credential is stamped in
                # the revocation's second is refused ("Job 1 already killed, do not launch batch
                # job") and the job fails with exit 1 in 0 s (CI, stop 49)
                node = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=env)
                if node.stdout.strip() == "idle":
                    time.sleep(2)
                    update = ["scontrol", "update", f"JobId={job}", "StartTime=now"]
                    subprocess.run(update, capture_output=True, env=env, timeout=30)
                    released = True
            time.sleep(1)
        else:
            pytest.fail(f"the job did not finish after its requeue: {_job_state(job, env)}\n{log()[-3000:]}")
    finally:
        subprocess.run(["scancel", job], capture_output=True, env=env, timeout=30)
    text = log()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", f"{state}\n{text[-3000:]}"
    assert "preempted (SIGUSR1); saved" in text and "requeueing job" in text, text[-3000:]
    saved = int(re.search(r"saved \S+ckpt-step(\d+)\.pt at step", text).group(1))
    assert 4 <= saved < 16, text[-3000:]  # saved mid-run, not at its end
    assert re.search(rf"attempt 0 starts at step {saved} \(resumed: True\)", text), text[-3000:]
    a, b = torch.load(reference / "w.pt", weights_only=True), torch.load(out / "w.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    runs = mlflow_runs(out)
    assert len(runs) == 1 and runs[0]["history"]["loss"] == mlflow_runs(reference)[0]["history"]["loss"]
    w = wandb_runs(out)
    assert len({r["id"] for r in w}) == 1 and len(w) == 2  # one run id, written by two attempts
    assert wandb_history(w, "loss") == wandb_history(wandb_runs(reference), "loss")
