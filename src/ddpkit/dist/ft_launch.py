"""``ddpkit run --fault-tolerant -n N``: torchft's lighthouse and N replicas, each restarted on its own.

The lighthouse runs in a child process of its own, listening on 127.0.0.1 only. Each replica is
a one-process ``ddpkit run`` (torch's elastic agent) with ``--max-restarts K``: when it dies,
its own agent restarts it and it heals from a live peer, while the other replicas go on. This
process only starts them and watches: when the lighthouse dies, every replica is stopped (one
line), so the replicas never split into groups that train apart.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ddpkit.dist import ft
from ddpkit.errors import UsageError

HOST = "127.0.0.1"
FINISH_GRACE_S = 120.0
"""How long the other replicas get to finish once one has (they end at the same step; this is their
last evaluation and saving) before they are stopped."""
STOP_GRACE_S = 10.0
"""How long replicas get to end after SIGTERM before they are killed."""

_LIGHTHOUSE = """
import sys, time
from torchft._torchft import LighthouseServer
bind, min_replicas, join, tick, heartbeat = sys.argv[1:6]
server = LighthouseServer(bind=bind, min_replicas=int(min_replicas), join_timeout_ms=int(join),
                          quorum_tick_ms=int(tick), heartbeat_timeout_ms=int(heartbeat))
print(server.address().rsplit(":", 1)[-1], flush=True)
while True:
    time.sleep(3600)
"""


@dataclass(frozen=True)
class FaultTolerantSpec:
    """What ``ddpkit run --fault-tolerant`` was asked."""

    target: str
    """The script (or module, with ``module``)."""
    target_args: Sequence[str]
    """The script's own arguments."""
    replicas: int
    """Replicas started (``-n``)."""
    min_replicas: int = 1
    """The fewest replicas a step may commit with."""
    max_restarts: int = 3
    """Restarts of each replica (its own elastic agent counts them)."""
    module: bool = False
    """``target`` is a module (``-m``)."""
    quorum_timeout_s: float = 60.0
    """How long a replica waits for ``min_replicas`` before it stops."""


def validate(spec: FaultTolerantSpec) -> None:
    """Refuse what cannot run, in one line."""
    ft.check_installed()
    if spec.replicas < 1:
        raise UsageError(f"--fault-tolerant needs -n of at least 1 replica, got {spec.replicas}")
    if not 1 <= spec.min_replicas <= spec.replicas:
        raise UsageError(f"--min-replicas {spec.min_replicas} must be between 1 and -n ({spec.replicas})")
    if spec.max_restarts < 0:
        raise UsageError(f"--max-restarts must be 0 or more, got {spec.max_restarts}")


def start_lighthouse(min_replicas: int) -> tuple[subprocess.Popen, str]:
    """torchft's lighthouse in a child process on 127.0.0.1; (process, its address)."""
    child = subprocess.Popen(
        [sys.executable, "-c", _LIGHTHOUSE, f"{HOST}:0", str(min_replicas), str(ft.JOIN_TIMEOUT_MS),
         str(ft.QUORUM_TICK_MS), str(ft.HEARTBEAT_TIMEOUT_MS)],
        stdout=subprocess.PIPE, text=True, start_new_session=True, env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")})
    assert child.stdout is not None
    port = child.stdout.readline().strip()
    if not port.isdigit():
        child.kill()
        raise UsageError("torchft's lighthouse did not start (is torchft installed? pip install 'ddpkit[ft]')")
    return child, f"http://{HOST}:{port}"


def replica_command(spec: FaultTolerantSpec) -> list[str]:
    """One replica: a one-process ``ddpkit run`` that restarts it up to ``max_restarts`` times."""
    target = ["-m", spec.target] if spec.module else [spec.target]
    return [sys.executable, "-m", "ddpkit", "run", "-n", "1", "--max-restarts", str(spec.max_restarts),
            *target, *spec.target_args]


def replica_env(spec: FaultTolerantSpec, index: int, lighthouse: str, done: str,
                environ: Any = None) -> dict[str, str]:
    """The environment of replica ``index``.

    Args:
        spec: the job.
        index: the replica, 0 to ``spec.replicas - 1``.
        lighthouse: the lighthouse's address.
        done: the file that says the job has finished (:data:`ddpkit.dist.ft.DONE_ENV`).
        environ: the environment to start from (default: this process's).
    """
    env = dict(os.environ if environ is None else environ)
    env.update({ft.LIGHTHOUSE_ENV: lighthouse, ft.DONE_ENV: done, ft.REPLICA_ENV: str(index), ft.REPLICAS_ENV: str(spec.replicas),
                ft.MIN_REPLICAS_ENV: str(spec.min_replicas), ft.HOST_ENV: HOST,
                ft.QUORUM_TIMEOUT_ENV: str(spec.quorum_timeout_s), "GLOO_SOCKET_IFNAME": "lo"})
    env.setdefault("RUST_LOG", "warn")        # torchft's Rust side logs every quorum at info
    return env


def run(spec: FaultTolerantSpec) -> int:
    """Start the lighthouse and the replicas, wait for them; the job's exit code."""
    validate(spec)
    work = tempfile.mkdtemp(prefix="ddpkit-ft-")
    done = os.path.join(work, "done")
    lighthouse, address = start_lighthouse(spec.min_replicas)
    replicas: list[subprocess.Popen] = []
    stopping: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        stopping.append(signum)
        for child in replicas:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {number: signal.signal(number, forward) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        replicas = [subprocess.Popen(replica_command(spec), env=replica_env(spec, index, address, done))
                    for index in range(spec.replicas)]
        finished_at: float | None = None
        while any(child.poll() is None for child in replicas):
            if finished_at is None and any(child.poll() == 0 for child in replicas):
                Path(done).touch()         # a replica restarted from now on ends at once
                finished_at = time.monotonic()
            if finished_at is not None and time.monotonic() - finished_at > FINISH_GRACE_S:
                break                      # the rest are stopped below
            if lighthouse.poll() is not None:
                sys.stderr.write(f"ddpkit run: the fault-tolerant lighthouse exited (code {lighthouse.returncode}); "
                                 "stopping every replica so that none trains apart from the others\n")
                return 1                   # the replicas are stopped below
            time.sleep(0.2)
    finally:
        for number, old in previous.items():
            signal.signal(number, old)
        _stop(replicas)
        shutil.rmtree(work, ignore_errors=True)
        if lighthouse.poll() is None:
            lighthouse.terminate()
            try:
                lighthouse.wait(5)
            except subprocess.TimeoutExpired:
                lighthouse.kill()
    codes = [child.returncode for child in replicas]
    failed = [(index, code) for index, code in enumerate(codes) if code != 0]
    for index, code in failed:
        sys.stderr.write(f"ddpkit run: replica {index} ended with exit code {code}\n")
    if stopping and failed:
        return failed[0][1]
    return 0 if len(failed) < len(codes) else failed[0][1]


def _stop(children: Sequence[subprocess.Popen]) -> None:
    """SIGTERM each live replica (its agent stops its worker), SIGKILL what is left after the grace:
    the agent and its worker, which torch starts in a session of its own."""
    import psutil

    live = [child for child in children if child.poll() is None]
    family: list[Any] = []
    for child in live:
        try:
            family += psutil.Process(child.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        child.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for child in live:
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    for process in family:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except psutil.TimeoutExpired:
            process.kill()
        except psutil.NoSuchProcess:
            pass


__all__ = ["FaultTolerantSpec", "replica_command", "replica_env", "run", "start_lighthouse", "validate"]
