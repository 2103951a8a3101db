"""The Python stacks of a rank's DataLoader workers, for the watchdog's report of a rank stuck waiting on them.

A rank whose main thread waits for a batch shows only a ``select`` in torch's DataLoader; the read that
hangs (a dead network mount, a deadlock in a decoding library) is in a worker. Each worker of
``rt.loader`` listens for :data:`SIGNAL` with :mod:`faulthandler` (:func:`listen`, at its start; it is
ignored until then, :func:`starting_workers`), and the watchdog of a rank it names as stuck asks the
workers of the loader its main thread waits on for their stacks (:func:`dump`), which they write to the
rank's standard error.

Example:
    >>> class Loader:
    ...     def reading(self):
    ...         return None
    >>> keep = Loader()
    >>> add(keep)
    >>> dump(object(), print)
    ddpkit watchdog: this rank waits on a DataLoader that is not one of rt.loader's, whose workers cannot be asked for their stacks
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ddpkit._torch import PrivateApiChanged, dataloader_worker_pids

SIGNAL: int | None = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else getattr(signal, "SIGUSR2", None)
"""What a worker dumps its stacks on: a real-time signal, which neither a scheduler (SLURM's ``--signal``,
submitit's SIGUSR2) nor anything else of a training job sends."""

_WAIT_S = 3.0
"""How long the watchdog lets the workers write their stacks, all of them (one after another)."""


class Source(Protocol):
    """A loader of ``rt.loader`` whose workers listen (:func:`listen`)."""

    def reading(self) -> Any:
        """The DataLoader iterator of its current pass (None: none)."""
        ...


_SOURCES: weakref.WeakSet[Any] = weakref.WeakSet()


def listen() -> None:
    """In a DataLoader worker: dump every thread's stack to standard error on :data:`SIGNAL` (never raises:
    a worker that cannot listen reads on)."""
    if SIGNAL is None:
        return
    for stream in (sys.stderr, sys.__stderr__):
        try:
            faulthandler.register(SIGNAL, file=stream, all_threads=True)
            return
        except (AttributeError, ValueError, OSError, RuntimeError):  # no file descriptor behind it
            continue


@contextlib.contextmanager
def starting_workers() -> Iterator[None]:
    """Around the start of a pass's workers: :data:`SIGNAL` ignored in them until :func:`listen` (a worker
    asked before it listens, still unpickling its dataset under spawn, reads on rather than end)."""
    if SIGNAL is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(SIGNAL)
    if before is not signal.SIG_DFL:
        yield
        return
    signal.signal(SIGNAL, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(SIGNAL, before)


def add(source: Source) -> None:
    """Count ``source``'s workers among those that listen (held weakly: a loader dropped leaves)."""
    _SOURCES.add(source)


def dump(iterator: Any, say: Callable[[str], None]) -> None:
    """Ask the workers of ``iterator``, the DataLoader iterator the main thread waits on, for their stacks,
    each after a line that names it; where ``iterator`` is not one of ``rt.loader``'s, say so."""
    if not any(source.reading() is iterator for source in list(_SOURCES)):
        say(
            "ddpkit watchdog: this rank waits on a DataLoader that is not one of rt.loader's, whose workers "
            "cannot be asked for their stacks"
        )
        return
    try:
        pids = dataloader_worker_pids(iterator)
    except PrivateApiChanged as exc:
        say(f"ddpkit watchdog: this rank's DataLoader workers cannot be listed: {exc}")
        return
    if SIGNAL is None:
        return
    for number, pid in enumerate(pids):
        say(f"ddpkit watchdog: Python stack of this rank's DataLoader worker {number + 1} of {len(pids)} (pid {pid}):")
        try:
            os.kill(pid, SIGNAL)
        except OSError as exc:  # it ended meanwhile
            say(f"ddpkit watchdog: worker pid {pid} could not be asked: {exc.strerror or exc}")
            continue
        time.sleep(min(0.5, _WAIT_S / len(pids)))
