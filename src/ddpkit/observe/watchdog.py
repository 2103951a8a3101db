"""Hang watchdog: name a collective mismatch or the stuck rank, show its Python stack, and fail fast.

When one rank stalls, its peers stall too, blocked in the next collective until the
collective timeout (minutes) or forever; when ranks call different collectives, they wait for
each other, fail with the backend's words, or go on with garbage. The watchdog runs by default
in every job of more than one process:

* **A collective mismatch** (a collective on some ranks only; different operations, shapes or
  dtypes; a different order) is named within seconds of the moment the ranks that will ever
  arrive have arrived: one line per rank with its n-th collective, operation, shape, dtype and
  the line of the user's script that called it (:mod:`ddpkit.observe.collectives`), then every
  rank exits with :data:`EXIT_MISMATCH` (123).
* **By default** (``hang_timeout=None``) a job is hung when a rank has waited in one collective
  longer than an adaptive timeout (``max(floor, 4 x`` the longest a collective has waited so far
  ``)``, the floor 300 s, or ``DDPKIT_HANG_FLOOR`` seconds) while a peer in its own code made
  no progress all that time. The collective is a counted call or, by torch's flight recorder, one
  in flight: DDP's gradient exchange in the backward pass, another group's, an NCCL collective
  queued. Every rank busy in its own code is never a hang.
* With ``ddpkit.init(hang_timeout=S)`` (``ddpkit train --hang-timeout S``) it is hung when no
  rank made progress for ``S`` seconds, whatever the ranks are doing. ``hang_timeout=0`` turns
  the watchdog off.

Each rank records a heartbeat at phase boundaries (``data`` when
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

from ddpkit._torch import PrivateApiChanged, default_store, on_cpp_terminate
from ddpkit.errors import UsageError, raised_at, user_line, warn
from ddpkit.observe import collectives, worker_stacks
from ddpkit.observe.heartbeats import (
    CLOSED,
    EXIT_HANG,
    EXIT_MISMATCH,
    Heartbeat,
    Verdict,
    culprit,
    find_mismatch,
    format_mismatch,
    format_report,
    seconds_until_hung,
    suspects,
    waiting_in,
)

_PREFIX = "ddpkit/watchdog/"
_VERDICT, _READY, _DUMPED = _PREFIX + "verdict", _PREFIX + "ready", _PREFIX + "dumped"
_LINGER_S = 2.0  # peers of the stuck rank exit this much later, so the launcher names it
_STORE_TIMEOUT_S = 10.0
FLOOR_S = 300.0
"""The default (adaptive) hang timeout's floor in seconds; ``DDPKIT_HANG_FLOOR`` sets another."""
_ADAPTIVE_INTERVAL_S = 1.0
_GRACE_S = 3.0  # seconds in one collective before a rank's peers are asked where they are
_GRACE_MAX_S = 15.0  # ... where collectives took long before (slow links): at most this, 2x the longest
_FINGERPRINT_EVERY_S = 5.0
_CLOSE_WAIT_S = 3.0  # how long a closing rank waits for its peers' last fingerprints


def check_timeout(hang_timeout: float | None, *, flag: str = "hang_timeout") -> None:
    """Raise :class:`UsageError` unless ``hang_timeout`` is None (adaptive), 0 (off) or a positive number of seconds.

    ``flag`` names the setting in the message (``--hang-timeout`` for ``ddpkit train``).
    """
    number = isinstance(hang_timeout, (int, float)) and not isinstance(hang_timeout, bool)
    if hang_timeout is not None and not (number and hang_timeout >= 0 and hang_timeout == hang_timeout):
        raise UsageError(
            f"{flag} must be a number of seconds >= 0 (0 turns the hang watchdog off; leave it unset for the "
            f"adaptive default), got {hang_timeout!r}"
        )


def floor_seconds() -> float:
    """The adaptive hang timeout's floor: ``DDPKIT_HANG_FLOOR`` seconds, else :data:`FLOOR_S`."""
    raw = os.environ.get("DDPKIT_HANG_FLOOR", "")
    try:
        value = float(raw) if raw else FLOOR_S
    except ValueError:
        raise UsageError(f"DDPKIT_HANG_FLOOR must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise UsageError(f"DDPKIT_HANG_FLOOR must be a positive number of seconds, got {raw!r}")
    return value


class Watchdog:
    """Watches the thread that calls :meth:`start`; see the module docstring.

    ``store`` is a c10d store shared by all ranks (None: watch this rank alone).
    """

    def __init__(
        self,
        hang_timeout: float | None,
        *,
        rank: int = 0,
        world_size: int = 1,
        store: Any = None,
        interval: float | None = None,
        log: collectives.CollectiveLog | None = None,
        device: Any = None,
    ):
        check_timeout(hang_timeout)
        self.device = device
        """This rank's device: a CUDA one is this thread's too, so that reading NCCL's flight recorder
        (which queries CUDA events) makes no context on GPU 0, a thread's default."""
        self.adaptive = hang_timeout is None
        self.floor = floor_seconds() if self.adaptive else 0.0
        self.hang_timeout = self.floor if hang_timeout is None else float(hang_timeout)
        self.rank, self.world_size = rank, world_size
        default = _ADAPTIVE_INTERVAL_S if self.adaptive else min(2.0, max(0.1, self.hang_timeout / 10))
        self.interval = interval if interval is not None else default
        self.silent_after = 3 * self.interval + 2.0
        self.log = log
        self._store = store
        self._store_error = ""
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._last: tuple[int, str, float] = (0, "start", time.monotonic())
        self._watched = threading.get_ident()
        self._next_look = 0.0  # monotonic time before which peers cannot all be stalled
        self._next_fingerprint = 0.0
        self._next_all = 0.0
        self._flight_read: tuple[float, collectives.Flight] = (0.0, collectives.Flight())
        self._flight_status: dict[str, Any] | None = None  # the recorder's counters at that read
        self._longest_flight = 0.0  # the oldest a since-ended collective was when a look last saw it in flight
        self._closed_flight: collectives.Flight | None = None
        self._failed = False
        self._acting = threading.Lock()
        self._stop = threading.Event()
        self._probes: list[list[Any]] = []  # [probe, last value]: reads in DataLoader workers
        self._thread = threading.Thread(target=self._run, name="ddpkit-watchdog", daemon=True)
        self._undo_terminate: Callable[[], None] | None = None

    def limit(self) -> float:
        """Seconds a rank may wait in one collective (adaptive) or all may go without progress (explicit)."""
        if not self.adaptive:
            return self.hang_timeout
        return max(self.floor, 4.0 * self.longest_wait())

    def longest_wait(self) -> float:
        """The longest a finished collective waited, in seconds: a counted call, or one the flight
        recorder showed in flight (DDP's gradient exchange), as old as the last look saw it."""
        counted = self.log.longest_wait if self.log is not None else 0.0
        return max(counted, self._longest_flight)

    def grace(self) -> float:
        """Seconds this rank waits in one collective before it reads every peer's heartbeat for a
        mismatch: 3, or twice the longest a collective waited so far, at most 15. On a slow link
        where each exchange takes seconds, the reads (a store read a peer, each second) then come
        only when an exchange takes longer than those before it, and a mismatch is still named
        within 30 s."""
        return min(_GRACE_MAX_S, max(_GRACE_S, 2.0 * self.longest_wait()))

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
        """Watch the calling thread from ``step`` (phase ``start``) on a daemon thread; returns self.

        With a collective log, the thread's ``torch.distributed`` collectives are counted in it.
        """
        self._watched = threading.get_ident()
        self.beat(step, "start")
        if self.log is not None:
            self.log.thread = self._watched
            self.log.on_failure = self._collective_failed
            collectives.install(self.log)
            self._undo_terminate = _on_gloo_abort(self._terminating)
        self._thread.start()
        return self

    def stop(self, *, failed: bool = False) -> None:
        """Stop watching and publish this rank as closed, so peers never blame a finished rank.

        ``failed``: the script ended by an exception, so collectives it never called are no mismatch.
        """
        self._failed = failed
        if self.log is not None:
            collectives.uninstall()
        if self._undo_terminate is not None:
            self._undo_terminate()
            self._undo_terminate = None
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + _STORE_TIMEOUT_S)
        if self.log is not None and self._store is not None and not failed:
            self._compare_at_close()

    def _compare_at_close(self) -> None:
        """Before this rank leaves: compare its whole fingerprint with the peers' as they close.

        Collectives that the backend paired up wrongly (the same bytes, another order or shape)
        end without an error; the ranks' fingerprints of every call still differ. Waits a few
        seconds at most for peers still running; one waiting in a collective this rank never
        called is named too.
        """
        step, _, since = self._last
        mine = self._heartbeat(step, CLOSED, time.monotonic() - since)
        deadline = time.monotonic() + _CLOSE_WAIT_S
        # a large job: the neighbours only (a ring of comparisons covers every rank), read less often
        near = (
            None
            if self.world_size <= 64
            else [self.rank, (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size]
        )
        pause = max(0.1, self.world_size / 640)
        try:
            while True:
                beats = self._heartbeats(mine, ranks=near)
                reason = self._mismatch(beats, grace=1.0)
                if reason is None:
                    reason = _finished_apart(beats, self.rank)
                if reason is not None:
                    if near is not None:
                        beats = self._heartbeats(mine)  # the report has a row for every rank
                    self._act(self._propose(Verdict(self.rank, self.rank, mismatch=reason)), beats)
                others = [b for r, b in beats.items() if r != self.rank]
                if all(b is not None and b.phase == CLOSED for b in others) or time.monotonic() > deadline:
                    return
                time.sleep(pause)
        except (RuntimeError, OSError):
            return  # the peers' store is gone: they left

    # -- the watchdog thread ------------------------------------------------------------
    def _run(self) -> None:
        if getattr(self.device, "type", None) == "cuda":
            import torch

            try:
                torch.cuda.set_device(self.device)
            except RuntimeError as exc:  # watch on: a flight-recorder read may then land on GPU 0
                self._store_error = f"cannot take {self.device}: {exc}".splitlines()[0]
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

    def _heartbeat(
        self, step: int, phase: str, idle: float, *, fresh: bool = False, raised: BaseException | None = None
    ) -> Heartbeat:
        """This rank's heartbeat now.

        Args:
            step, phase, idle: where the watched thread is, and for how long without progress.
            fresh: read the flight recorder now (a collective just failed).
            raised: the error the script is ending by, from a collective the log did not count.
        """
        log = self.log
        if log is None:
            return Heartbeat(self.rank, step, phase, idle, time.time(), self._host, self._pid, self._where())
        current = log.current
        marks, recent = log.snapshot()
        mark = (log.calls, log.chain) if phase == CLOSED else max(marks.items()) if marks else None
        waited = time.monotonic() - current[3] if current is not None else 0.0
        flight = collectives.Flight()
        if phase == CLOSED and not self._failed:  # the default group's last call, which peers compare
            if self._closed_flight is None:  # read once (a dump copies the recorder's ring: ~40 ms at 2000)
                self._closed_flight = collectives.Flight(last=self._flight(fresh=True).last)
            flight = self._closed_flight
        elif fresh:
            flight = self._flight(fresh=True)
        elif phase != CLOSED and (waited >= _GRACE_S or idle >= _GRACE_S):
            flight = self._flight()
        return Heartbeat(
            self.rank,
            step,
            phase,
            idle,
            time.time(),
            self._host,
            self._pid,
            self._where() if raised is None else raised_at(raised),
            calls=log.calls,
            call=current[1] if current is not None and phase != CLOSED else "",
            call_where=current[2] if current is not None else self._users_line() if flight.pending else "",
            waited=waited,
            mark=mark,
            recent=recent,
            failed=self._failed,
            flight=flight.line,
            pending=flight.pending,
            pending_for=max(0.0, time.time() - flight.since) if flight.pending else 0.0,
            pending_seq=flight.pending_seq,
            pending_call=flight.pending_call,
            flight_last=flight.last,
            raised=flight.latest if raised is not None else "",
        )

    def _flight(self, *, fresh: bool = False) -> collectives.Flight:
        """The flight recorder, looked at most once a second unless ``fresh``.

        A look reads the recorder's counters (microseconds), and its entries (a dump of the ring: 25
        to 45 ms at 2000) only where the counters changed since they were last read, or ``fresh``.
        A rank in a long phase of its own code, or waiting in one collective, reads them once."""
        now = time.monotonic()
        if now - self._flight_read[0] >= 1.0 or (fresh and self._flight_read[0] != float("inf")):
            try:
                status = collectives.flight_status()
                if fresh or status != self._flight_status or not status:
                    seen = collectives.flight()
                    before = self._flight_read[1]
                    if before.pending and seen.since != before.since:  # the oldest in flight ended
                        # since the last look, which saw it in flight: its age then (the rank may have
                        # gone on for long between two looks, so the time now would count that too)
                        looked = time.time() - (now - self._flight_read[0])
                        self._longest_flight = max(self._longest_flight, looked - before.since)
                    self._flight_read = (now, seen)
                    self._flight_status = status  # read first: a change between the two reads is read next time
                else:
                    self._flight_read = (now, self._flight_read[1])
            except PrivateApiChanged as exc:  # said once, in the report's place: loud, not fatal to the job
                self._flight_read = (float("inf"), collectives.Flight(str(exc)))
        return self._flight_read[1]

    def _tick(self) -> None:
        self._read_probes()
        step, phase, since = self._last
        mine = self._heartbeat(step, phase, time.monotonic() - since)
        if self._store is not None:
            self._store.set(_beat_key(self.rank), mine.to_json())
        verdict, beats = self._read_verdict(), None
        if verdict is None:
            found = self._look_for_mismatch(mine)
            if found is None:
                found = self._look_for_hang(mine) if not self.adaptive else self._look_for_stuck(mine)
            if found is None:
                return
            verdict, beats = found
        self._act(verdict, beats)

    def _mismatch(
        self, beats: Mapping[int, Heartbeat | None], *, grace: float = _GRACE_S, failing: bool = False
    ) -> str | None:
        """:func:`find_mismatch` over ``beats`` now, from this rank's place and fingerprints."""
        assert self.log is not None
        marks = self.log.snapshot()[0]
        return find_mismatch(
            beats, time.time(), grace=grace, silent_after=self.silent_after, marks=marks, me=self.rank, failing=failing
        )

    def _look_for_mismatch(self, mine: Heartbeat) -> tuple[Verdict, dict[int, Heartbeat | None]] | None:
        """A collective mismatch the heartbeats show, proposed as the verdict; None if none shows."""
        if self.log is None or self._store is None:
            return None
        now = time.monotonic()
        waited = mine.waited if mine.call else mine.pending_for  # a counted call, or the recorder's (DDP's)
        waiting = waited >= self.grace() and now >= self._next_all
        if waiting:  # every rank's heartbeat, at most W/64 times a second: the store serves all ranks
            self._next_all = now + max(self.interval, self.world_size / 64)
            beats = self._heartbeats(mine)
        elif now >= self._next_fingerprint:  # the next rank's fingerprint: a ring of comparisons covers all
            self._next_fingerprint = now + _FINGERPRINT_EVERY_S
            beats = self._heartbeats(mine, ranks=[self.rank, (self.rank + 1) % self.world_size])
        else:
            return None
        reason = self._mismatch(beats)
        if reason is None:
            return None
        if len(beats) < self.world_size:
            beats = self._heartbeats(mine)  # the report has a row for every rank
        return self._propose(Verdict(self.rank, self.rank, mismatch=reason)), beats

    def _look_for_hang(self, mine: Heartbeat) -> tuple[Verdict, dict[int, Heartbeat | None]] | None:
        """With ``hang_timeout=S``: no rank made progress for S seconds."""
        if mine.idle < self.hang_timeout or time.monotonic() < self._next_look:
            return None
        beats = self._heartbeats(mine)
        now = time.time()
        wait = seconds_until_hung(beats, now, self.hang_timeout)
        if wait > 0.0:  # a peer is still making progress: look again when it could be hung
            self._next_look = time.monotonic() + max(self.interval, min(wait, self.hang_timeout))
            return None
        stuck = culprit(beats, now, silent_after=self.silent_after)
        return self._blame(stuck, beats, now), beats

    def _look_for_stuck(self, mine: Heartbeat) -> tuple[Verdict, dict[int, Heartbeat | None]] | None:
        """By default: this rank waited :meth:`limit` seconds in one collective (:func:`waiting_in`:
        DDP's gradient exchange too), and a peer in its own code made no progress for the limit too,
        or its heartbeat stopped (:func:`suspects`).

        The peer's time without progress is held against the limit, not against this rank's wait: a
        peer that went on for a while after this rank began to wait, then stuck, is named once it
        has been stuck for the limit. The slack (heartbeats' delay) is at most a quarter of the
        limit, so a peer that calls ``rt.heartbeat`` each second is never blamed at a small floor."""
        limit = self.limit()
        waiting = waiting_in(mine)
        if waiting is None or waiting[0] < limit or time.monotonic() < self._next_look:
            return None
        waited, what = waiting
        self._next_look = time.monotonic() + self.interval
        beats = self._heartbeats(mine)
        now = time.time()
        slack = min(2 * self.interval, limit / 4)
        found = suspects(beats, self.rank, limit, now, silent_after=self.silent_after, slack=slack)
        if not found:
            return None  # every rank waits in a collective, or a peer progresses: no rank to blame
        stuck = culprit(found, now, silent_after=self.silent_after)
        _say(
            f"ddpkit watchdog: rank {self.rank} has waited {waited:.0f}s in {what}, "
            f"longer than the adaptive hang timeout ({limit:.0f}s)"
        )
        return self._blame(stuck, beats, now), beats

    def _blame(self, stuck: int, beats: Mapping[int, Heartbeat | None], now: float) -> Verdict:
        live = [
            r for r, b in beats.items() if b is not None and b.phase != CLOSED and now - b.time <= self.silent_after
        ]
        return self._propose(Verdict(stuck, self.rank, peers=len(set(live) - {stuck}), silent=stuck not in live))

    def _collective_failed(self, raised: BaseException | None = None) -> None:
        """On the main thread, when a collective raised: end the job with the mismatch report if the
        peers' heartbeats show one within a few seconds, else return (the error goes on up).

        ``raised``: the error, where it came from a call the log did not count (:meth:`uncaught`)."""
        store = _own_connection(self._store) if self._store is not None else None
        if store is None or self.log is None:
            return
        deadline = time.monotonic() + max(4.0, 2 * self.interval + 2.0)
        try:
            step, phase, since = self._last
            mine = self._heartbeat(step, phase, time.monotonic() - since, fresh=True, raised=raised)
            store.set(_beat_key(self.rank), mine.to_json())
            while time.monotonic() < deadline:
                verdict = self._read_verdict(store)
                beats = self._heartbeats(mine, store)
                if verdict is None:
                    reason = self._mismatch(beats, failing=True)
                    if reason is not None:
                        verdict = self._propose(Verdict(self.rank, self.rank, mismatch=reason), store)
                if verdict is not None and verdict.mismatch:
                    self._act(verdict, beats)
                time.sleep(0.2)
        except (RuntimeError, OSError):
            return  # the store is gone with the peers: nothing more to learn

    def _terminating(self) -> None:
        """torch's C++ is ending this process (:func:`_on_gloo_abort`), in a thread of its own: before it
        aborts, end the job with the mismatch report if the peers' heartbeats show one. Not in a process
        forked from the rank (a DataLoader worker), which inherits the hook but is not the rank."""
        if not self._stop.is_set() and os.getpid() == self._pid:
            self._collective_failed()

    def uncaught(self, error: BaseException) -> None:
        """The script is ending by ``error``: where a backend raised it because a peer left (a call the
        log does not count, such as DDP's gradient exchange), end the job with the mismatch report if
        the heartbeats show one within a few seconds; else return, and the error is printed as usual."""
        if threading.get_ident() == self._watched and _backend_failure(error):
            self._collective_failed(error)

    def _act(self, verdict: Verdict, beats: Mapping[int, Heartbeat | None] | None) -> None:
        """Report, dump the stuck rank's stack, and exit: never returns.

        Peers report, go quiet and say so; then the stuck rank dumps its stack and exits first,
        so the launcher names it. Quiet, because once it is gone their collectives fail with
        "connection closed by peer": a consequence, not news. A mismatch: the reporter prints it
        and exits first; the others go quiet and follow.
        """
        if not self._acting.acquire(blocking=False):
            while True:  # the other thread of this rank acts already and ends the process
                time.sleep(1.0)
        if verdict.mismatch:
            if verdict.reporter == self.rank and beats is not None:
                _say(
                    format_mismatch(
                        beats,
                        time.time(),
                        verdict.mismatch,
                        world_size=self.world_size,
                        silent_after=self.silent_after,
                    )
                )
            else:
                _silence()
                time.sleep(_LINGER_S)
            _exit(EXIT_MISMATCH)
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
            frame = sys._current_frames().get(self._watched)
            iterator = _waits_for_workers(frame) if frame is not None else None
            if iterator is not None:  # the read that hangs is in a worker of that DataLoader
                worker_stacks.dump(iterator, _say)
            self._tell(lambda store: store.set(_DUMPED, str(self.rank)))
        else:
            _silence()
            self._tell(lambda store: store.add(_READY, 1))
            if not verdict.silent:
                self._await(lambda: self._store.check([_DUMPED]))
            time.sleep(_LINGER_S)
        _exit(EXIT_HANG)

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

    def _users_line(self) -> str:
        """The line of the user's script the watched thread is in now (see :func:`user_line`)."""
        frame = sys._current_frames().get(self._watched)
        return user_line(frame) if frame is not None else ""

    def _where(self) -> str:
        """Where the watched thread is: its innermost frame, the user's line that led there where that is
        another, and whether it waits for a batch from DataLoader workers (the frame is then a select's)."""
        frame = sys._current_frames().get(self._watched)
        if frame is None:
            return ""
        text = f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"
        users = user_line(frame)
        if users and not os.path.abspath(frame.f_code.co_filename) == os.path.abspath(users.rpartition(":")[0]):
            text += f" from {users}"
        if _waits_for_workers(frame) is not None:
            text += ", waiting for a batch from its DataLoader workers"
        return text

    # -- the store ----------------------------------------------------------------------
    def _heartbeats(
        self, mine: Heartbeat, store: Any = None, ranks: list[int] | None = None
    ) -> dict[int, Heartbeat | None]:
        """Every rank's last heartbeat (or those of ``ranks``), this rank's being ``mine``."""
        store = store if store is not None else self._store
        if store is None:
            return {self.rank: mine}
        ranks = list(range(self.world_size)) if ranks is None else sorted(set(ranks))
        keys = [_beat_key(rank) for rank in ranks]
        if store.check(keys):
            raw = store.multi_get(keys)
        else:
            raw = [store.get(key) if store.check([key]) else None for key in keys]
        beats = {rank: None if value is None else Heartbeat.from_json(value) for rank, value in zip(ranks, raw)}
        beats[self.rank] = mine
        return beats

    def _read_verdict(self, store: Any = None) -> Verdict | None:
        store = store if store is not None else self._store
        if store is None or not store.check([_VERDICT]):
            return None
        return Verdict.from_json(store.get(_VERDICT))

    def _propose(self, verdict: Verdict, store: Any = None) -> Verdict:
        """Our verdict, unless another rank's came first (then theirs)."""
        store = store if store is not None else self._store
        if store is None:
            return verdict
        return Verdict.from_json(store.compare_set(_VERDICT, "", verdict.to_json()))

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


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
"""gloo's words when a peer's process left in a collective."""


def _backend_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective's failure: torch's ``DistBackendError`` (NCCL), or gloo's peer gone."""
    import torch.distributed as dist

    backend_error = getattr(dist, "DistBackendError", None)
    if backend_error is not None and isinstance(error, backend_error):
        return True
    return isinstance(error, RuntimeError) and any(words in str(error) for words in _PEER_GONE)


def _on_gloo_abort(handler: Callable[[], None]) -> Callable[[], None] | None:
    """Run ``handler`` before torch's C++ aborts this process, where the default group is gloo's; returns
    the undo, or None (another backend, or a C++ runtime ddpkit cannot reach, said once).

    gloo checks each message's size against the receiving buffer in its transport thread and, where
    ranks called collectives of different sizes, throws there ("Received data size doesn't match
    expected size"): an exception no frame catches, which ends the process before any Python runs.
    Not on NCCL, whose watchdog thread ends a timed-out process the same way on purpose, and
    where the main thread may hold the GIL while it waits on the GPU (``loss.item()``): the handler
    needs the GIL, so it would keep that process alive.
    """
    import torch.distributed as dist

    if "gloo" not in str(dist.get_backend()):
        return None
    try:
        return on_cpp_terminate(handler)
    except PrivateApiChanged as exc:
        warn(f"{exc}: a rank that gloo aborts is not named in a mismatch report")
        return None


def _finished_apart(beats: Mapping[int, Heartbeat | None], me: int) -> str | None:
    """Two ranks that finished (not failed) after different collectives, or None."""
    mine = beats.get(me)
    if mine is None or mine.mark is None:
        return None
    for peer, other in sorted(beats.items()):
        if peer == me or other is None or other.phase != CLOSED or other.failed or other.mark is None:
            continue
        if other.calls != mine.calls:
            return f"rank {me} finished after {mine.calls} collectives, rank {peer} after {other.calls}"
        if other.mark != mine.mark:
            return (
                f"ranks {me} and {peer} both finished after {mine.calls} collectives, but not the same ones: "
                "the backend paired up different collectives"
            )
    return None


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


def _exit(code: int) -> None:
    """Leave now: the main thread is blocked, so ``sys.exit`` from here would never happen.

    Our own children (DataLoader workers) go first: a worker blocked writing a batch, or still
    reading, would otherwise outlive us holding the launcher's pipes open.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        import psutil
    except ImportError:  # (make gpu-check's image may lack it: the children's own parent watch ends them)
        os._exit(code)
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    os._exit(code)


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
    return _own_connection(shared)


def _own_connection(store: Any) -> Any:
    """A clone of ``store`` with the watchdog's timeout: a connection no other thread blocks
    (``store`` itself where it cannot be cloned)."""
    try:
        own = store.clone()
    except (AttributeError, RuntimeError):
        return store
    own.set_timeout(datetime.timedelta(seconds=_STORE_TIMEOUT_S))
    return own


def watch(
    hang_timeout: float | None, *, rank: int, world_size: int, step: int = 0, device: Any = None
) -> Watchdog | None:
    """Start a :class:`Watchdog` over the calling thread, through the group's store if any.

    Args:
        hang_timeout: seconds without progress on every rank after which the job is hung; None:
            the adaptive default (a job of one process has no collective to wait in: no watchdog);
            0: no watchdog.
        rank: this process's global rank.
        world_size: processes of the job.
        step: the optimizer step the watch starts at.
        device: this rank's device (a CUDA one becomes the watching thread's).
    """
    check_timeout(hang_timeout)
    if hang_timeout == 0 or (hang_timeout is None and world_size < 2):
        return None
    store = group_store()
    log = collectives.CollectiveLog() if store is not None and world_size > 1 else None
    return Watchdog(hang_timeout, rank=rank, world_size=world_size, store=store, log=log, device=device).start(step)


def _waits_for_workers(frame: Any) -> Any:
    """The DataLoader iterator whose workers' queue ``frame`` or a caller waits on (torch's ``_get_data``), if any."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in ("_try_get_data", "_get_data") and code.co_filename.endswith("dataloader.py"):
            return frame.f_locals.get("self", frame)
        frame = frame.f_back
    return None
