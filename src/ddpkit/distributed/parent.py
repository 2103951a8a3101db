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

__all__ = ["LAUNCHER_PID_ENV", "die_with_launcher", "launcher_env"]

LAUNCHER_PID_ENV = "DDPKIT_LAUNCHER_PID"
"""The environment variable naming the process that started this worker."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def launcher_env() -> dict[str, str]:
    """The variable a launcher sets for its workers: its own pid."""
    return {LAUNCHER_PID_ENV: str(os.getpid())}


def die_with_launcher() -> None:
    """Have the kernel SIGKILL this worker when the launcher that started it dies (Linux; a no-op elsewhere
    and where no ddpkit launcher started it).

    Raises:
        OSError: prctl refused the request (it never does on Linux for a valid signal).
    """
    parent = os.environ.get(LAUNCHER_PID_ENV)
    if not parent or not sys.platform.startswith("linux") or os.getppid() != int(parent):
        return  # not a ddpkit launcher's own child (a wrapper in between started it): nothing to ask
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != int(parent):  # the launcher died between the check and prctl: leave as if killed
        os._exit(128 + int(signal.SIGKILL))
