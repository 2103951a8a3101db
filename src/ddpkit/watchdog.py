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
import dataclasses
import datetime
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ddpkit.errors import UsageError

EXIT_HANG = 124
"""Exit code of every rank of a job the watchdog found hung (as ``timeout(1)``)."""

# Within one value of ``global_step`` (it grows at the end of ``step()``), the order in which
# a training loop crosses these boundaries: evaluation and saving come after the previous
# optimizer step, before the next batch. Unknown (user) phases rank with "eval".
PHASES = ("start", "eval", "save", "data", "forward", "backward", "optimizer")
CLOSED = "closed"

_PREFIX = "ddpkit/watchdog/"
_VERDICT, _READY, _DUMPED = _PREFIX + "verdict", _PREFIX + "ready", _PREFIX + "dumped"
_LINGER_S = 2.0          # peers of the stuck rank exit this much later, so the launcher names it
_STORE_TIMEOUT_S = 10.0
_TABLE_ROWS = 32


@dataclass(frozen=True)
class Heartbeat:
    """What one rank last published: where its main thread is, and since when.

    ``idle`` is measured on the rank's own monotonic clock when published at wall time ``time``.
    """

    rank: int
    step: int
    phase: str
    idle: float
    time: float
    host: str = ""
    pid: int = 0
    where: str = ""

    def idle_at(self, now: float) -> float:
        """Seconds without progress at wall time ``now`` (grows on if publishing stopped)."""
        return self.idle + max(0.0, now - self.time)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Heartbeat":
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Verdict:
    """The hang as decided by the first rank that saw it; every rank acts on the same one."""

    culprit: int
    reporter: int
    peers: int = 0         # live peers the culprit waits for (reported and quiet) before its stack
    silent: bool = False   # the culprit's watchdog is not running: no stack will come

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Verdict":
        return cls(**json.loads(text))


def check_timeout(hang_timeout: float | None) -> None:
    """Raise :class:`UsageError` unless ``hang_timeout`` is None or a positive number of seconds."""
    if hang_timeout is not None and not (isinstance(hang_timeout, (int, float)) and hang_timeout > 0):
        raise UsageError(f"hang_timeout must be a positive number of seconds, got {hang_timeout!r}")


def phase_order(phase: str) -> int:
    """Position of ``phase`` within one step (see :data:`PHASES`)."""
    return PHASES.index(phase) if phase in PHASES else PHASES.index("eval")


def seconds_until_hung(heartbeats: Mapping[int, Heartbeat | None], now: float, hang_timeout: float) -> float:
    """Seconds until no open rank has made progress for ``hang_timeout`` (0: the job is hung now).

    A rank with no heartbeat cannot prove progress and counts as stalled; closed ranks
    (finished, runtime closed) do not count. One rank still beating keeps the job alive:
    its peers may just be waiting for its long evaluation.
    """
    open_ranks = [b for b in heartbeats.values() if b is None or b.phase != CLOSED]
    if not open_ranks:
        return float("inf")
    return max(0.0, max(0.0 if b is None else hang_timeout - b.idle_at(now) for b in open_ranks))


def job_is_hung(heartbeats: Mapping[int, Heartbeat | None], now: float, hang_timeout: float) -> bool:
    """True when no open rank made progress for ``hang_timeout`` seconds (see :func:`seconds_until_hung`)."""
    return seconds_until_hung(heartbeats, now, hang_timeout) <= 0.0


def culprit(heartbeats: Mapping[int, Heartbeat | None], now: float, *, silent_after: float) -> int:
    """The rank that most likely caused the hang.

    First a rank whose heartbeat went silent (its process froze or died; the earliest first)
    or never came; else the live rank furthest behind: lowest step, then earliest phase
    within the step, then the longest idle (it stopped first), then the lowest rank.
    Peers blocked in a collective have reached a later phase than the rank they wait for.
    """
    def behind(item: tuple[int, Heartbeat | None]) -> tuple:
        rank, beat = item
        if beat is None:
            return (0, float("inf"), 0, 0.0, rank)
        if beat.phase == CLOSED:
            return (2, 0, 0, 0.0, rank)
        if now - beat.time > silent_after:
            return (0, beat.time, 0, 0.0, rank)
        return (1, beat.step, phase_order(beat.phase), -beat.idle_at(now), rank)

    return min(heartbeats.items(), key=behind)[0]


def format_report(heartbeats: Mapping[int, Heartbeat | None], stuck: int, now: float, *,
                  world_size: int, silent_after: float, note: str = "") -> str:
    """The lines the reporting rank prints: a one-line verdict, then where each rank is."""
    beat = heartbeats.get(stuck)
    if beat is None:
        head = f"rank {stuck} never sent a heartbeat"
    else:
        head = (f"rank {stuck} made no progress for {beat.idle_at(now):.1f}s at step {beat.step} "
                f"(phase {beat.phase})")
        if now - beat.time > silent_after:
            head += f"; its heartbeat stopped {now - beat.time:.1f}s ago (process frozen or dead)"
        elif beat.where:
            head += f" in {beat.where}"
    others = _groups({r: b for r, b in heartbeats.items() if r != stuck})
    if others:
        head += "; " + "; ".join(others)
    if len(heartbeats) < world_size:
        head += f"; the other {world_size - len(heartbeats)} rank(s) are unknown" + (f" ({note})" if note else "")
    lines = [f"ddpkit watchdog: {head}",
             f"ddpkit watchdog: the job is hung; exiting with code {EXIT_HANG}. Where each rank is:"]
    ranked = [stuck] + sorted(r for r in heartbeats if r != stuck)
    for rank in ranked[:_TABLE_ROWS]:
        lines.append("  " + _row(rank, heartbeats[rank], now, silent_after) + ("  <- stuck" if rank == stuck else ""))
    if len(ranked) > _TABLE_ROWS:
        lines.append(f"  ... and {len(ranked) - _TABLE_ROWS} more ranks (summarised above)")
    return "\n".join(lines)


def _row(rank: int, beat: Heartbeat | None, now: float, silent_after: float) -> str:
    if beat is None:
        return f"rank {rank}: no heartbeat"
    text = (f"rank {rank}: step {beat.step}, phase {beat.phase}, idle {beat.idle_at(now):.1f}s, "
            f"{beat.host} pid {beat.pid}")
    if now - beat.time > silent_after:
        text += f", heartbeat silent for {now - beat.time:.1f}s"
    return text + (f", in {beat.where}" if beat.where else "")


def _groups(heartbeats: Mapping[int, Heartbeat | None]) -> list[str]:
    """'rank 0 is at step 5 (backward)', 'ranks 2-7 are closed': ranks grouped by where they are."""
    where: dict[str, list[int]] = {}
    for rank, beat in sorted(heartbeats.items()):
        place = "" if beat is None else "closed" if beat.phase == CLOSED else f"at step {beat.step} ({beat.phase})"
        where.setdefault(place, []).append(rank)
    return [f"{_ranges(ranks)} sent no heartbeat" if not place
            else f"{_ranges(ranks)} {'is' if len(ranks) == 1 else 'are'} {place}"
            for place, ranks in where.items()]


def _ranges(ranks: list[int]) -> str:
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


class Watchdog:
    """Watches the thread that calls :meth:`start`; see the module docstring.

    ``store`` is a c10d store shared by all ranks (None: watch this rank alone).
    """

    def __init__(self, hang_timeout: float, *, rank: int = 0, world_size: int = 1, store: Any = None,
                 interval: float | None = None):
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
        self._next_look = 0.0            # monotonic time before which peers cannot all be stalled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpkit-watchdog", daemon=True)

    def beat(self, step: int, phase: str) -> None:
        """Record progress: now at ``step`` in ``phase``. One tuple store, no I/O."""
        self._last = (step, phase, time.monotonic())

    def start(self, step: int = 0) -> "Watchdog":
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
            except (RuntimeError, OSError) as exc:   # the store went away: watch this rank alone
                self._store, self._store_error = None, f"store unreachable: {exc}".splitlines()[0]
            self._stop.wait(self.interval)
        if self._store is not None:
            step, _, _ = self._last
            with contextlib.suppress(RuntimeError, OSError):
                self._store.set(_beat_key(self.rank), self._heartbeat(step, CLOSED, 0.0).to_json())

    def _heartbeat(self, step: int, phase: str, idle: float) -> Heartbeat:
        return Heartbeat(self.rank, step, phase, idle, time.time(), self._host, self._pid, self._where())

    def _tick(self) -> None:
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
            if wait > 0.0:     # a peer is still making progress: look again when it could be hung
                self._next_look = time.monotonic() + max(self.interval, min(wait, self.hang_timeout))
                return
            stuck = culprit(beats, now, silent_after=self.silent_after)
            live = [r for r, b in beats.items() if b is not None and b.phase != CLOSED
                    and now - b.time <= self.silent_after]
            verdict = self._propose(Verdict(stuck, self.rank, peers=len(set(live) - {stuck}),
                                            silent=stuck not in live))
        self._act(verdict, beats)

    def _act(self, verdict: Verdict, beats: Mapping[int, Heartbeat | None] | None) -> None:
        """Report, dump the stuck rank's stack, and exit: never returns.

        Peers report, go quiet and say so; then the stuck rank dumps its stack and exits first,
        so the launcher names it. Quiet, because once it is gone their collectives fail with
        "connection closed by peer": a consequence, not news.
        """
        if verdict.reporter == self.rank and beats is not None:
            _say(format_report(beats, verdict.culprit, time.time(), world_size=self.world_size,
                               silent_after=self.silent_after, note=self._store_error))
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
        _say(f"ddpkit watchdog: Python stack of rank {self.rank} ({self._host}, pid {self._pid}), stuck "
             f"{time.monotonic() - since:.1f}s at step {step} (phase {phase}); "
             f"the watched thread is Thread 0x{self._watched:016x}:")
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (AttributeError, ValueError, OSError):   # stderr replaced by an object without a fd
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
            pass                        # the others already left


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
    """Leave now: the main thread is blocked, so ``sys.exit`` from here would never happen."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
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
        shared = dist.distributed_c10d._get_default_store()
    except (AttributeError, ValueError, RuntimeError):
        return None
    try:
        store = shared.clone()
    except (AttributeError, RuntimeError):
        return shared
    store.set_timeout(datetime.timedelta(seconds=_STORE_TIMEOUT_S))
    return store


def watch(hang_timeout: float, *, rank: int, world_size: int, step: int = 0) -> Watchdog:
    """Start a :class:`Watchdog` over the calling thread, through the group's store if any."""
    return Watchdog(hang_timeout, rank=rank, world_size=world_size, store=group_store()).start(step)
