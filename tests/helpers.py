"""Run ddpkit and scripts in subprocesses that never outlive their test."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent


def master_port() -> int:
    """A free port below the kernel's ephemeral range, for a master that binds seconds later.

    A port from ``free_port()`` lies in the ephemeral range, so an outgoing connection made while
    the agents import torch can take it first; the kernel never hands out ports below that range.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port below {low}")


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without launcher variables, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
        and not k.startswith(("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_"))
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(
    cmd: list[str], *, timeout: float = 120, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None
) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on timeout kill the whole session and fail loudly."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or clean_env(),
        cwd=cwd or ROOT,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd} timed out after {timeout}s\nstdout:\n{out}\nstderr:\n{err}") from None
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, every descendant (torch's workers start their own sessions) and its group."""
    import psutil

    try:
        root = psutil.Process(pid)
        family = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        family = []
    for process in family:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def ddpkit(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """Run the ``ddpkit`` console script of this environment.

    Where ddpkit is not installed (``make gpu-check`` imports it from ``src`` on an image that only
    has torch), ``python -m ddpkit`` runs the same entry point.
    """
    script = BIN / "ddpkit"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "ddpkit"]
    return run([*command, *args], **kwargs)


def python(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return run([sys.executable, *args], **kwargs)


def wait_for(condition, *, timeout: float, what: str, every: float = 0.1) -> None:
    """Poll ``condition()`` until it holds; fail the test naming ``what`` after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not there after {timeout:.0f} s")
        time.sleep(every)
