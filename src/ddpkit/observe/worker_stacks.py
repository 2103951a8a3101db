"""The Python stacks of a rank's DataLoader workers, for the watchdog's report of a rank stuck waiting on them.

A rank whose main thread waits for a batch shows only a ``select`` in torch's DataLoader; the read that
hangs (a dead network mount, a deadlock in a decoding library) is in a worker. Each worker of
``rt.loader`` listens for :data:`SIGNAL` with :mod:`faulthandler` (:func:`listen`, at its start), and the
watchdog of a rank it names as stuck asks its loaders' live workers for their stacks (:func:`dump`),
which they write to the rank's standard error.

Example:
    >>> class Loader:
    ...     def worker_pids(self):
    ...         return []
    >>> keep = Loader()
    >>> add(keep)
    >>> dump(print)
    False
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from ddpkit._torch import PrivateApiChanged

SIGNAL: int | None = getattr(signal, "SIGUSR2", None)
"""What a worker dumps its stack on (a signal nothing else of a training job's sends a worker)."""

_WAIT_S = 0.5
"""How long the watchdog lets one worker write its stack before it asks the next."""


class Source(Protocol):
    """A loader whose live workers' pids can be listed."""

    def worker_pids(self) -> list[int]:
        """The pids of its live DataLoader workers."""
        ...


_SOURCES: weakref.WeakSet[Any] = weakref.WeakSet()


def listen() -> None:
    """In a DataLoader worker: dump every thread's stack to standard error on :data:`SIGNAL`."""
    if SIGNAL is None:
        return
    try:
        faulthandler.register(SIGNAL, file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):  # stderr replaced by an object without a file descriptor
        faulthandler.register(SIGNAL, file=sys.__stderr__, all_threads=True)


def add(source: Source) -> None:
    """Count ``source``'s workers among this process's (held weakly: a loader dropped leaves)."""
    _SOURCES.add(source)


def dump(say: Callable[[str], None]) -> bool:
    """Ask every live worker of this process's loaders for its stack, each after a line that names it.

    Returns:
        Whether any worker was asked.
    """
    pids: list[int] = []
    for source in list(_SOURCES):
        try:
            pids += source.worker_pids()
        except PrivateApiChanged as exc:
            say(f"ddpkit watchdog: this rank's DataLoader workers cannot be listed: {exc}")
    if SIGNAL is None or not pids:
        return False
    for number, pid in enumerate(pids):
        say(f"ddpkit watchdog: Python stack of this rank's DataLoader worker {number + 1} of {len(pids)} (pid {pid}):")
        try:
            os.kill(pid, SIGNAL)
        except OSError as exc:  # it ended meanwhile
            say(f"ddpkit watchdog: worker pid {pid} could not be asked: {exc.strerror or exc}")
            continue
        time.sleep(_WAIT_S)
    return True
