"""Workers that end with their launcher: a launcher killed by any signal leaves no orphan behind.

``ddpkit run`` (torch's elastic agent runs in its process) and :func:`ddpkit.launch` start their
workers with :data:`LAUNCHER_PID_ENV` naming themselves. A worker of ddpkit's entry points asks
Linux for the parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``): when the launcher dies
(the OOM killer, a scheduler's SIGKILL after SIGTERM, a closed terminal), the kernel kills the
worker, which would otherwise stay blocked in a collective with no one left to wait for it. A
launcher that died while the worker asked (the race around ``prctl``) shows as another parent pid,
and the worker leaves at once. A worker whose parent is not the launcher named (a wrapper process
in between) asks nothing, and nothing changes elsewhere than Linux.

Example:
    >>> import os
    >>> launcher_env() == {LAUNCHER_PID_ENV: str(os.getpid())}
    True
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

__all__ = ["LAUNCHER_PID_ENV", "die_with_launcher", "launcher_env"]

LAUNCHER_PID_ENV = "DDPKIT_LAUNCHER_PID"
"""The environment variable naming the process that started this worker."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def launcher_env() -> dict[str, str]:
    """The variable a launcher sets for its workers: its own pid."""
    return {LAUNCHER_PID_ENV: str(os.getpid())}


def die_with_launcher(*, through_forkserver: bool = False) -> None:
    """Have the kernel SIGKILL this worker when the launcher that started it dies (Linux; a no-op elsewhere
    and where no ddpkit launcher started it).

    Args:
        through_forkserver: this worker is a child of the launcher's multiprocessing forkserver.
            The server outlives the launcher while any of its children lives, so the worker
            watches the launcher itself: a daemon thread waits on a pidfd of it, and SIGKILLs the
            worker when it exits.

    Raises:
        OSError: prctl refused the request (it never does on Linux for a valid signal).
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    if through_forkserver and parent != int(launcher) and _parent_of(parent) == int(launcher):
        _watch(int(launcher))
        return
    if parent != int(launcher):
        return  # not a ddpkit launcher's own child (a wrapper in between started it): nothing to ask
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != parent:  # the parent died between the check and prctl: leave as if killed
        os._exit(128 + int(signal.SIGKILL))


def _watch(launcher: int) -> None:
    """SIGKILL this process when ``launcher`` exits, from a daemon thread (a pidfd, else a 0.5 s poll)."""
    import select
    import threading

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    try:
        pidfd = os.pidfd_open(launcher)
    except ProcessLookupError:
        die()  # gone already
    except OSError:  # no pidfd on this kernel (Linux < 5.3): poll

        def poll() -> None:
            while _parent_of(launcher) is not None:
                time.sleep(0.5)
            die()

        threading.Thread(target=poll, name="ddpkit-launcher-watch", daemon=True).start()
        return

    def wait() -> None:
        select.select([pidfd], [], [])
        die()

    threading.Thread(target=wait, name="ddpkit-launcher-watch", daemon=True).start()


def _parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` from ``/proc`` (None where it cannot be read)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state": the parent pid
