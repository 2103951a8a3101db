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

from ddpkit.errors import EXIT_HANG, EXIT_MISMATCH
from ddpkit.observe.collectives import EVAL_FORWARD

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
    calls: int = 0  # collectives this rank started on the default group (ddpkit.observe.collectives)
    call: str = ""  # the signature of the one it waits in ("" none), its number is ``calls``
    call_where: str = ""  # the user's line that called it (or is in the recorder's ``pending``)
    waited: float = 0.0  # seconds it had waited in it when published
    mark: tuple[int, int] | None = None  # (call number, fingerprint of the calls up to it)
    recent: tuple[tuple[int, str, str], ...] = ()  # its last few calls: (number, signature, user line)
    failed: bool = False  # closed by an exception, not a finished script
    flight: str = ""  # torch's flight recorder in a line, when the rank waits or makes no progress
    pending: str = ""  # the oldest collective in flight by that recorder (DDP's exchange too), when it makes none
    pending_for: float = 0.0  # seconds that one had been in flight when published
    pending_seq: int = 0  # by the recorder, the default group's collective in flight: its number (0 none)
    flight_last: int = 0  # and the number of its last recorded one (0 none)
    pending_call: str = ""  # and the one in flight as "name sizes dtypes"
    raised: str = ""  # the collective that just raised in its script (a peer left), by the recorder, in words

    def waited_at(self, now: float) -> float:
        """Seconds in the collective it waits in at wall time ``now`` (0 when in none)."""
        return self.waited + max(0.0, now - self.time) if self.call else 0.0

    def pending_at(self, now: float) -> float:
        """Seconds the flight recorder's oldest collective in flight has been at wall time ``now`` (0: none)."""
        return self.pending_for + max(0.0, now - self.time) if self.pending else 0.0

    def idle_at(self, now: float) -> float:
        """Seconds without progress at wall time ``now`` (grows on if publishing stopped)."""
        return self.idle + max(0.0, now - self.time)

    def to_json(self) -> str:
        """This heartbeat as a JSON object, as it is published in the store."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Heartbeat:
        """The heartbeat that :meth:`to_json` wrote."""
        fields = json.loads(text)
        if fields.get("mark") is not None:
            fields["mark"] = tuple(fields["mark"])
        fields["recent"] = tuple(tuple(call) for call in fields.get("recent", ()))
        return cls(**fields)


@dataclass(frozen=True)
class Verdict:
    """The hang as decided by the first rank that saw it; every rank acts on the same one."""

    culprit: int
    reporter: int
    peers: int = 0  # live peers the culprit waits for (reported and quiet) before its stack
    silent: bool = False  # the culprit's watchdog is not running: no stack will come
    mismatch: str = ""  # a collective mismatch, in the reporter's words ("": a hang)

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


def waiting_in(beat: Heartbeat) -> tuple[float, str] | None:
    """How long the rank of ``beat`` has waited in a collective when published, and in which, in words.

    A counted call (:mod:`ddpkit.observe.collectives`), else the oldest collective in flight by
    torch's flight recorder: DDP's gradient exchange in the backward pass, another group's call, an
    NCCL collective (which returns once queued). None: it waits in none that either sees.
    """
    if beat.call:
        return beat.waited, f"its collective #{beat.calls} ({beat.call} at {beat.call_where or '?'})"
    if beat.pending:
        return (
            beat.pending_for,
            f"a collective its script did not call itself ({beat.pending}, by torch's flight recorder)",
        )
    return None


def suspects(
    heartbeats: Mapping[int, Heartbeat | None],
    me: int,
    waited: float,
    now: float,
    *,
    silent_after: float,
    slack: float,
) -> dict[int, Heartbeat | None]:
    """The peers rank ``me`` may be waiting for, having waited ``waited`` seconds in a collective.

    A peer with no heartbeat or a stopped one, or one in its own code (in no collective, counted or in
    flight) that made no progress in all that time, less ``slack`` seconds. A closed rank never is;
    nor is a peer that waits too (it is not the cause) or that progresses (a long phase of its own).

    Args:
        heartbeats: each rank's last heartbeat by rank (None: it sent none).
        me: the waiting rank.
        waited: seconds it has waited, or fewer: a peer without progress that long (less ``slack``)
            is a suspect. The watchdog passes its hang limit, so a peer that stuck after this rank
            began to wait is named too, once it has been stuck that long.
        now: wall time (``time.time()``).
        silent_after: seconds since publication after which a heartbeat counts as stopped.
        slack: seconds of the heartbeats' own delay to allow.
    """
    return {
        rank: beat
        for rank, beat in heartbeats.items()
        if rank != me
        and (
            beat is None
            or (
                beat.phase != CLOSED
                and (
                    now - beat.time > silent_after
                    or (not beat.call and not beat.pending and beat.idle_at(now) >= waited - slack)
                )
            )
        )
    }


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


def find_mismatch(
    heartbeats: Mapping[int, Heartbeat | None],
    now: float,
    *,
    grace: float,
    silent_after: float,
    marks: Mapping[int, int] | None = None,
    me: int = 0,
    failing: bool = False,
) -> str | None:
    """Why the ranks can never meet in one collective, in words, or None where nothing shows it.

    A rank counts as waiting once it has waited ``grace`` seconds in a collective (at once for rank
    ``me`` when ``failing``: its collective just raised). The ranks cannot meet when:

    * two ranks' last calls (``recent``) hold the same number with different signatures;
    * a rank waits in its collective number n, and a rank that finished its script (closed, not
      failed) called fewer than n;
    * two ranks wait at the same moment, in collectives of different signatures, or of numbers two or
      more apart (one apart, the rank ahead finished the collective the other still waits in, whose
      last bytes are still on their way: on a 1 Mbit/s link a ring allreduce of 4 MiB ends on one rank
      tens of seconds after the other);
    * by torch's flight recorder, a rank is in the default group's collective (in flight ``grace``
      seconds, or failed for rank ``me`` when ``failing``) past the last one a finished rank
      recorded: DDP's gradient exchange, which the counted rules above do not see;
    * by that recorder, a rank is in the default group's collective (in flight ``grace`` seconds) that
      a waiting peer has not reached, while that peer's own wait is outside the group with nothing in
      flight there (``rt.save``'s meeting, while a rank with one more batch of its own is in DDP's
      exchange);
    * by that recorder, two ranks are in the default group's collective of one number, in flight
      ``grace`` seconds, as other operations or shapes (an NCCL collective returns once queued, so
      the counted calls do not show the wait; gloo mostly fails such a pair at once);
    * rank ``me``'s fingerprint of its first n calls (``marks``) differs from a peer's published
      one: their collectives differed earlier, though the backend paired them up.

    Args:
        heartbeats: each rank's last heartbeat by rank (None: it sent none).
        now: wall time (``time.time()``).
        grace: seconds in one collective after which a rank counts as waiting in it.
        silent_after: seconds since publication after which a heartbeat is too old to use.
        marks: rank ``me``'s fingerprints by call number (:class:`~ddpkit.observe.collectives.CollectiveLog`).
        me: the rank that asks.
        failing: rank ``me``'s collective just failed.
    """
    seen: dict[int, tuple[int, str]] = {}
    for rank, beat in sorted(heartbeats.items()):
        for number, signature, _ in beat.recent if beat is not None else ():
            first = seen.setdefault(number, (rank, signature))
            if first[1] != signature:
                return f"ranks {first[0]} and {rank} called different collectives as their #{number}"
    fresh = {
        r: b for r, b in heartbeats.items() if b is not None and b.phase != CLOSED and now - b.time <= silent_after
    }
    finished = {r: b for r, b in heartbeats.items() if b is not None and b.phase == CLOSED and not b.failed}
    waiting = {
        r: b for r, b in sorted(fresh.items()) if b.call and (b.waited_at(now) >= grace or (failing and r == me))
    }
    for rank, beat in waiting.items():
        for done_rank, done in sorted(finished.items()):
            if done.calls < beat.calls:
                return (
                    f"rank {rank} waits in its collective #{beat.calls}, which rank {done_rank} never calls: "
                    f"it finished after {done.calls}"
                )
        for peer, other in waiting.items():
            if peer <= rank or (other.calls == beat.calls and other.call == beat.call):
                continue
            if abs(other.calls - beat.calls) == 1:  # the one ahead finished the other's: its data is arriving
                continue
            together = min(beat.time, other.time) - max(beat.time - beat.waited, other.time - other.waited)
            if together >= 0.0 or failing:
                what = "signatures" if other.calls == beat.calls else "numbers"
                return f"ranks {rank} and {peer} wait in collectives of different {what}"
    for rank, beat in sorted(fresh.items()):  # after the counted calls' rules, which name the user's call
        ahead = _ahead_of_finished(beat, finished, failed=failing and rank == me, waited=beat.pending_at(now) >= grace)
        if ahead is not None:
            return f"rank {rank} {ahead}"
    in_flight = {r: b for r, b in fresh.items() if b.pending_seq and b.pending_call and b.pending_at(now) >= grace}
    for rank, beat in sorted(in_flight.items()):
        for peer, other in waiting.items():
            # the peer waits in a call of its own outside the group (rt.save's meeting, the micro-shards'
            # exchange) with nothing in flight there, short of this collective: neither can go on
            if peer != rank and not other.pending_seq and 0 < other.flight_last < beat.pending_seq:
                return (
                    f"rank {rank} is in the default group's collective #{beat.pending_seq} by torch's flight "
                    f"recorder, which rank {peer} has not reached: it waits in {other.call}, its #{other.calls}"
                )
    for rank, beat in sorted(in_flight.items()):
        for peer, other in sorted(in_flight.items()):
            if (
                peer > rank
                and other.pending_seq == beat.pending_seq
                and _calls_differ(beat.pending_call, other.pending_call)
            ):
                return (
                    f"ranks {rank} and {peer} are both in the default group's collective #{beat.pending_seq} by "
                    f"torch's flight recorder, as different calls: {beat.pending_call} and {other.pending_call}"
                )
    for peer, other in sorted(heartbeats.items()):
        if peer == me or other is None or other.mark is None or not marks:
            continue
        number, fingerprint = other.mark
        if number in marks and marks[number] != fingerprint:
            return (
                f"ranks {me} and {peer} called different collectives before their #{number}, "
                "and the backend paired them up"
            )
    return None


def _ahead_of_finished(beat: Heartbeat, finished: Mapping[int, Heartbeat], *, failed: bool, waited: bool) -> str | None:
    """By torch's flight recorder: a collective of ``beat``'s rank that a finished rank never calls, in words.

    The default group numbers its collectives alike on every rank, so a number past the last one a
    finished rank recorded is one it never joined: ``beat``'s collective in flight (``waited``: long
    enough to count), or where its collective just ``failed``, its last. DDP's gradient exchange is
    such a call, which the collective log does not count.
    """
    number = beat.flight_last if failed else beat.pending_seq if waited else 0
    if not number:
        return None
    for done_rank, done in sorted(finished.items()):
        if done.flight_last and number > done.flight_last:
            return (
                f"is in the default group's collective #{number} by torch's flight recorder (DDP's gradient "
                f"exchange, say), which rank {done_rank} never calls: it finished after #{done.flight_last}"
            )
    return None


_SHAPED_RECORDED = ("all_reduce", "broadcast", "reduce", "_allgather_base", "_reduce_scatter_base")
"""Recorded operations whose tensors every rank passes alike (the recorder's names of them)."""


def _calls_differ(mine: str, theirs: str) -> bool:
    """Whether two ranks' ``name sizes dtypes`` of one numbered collective cannot be one call: other
    operations, or other sizes or dtypes where every rank passes the same (all_gather's may differ)."""
    name, _, rest = mine.partition(" ")
    other_name, _, other_rest = theirs.partition(" ")
    if name != other_name:
        return True
    return name.partition(":")[2] in _SHAPED_RECORDED and rest != other_rest


def format_mismatch(
    heartbeats: Mapping[int, Heartbeat | None], now: float, reason: str, *, world_size: int, silent_after: float
) -> str:
    """The report of a collective mismatch: one line with ``reason``, then one line per rank.

    Each rank's line says which collective it is in, as its n-th, with operation, shape and dtype,
    and the line of the user's script that called it; or that it finished, or where it is instead.
    Where the ranks' last calls differ, the first number at which they differ is shown for each.

    Args:
        heartbeats: each rank's last heartbeat by rank (None or missing: unknown).
        now: wall time (``time.time()``) waits are measured at.
        reason: why the ranks cannot meet (:func:`find_mismatch`).
        world_size: ranks of the job, one line each.
        silent_after: seconds since publication after which a heartbeat counts as stopped.
    """
    first = _first_difference(heartbeats)
    lines = [
        f"ddpkit: collective mismatch: {reason}; every rank exits with code {EXIT_MISMATCH}. Each rank:",
    ]
    for rank in range(world_size):
        beat = heartbeats.get(rank)
        lines.append(f"ddpkit:   rank {rank}: {_mismatch_row(beat, now, silent_after, first)}")
    lines.append(
        "ddpkit: every rank must call the same collectives in the same order with the same shapes and dtypes; "
        "a collective under `if rank == 0` (or rt.is_main) is the usual cause, or under a condition each rank "
        "decides on its own (a save every N minutes of its own clock: decide on rank 0 and share it with "
        "ddpkit.broadcast_object)"
    )
    for call in sorted({b.call for b in heartbeats.values() if b is not None and b.call in _EVERY_RANKS}):
        lines.append(f"ddpkit: {_EVERY_RANKS[call]}")
    return "\n".join(lines)


_EVERY_RANKS = {
    **{
        f"{call}()": f"{call} must be called on every rank (it gathers each rank's random state; ddpkit writes on "
        "rank 0 only): call it outside `if rt.is_main:`"
        for call in ("rt.save", "rt.load")
    },
    f"{EVAL_FORWARD}()": "a forward of the DDP model in eval mode first averages the ranks' BatchNorm statistics "
    "(as DDP's first eval forward broadcasts its buffers), so every rank must run it: evaluate on every rank "
    "(ddpkit.evaluate counts every sample once), or on one rank through model.module (its own statistics)",
}
"""ddpkit's counted waits that every rank calls (:func:`~ddpkit.observe.collectives.counted_wait`), and what the
report says of each: the checkpoints' meeting (:func:`ddpkit.checkpoint.resume.meet`), an eval-mode forward."""


def _collectives(count: int) -> str:
    return f"{count} collective{'' if count == 1 else 's'}"


def _first_difference(heartbeats: Mapping[int, Heartbeat | None]) -> int | None:
    """The lowest call number whose signature differs between two ranks' recent calls, if any is seen."""
    by_number: dict[int, set[str]] = {}
    for beat in heartbeats.values():
        for number, signature, _ in beat.recent if beat is not None else ():
            by_number.setdefault(number, set()).add(signature)
    differing = [number for number, signatures in by_number.items() if len(signatures) > 1]
    return min(differing) if differing else None


def _mismatch_row(beat: Heartbeat | None, now: float, silent_after: float, first: int | None) -> str:
    if beat is None:
        return "no heartbeat (unknown)"
    calls = {number: (signature, where) for number, signature, where in beat.recent}
    if beat.phase == CLOSED:
        text = f"{'failed' if beat.failed else 'finished'} after {_collectives(beat.calls)}"
        if beat.calls in calls:
            signature, where = calls[beat.calls]
            text += f"; its last, #{beat.calls}: {signature} at {where or '?'}"
        if beat.flight_last:
            text += f"; by torch's flight recorder, the default group's last was #{beat.flight_last}"
    elif beat.call:
        text = f"in its collective #{beat.calls}: {beat.call} at {beat.call_where or '?'}, waiting {beat.waited_at(now):.1f}s"
    elif beat.raised:
        text = f"its collective {beat.raised} (by torch's flight recorder) failed at {beat.where or '?'}"
    elif beat.pending:
        text = f"in {beat.pending} (by torch's flight recorder) at {beat.call_where or '?'}, waiting {beat.pending_at(now):.1f}s"
    else:
        text = f"in no collective: step {beat.step} (phase {beat.phase})"
        text += f" in {beat.where}" if beat.where else ""
        text += f", after {_collectives(beat.calls)}"
        if now - beat.time > silent_after:
            text += f"; its heartbeat stopped {now - beat.time:.1f}s ago"
    quoted = beat.phase != CLOSED and not beat.call and bool(beat.raised or beat.pending)  # the recorder, above
    if beat.flight and not quoted:
        text += f"; flight recorder: {beat.flight}"
    shown_last = beat.phase == CLOSED or bool(beat.call)
    if first is not None and first in calls and not (shown_last and first == beat.calls):
        signature, where = calls[first]
        text += f"; its #{first} was {signature} at {where or '?'}"
    return text


def _row(rank: int, beat: Heartbeat | None, now: float, silent_after: float) -> str:
    if beat is None:
        return f"rank {rank}: no heartbeat"
    text = (
        f"rank {rank}: step {beat.step}, phase {beat.phase}, idle {beat.idle_at(now):.1f}s, {beat.host} pid {beat.pid}"
    )
    if now - beat.time > silent_after:
        text += f", heartbeat silent for {now - beat.time:.1f}s"
    if beat.call:
        text += f", waiting in its collective #{beat.calls} {beat.call} at {beat.call_where or '?'}"
    elif beat.where:
        text += f", in {beat.where}"  # (with the user's line that led there, where that is another)
    return text + (f"; flight recorder: {beat.flight}" if beat.flight else "")


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
