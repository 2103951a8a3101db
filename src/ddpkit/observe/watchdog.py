"""Hang watchdog: name the stuck rank, show its Python stack, and fail fast.

When one rank stalls, its peers stall too, blocked in the next collective until the
collective timeout (minutes) or forever. With ``ddpkit.init(hang_timeout=S)`` (``ddpkit
train --hang-timeout S``) each rank records a heartbeat at phase boundaries (``data`` when
the loader hands out a batch, ``backward``, ``optimizer``, ``save``, ``eval`` and any
:meth:`Runtime.heartbeat`), and a daemon thread publishes it through the process group's
store every ``S / 10`` seconds (0.1 to 2). When no rank has made progress for ``S`` seconds:

* one rank prints where every rank is (step, phase, seconds idle, host, pid, innermost frame),
  naming the rank furthest behind as the stuck one;
* the stuck rank prints its own Python stack (``faulthandler``, every thread);
* every rank exits with :data:`EXIT_HANG` (124, as ``timeout(1)``), the stuck one first, so
  torchrun's agent restarts the group (``--max-restarts``) or the job fails at once.

The main thread only stores a tuple per beat: no store traffic on the hot path. ``S`` must
exceed the longest stretch without a beat: one step, an evaluation, a checkpoint save, and
the setup before the first batch. In a world of one (no process group) the watchdog still
watches its own main thread and reports it alone. A rank whose main thread holds the GIL
forever cannot run its watchdog; its heartbeat goes silent and its peers name it.

Example (a long stretch of your own can count as progress):
    >>> rt = ddpkit.init(hang_timeout=300)       # doctest: +SKIP
    >>> rt.heartbeat("eval")                     # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ddpkit._torch import default_store
from ddpkit.errors import UsageError
from ddpkit.observe.heartbeats import CLOSED, EXIT_HANG, Heartbeat, Verdict, culprit, format_report, seconds_until_hung

_PREFIX = "ddpkit/watchdog/"
_VERDICT, _READY, _DUMPED = _PREFIX + "verdict", _PREFIX + "ready", _PREFIX + "dumped"
_LINGER_S = 2.0  # peers of the stuck rank exit this much later, so the launcher names it
_STORE_TIMEOUT_S = 10.0


def check_timeout(hang_timeout: float | None, *, flag: str = "hang_timeout") -> None:
    """Raise :class:`UsageError` unless ``hang_timeout`` is None or a positive number of seconds.

    ``flag`` names the setting in the message (``--hang-timeout`` for ``ddpkit train``).
    """
    if hang_timeout is not None and not (isinstance(hang_timeout, (int, float)) and hang_timeout > 0):
        raise UsageError(f"{flag} must be a positive number of seconds, got {hang_timeout!r}")


class Watchdog:
    """Watches the thread that calls :meth:`start`; see the module docstring.

    ``store`` is a c10d store shared by all ranks (None: watch this rank alone).
    """

    def __init__(
        self,
        hang_timeout: float,
        *,
        rank: int = 0,
        world_size: int = 1,
        store: Any = None,
        interval: float | None = None,
    ):
        check_timeout(hang_timeout)
        self.hang_timeout = float(hang_timeout)
        self.rank, self.world_size = rank, world_size
        self.interval = interval if interval is not None else min(2.0, max(0.1, self.hang_timeout / 10))
        self.silent_after = 3 * self.interval + 2.0
        self._store = store
        self._store_error = ""
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._last: tuple[int, str, float] = (0, "start", time.monotonic())
        self._watched = threading.get_ident()
        self._next_look = 0.0  # monotonic time before which peers cannot all be stalled
        self._stop = threading.Event()
        self._probes: list[list[Any]] = []  # [probe, last value]: reads in DataLoader workers
        self._thread = threading.Thread(target=self._run, name="ddpkit-watchdog", daemon=True)

    def beat(self, step: int, phase: str) -> None:
        """Record progress: now at ``step`` in ``phase``. One tuple store, no I/O."""
        self._last = (step, phase, time.monotonic())

    def add_probe(self, probe: Callable[[], int]) -> None:
        """Count a rise of ``probe()`` as progress in phase ``data`` (a stream read in workers)."""
        self._probes.append([probe, probe()])

    def _read_probes(self) -> None:
        for entry in self._probes:
            value = entry[0]()
            if value != entry[1]:
                entry[1] = value
                self._last = (self._last[0], "data", time.monotonic())

    def start(self, step: int = 0) -> Watchdog:
        """Watch the calling thread from ``step`` (phase ``start``) on a daemon thread; returns self."""
        self._watched = threading.get_ident()
        self.beat(step, "start")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching and publish this rank as closed, so peers never blame a finished rank."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + _STORE_TIMEOUT_S)

    # -- the watchdog thread ------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except (RuntimeError, OSError) as exc:  # the store went away: watch this rank alone
                self._store, self._store_error = None, f"store unreachable: {exc}".splitlines()[0]
            self._stop.wait(self.interval)
        if self._store is not None:
            step, _, _ = self._last
            with contextlib.suppress(RuntimeError, OSError):
                self._store.set(_beat_key(self.rank), self._heartbeat(step, CLOSED, 0.0).to_json())

    def _heartbeat(self, step: int, phase: str, idle: float) -> Heartbeat:
        return Heartbeat(self.rank, step, phase, idle, time.time(), self._host, self._pid, self._where())

    def _tick(self) -> None:
        self._read_probes()
        step, phase, since = self._last
        mine = self._heartbeat(step, phase, time.monotonic() - since)
        if self._store is not None:
            self._store.set(_beat_key(self.rank), mine.to_json())
        if mine.idle < self.hang_timeout:
            return
        verdict, beats = self._read_verdict(), None
        if verdict is None:
            if time.monotonic() < self._next_look:
                return
            beats = self._heartbeats(mine)
            now = time.time()
            wait = seconds_until_hung(beats, now, self.hang_timeout)
            if wait > 0.0:  # a peer is still making progress: look again when it could be hung
                self._next_look = time.monotonic() + max(self.interval, min(wait, self.hang_timeout))
                return
            stuck = culprit(beats, now, silent_after=self.silent_after)
            live = [
                r for r, b in beats.items() if b is not None and b.phase != CLOSED and now - b.time <= self.silent_after
            ]
            verdict = self._propose(Verdict(stuck, self.rank, peers=len(set(live) - {stuck}), silent=stuck not in live))
        self._act(verdict, beats)

    def _act(self, verdict: Verdict, beats: Mapping[int, Heartbeat | None] | None) -> None:
        """Report, dump the stuck rank's stack, and exit: never returns.

        Peers report, go quiet and say so; then the stuck rank dumps its stack and exits first,
        so the launcher names it. Quiet, because once it is gone their collectives fail with
        "connection closed by peer": a consequence, not news.
        """
        if verdict.reporter == self.rank and beats is not None:
            _say(
                format_report(
                    beats,
                    verdict.culprit,
                    time.time(),
                    world_size=self.world_size,
                    silent_after=self.silent_after,
                    note=self._store_error,
                )
            )
        if verdict.culprit == self.rank:
            self._await(lambda: int(self._store.add(_READY, 0)) >= verdict.peers)
            self._dump_stack()
            self._tell(lambda store: store.set(_DUMPED, str(self.rank)))
        else:
            _silence()
            self._tell(lambda store: store.add(_READY, 1))
            if not verdict.silent:
                self._await(lambda: self._store.check([_DUMPED]))
            time.sleep(_LINGER_S)
        _exit()

    def _dump_stack(self) -> None:
        step, phase, since = self._last
        _say(
            f"ddpkit watchdog: Python stack of rank {self.rank} ({self._host}, pid {self._pid}), stuck "
            f"{time.monotonic() - since:.1f}s at step {step} (phase {phase}); "
            f"the watched thread is Thread 0x{self._watched:016x}:"
        )
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (AttributeError, ValueError, OSError):  # stderr replaced by an object without a fd
            faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)

    def _where(self) -> str:
        frame = sys._current_frames().get(self._watched)
        if frame is None:
            return ""
        return f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"

    # -- the store ----------------------------------------------------------------------
    def _heartbeats(self, mine: Heartbeat) -> dict[int, Heartbeat | None]:
        if self._store is None:
            return {self.rank: mine}
        keys = [_beat_key(rank) for rank in range(self.world_size)]
        if self._store.check(keys):
            raw = self._store.multi_get(keys)
        else:
            raw = [self._store.get(key) if self._store.check([key]) else None for key in keys]
        beats = {rank: None if value is None else Heartbeat.from_json(value) for rank, value in enumerate(raw)}
        beats[self.rank] = mine
        return beats

    def _read_verdict(self) -> Verdict | None:
        if self._store is None or not self._store.check([_VERDICT]):
            return None
        return Verdict.from_json(self._store.get(_VERDICT))

    def _propose(self, verdict: Verdict) -> Verdict:
        """Our verdict, unless another rank's came first (then theirs)."""
        if self._store is None:
            return verdict
        return Verdict.from_json(self._store.compare_set(_VERDICT, "", verdict.to_json()))

    def _tell(self, send: Callable[[Any], Any]) -> None:
        """One store write; it may fail once the others have left."""
        with contextlib.suppress(RuntimeError, OSError):
            if self._store is not None:
                send(self._store)

    def _await(self, done: Callable[[], bool]) -> None:
        """Poll the store until ``done()``, for a few seconds at most; a store gone ends it.

        Polled, since a timed-out store wait logs C++ warnings.
        """
        deadline = time.monotonic() + max(5.0, 3 * self.interval)
        try:
            while self._store is not None and time.monotonic() < deadline and not done():
                time.sleep(0.05)
        except (RuntimeError, OSError):
            pass  # the others already left


def _beat_key(rank: int) -> str:
    return f"{_PREFIX}heartbeat/{rank}"


def _say(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _silence() -> None:
    """Send this process's further stdout and stderr to /dev/null."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)


def _exit() -> None:
    """Leave now: the main thread is blocked, so ``sys.exit`` from here would never happen.

    Our own children (DataLoader workers) go first: a worker blocked writing a batch, or still
    reading, would otherwise outlive us holding the launcher's pipes open.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    import psutil

    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    os._exit(EXIT_HANG)


def group_store() -> Any | None:
    """Our own connection to the default process group's store, or None without a group.

    Under torchrun that is the agent's TCPStore. A clone, so a main thread blocked inside the
    store (e.g. NCCL's lazy communicator set-up) cannot block the watchdog.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None

    try:
        shared = default_store()  # a changed private API raises PrivateApiChanged: loud
    except (ValueError, RuntimeError):
        return None
    try:
        store = shared.clone()
    except (AttributeError, RuntimeError):
        return shared
    store.set_timeout(datetime.timedelta(seconds=_STORE_TIMEOUT_S))
    return store


def watch(hang_timeout: float, *, rank: int, world_size: int, step: int = 0) -> Watchdog:
    """Start a :class:`Watchdog` over the calling thread, through the group's store if any.

    Args:
        hang_timeout: seconds without progress on every rank after which the job is hung.
        rank: this process's global rank.
        world_size: processes of the job.
        step: the optimizer step the watch starts at.
    """
    return Watchdog(hang_timeout, rank=rank, world_size=world_size, store=group_store()).start(step)
