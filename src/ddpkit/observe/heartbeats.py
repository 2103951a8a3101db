"""What a hang looks like: each rank's heartbeat, the shared verdict, who is stuck, the report.

Pure functions of the heartbeats and a clock, so every decision the watchdog makes is tested
without threads, stores or processes; :mod:`ddpkit.observe.watchdog` runs them on a daemon thread. :func:`beat` and
:func:`watch` are how code below the runtime reports progress to it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

EXIT_HANG = 124
"""Exit code of every rank of a job the watchdog found hung (as ``timeout(1)``)."""

# Within one value of ``global_step`` (it grows at the end of ``step()``), the order in which
# a training loop crosses these boundaries: evaluation and saving come after the previous
# optimizer step, before the next batch. Unknown (user) phases rank with "eval".
PHASES = ("start", "eval", "save", "data", "forward", "backward", "optimizer")
CLOSED = "closed"

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
        """This heartbeat as a JSON object, as it is published in the store."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Heartbeat:
        """The heartbeat that :meth:`to_json` wrote."""
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Verdict:
    """The hang as decided by the first rank that saw it; every rank acts on the same one."""

    culprit: int
    reporter: int
    peers: int = 0  # live peers the culprit waits for (reported and quiet) before its stack
    silent: bool = False  # the culprit's watchdog is not running: no stack will come

    def to_json(self) -> str:
        """This verdict as a JSON object, as it is proposed in the store."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Verdict:
        """The verdict that :meth:`to_json` wrote."""
        return cls(**json.loads(text))


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


def format_report(
    heartbeats: Mapping[int, Heartbeat | None],
    stuck: int,
    now: float,
    *,
    world_size: int,
    silent_after: float,
    note: str = "",
) -> str:
    """The lines the reporting rank prints: a one-line verdict, then where each rank is.

    Args:
        heartbeats: each rank's last heartbeat by rank (None: it sent none); ranks missing are unknown.
        stuck: the rank named as stuck (:func:`culprit`), listed first.
        now: wall time (``time.time()``) the idle seconds are measured at.
        world_size: ranks of the job, to count those with no entry in ``heartbeats``.
        silent_after: seconds since a heartbeat was published after which its rank is called frozen or dead.
        note: why the unknown ranks are unknown (e.g. the store is unreachable), appended in parentheses.
    """
    beat = heartbeats.get(stuck)
    if beat is None:
        head = f"rank {stuck} never sent a heartbeat"
    else:
        head = f"rank {stuck} made no progress for {beat.idle_at(now):.1f}s at step {beat.step} (phase {beat.phase})"
        if now - beat.time > silent_after:
            head += f"; its heartbeat stopped {now - beat.time:.1f}s ago (process frozen or dead)"
        elif beat.where:
            head += f" in {beat.where}"
    others = _groups({r: b for r, b in heartbeats.items() if r != stuck})
    if others:
        head += "; " + "; ".join(others)
    if len(heartbeats) < world_size:
        head += f"; the other {world_size - len(heartbeats)} rank(s) are unknown" + (f" ({note})" if note else "")
    lines = [
        f"ddpkit watchdog: {head}",
        f"ddpkit watchdog: the job is hung; exiting with code {EXIT_HANG}. Where each rank is:",
    ]
    ranked = [stuck] + sorted(r for r in heartbeats if r != stuck)
    for rank in ranked[:_TABLE_ROWS]:
        lines.append("  " + _row(rank, heartbeats[rank], now, silent_after) + ("  <- stuck" if rank == stuck else ""))
    if len(ranked) > _TABLE_ROWS:
        lines.append(f"  ... and {len(ranked) - _TABLE_ROWS} more ranks (summarised above)")
    return "\n".join(lines)


def _row(rank: int, beat: Heartbeat | None, now: float, silent_after: float) -> str:
    if beat is None:
        return f"rank {rank}: no heartbeat"
    text = (
        f"rank {rank}: step {beat.step}, phase {beat.phase}, idle {beat.idle_at(now):.1f}s, {beat.host} pid {beat.pid}"
    )
    if now - beat.time > silent_after:
        text += f", heartbeat silent for {now - beat.time:.1f}s"
    return text + (f", in {beat.where}" if beat.where else "")


def _groups(heartbeats: Mapping[int, Heartbeat | None]) -> list[str]:
    """'rank 0 is at step 5 (backward)', 'ranks 2-7 are closed': ranks grouped by where they are."""
    where: dict[str, list[int]] = {}
    for rank, beat in sorted(heartbeats.items()):
        place = "" if beat is None else "closed" if beat.phase == CLOSED else f"at step {beat.step} ({beat.phase})"
        where.setdefault(place, []).append(rank)
    return [
        f"{_ranges(ranks)} sent no heartbeat"
        if not place
        else f"{_ranges(ranks)} {'is' if len(ranks) == 1 else 'are'} {place}"
        for place, ranks in where.items()
    ]


def _ranges(ranks: list[int]) -> str:
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


class Target(Protocol):
    """Where :func:`beat` and :func:`watch` go: the runtime of a job that runs a watchdog."""

    def heartbeat(self, phase: str) -> None:
        """Record that this rank made progress and is now in ``phase``."""

    def _watch_progress(self, probe: Callable[[], int]) -> None:
        """Count a rise of ``probe()`` as progress (samples a loader's workers read)."""


_target: Target | None = None


def beat(phase: str) -> None:
    """Tell the running job's watchdog that this rank made progress and is now in ``phase``.

    Loop and checkpoint code call it without knowing the runtime; with no watchdog it does nothing.
    """
    if _target is not None:
        _target.heartbeat(phase)


def watch(probe: Callable[[], int]) -> None:
    """Count a rise of ``probe()`` (samples a loader's workers read) as progress for the watchdog."""
    if _target is not None:
        _target._watch_progress(probe)


def set_target(target: Target | None) -> None:
    """Send :func:`beat` and :func:`watch` to ``target`` (the runtime, while its watchdog runs), or nowhere."""
    global _target
    _target = target
