"""Which collective this rank is in: its n-th call on the default group, the operation, shape, dtype, the user's line.

The hang watchdog (:mod:`ddpkit.observe.watchdog`) compares what every rank publishes of this log
to name a collective mismatch: a collective called on some ranks only, ranks in different
operations, shapes or dtypes, or the same collectives in a different order. Nothing here sends a
message: the main thread counts its calls, keeps a few of them and a running fingerprint, and the
watchdog thread publishes them through the store every second.

What is counted: the ``torch.distributed`` collectives called on the default group from the thread
that started the watchdog, through the module's functions (``dist.all_reduce(...)``), which is how
the user's script and ddpkit (``rt.all_reduce``, ``ddpkit.evaluate``, checkpoints) call them. A call
made inside another (``all_gather_object`` gathers sizes first) counts once, as the outer call.
Point-to-point sends, other groups and other threads are not counted. DDP's gradient exchange runs
in C++ and is not a call here; torch's flight recorder sees it (:func:`flight`), which ``ddpkit
run`` and :func:`turn_on_flight_recorder` turn on.

Example:
    >>> log = CollectiveLog()
    >>> log.signature("all_reduce", torch.zeros(3))
    'all_reduce(float32[3])'
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ddpkit import _torch
from ddpkit.errors import user_line

# Operations whose tensor has the same shape and dtype on every rank of a correct program; the
# others (all_gather's list, all_to_all's splits, gather and scatter, objects) may differ by rank.
SHAPED = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
OTHERS = (
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
)
MARK_EVERY = 8  # a fingerprint is kept every MARK_EVERY calls
_MARKS_KEPT = 512
_RECENT = 16


class CollectiveLog:
    """The collectives one thread called on the default group; read by the watchdog thread.

    Attributes:
        calls: collectives started so far; the one in flight is number ``calls``.
        current: ``(number, signature, user line, monotonic start)`` of the call waited in, or None.
        recent: the last few ``(number, signature, user line)``.
        marks: the running fingerprint after every :data:`MARK_EVERY`-th call, by call number.
        longest_wait: the longest a finished call waited, in seconds.
        chain: the running fingerprint of every call so far.
    """

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.calls = 0
        self.current: tuple[int, str, str, float] | None = None
        self.recent: collections.deque[tuple[int, str, str]] = collections.deque(maxlen=_RECENT)
        self.marks: dict[int, int] = {}
        self.longest_wait = 0.0
        self.on_failure: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self.chain = 0
        self._depth = 0

    @staticmethod
    def signature(op: str, tensor: Any = None) -> str:
        """``op(dtype[shape])`` for the operations whose tensor must agree across ranks, else ``op()``."""
        if op in SHAPED and isinstance(tensor, torch.Tensor):
            return f"{op}({str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)})"
        return f"{op}()"

    def enter(self, signature: str, where: str, *, waits: bool) -> None:
        """A call starts: number it, fingerprint it, and (unless asynchronous) mark it as waited in."""
        self.calls += 1
        self.chain = zlib.crc32(signature.encode(), self.chain)
        with self._lock:  # the watchdog thread copies them (iterating while they change would raise)
            if self.calls % MARK_EVERY == 0:
                self.marks[self.calls] = self.chain
                if len(self.marks) > _MARKS_KEPT:
                    del self.marks[min(self.marks)]
            self.recent.append((self.calls, signature, where))
        if waits:
            self.current = (self.calls, signature, where, time.monotonic())

    def snapshot(self) -> tuple[dict[int, int], tuple[tuple[int, str, str], ...]]:
        """Copies of :attr:`marks` and :attr:`recent`, safe to read from another thread."""
        with self._lock:
            return dict(self.marks), tuple(self.recent)

    def leave(self) -> None:
        """The call waited in returned."""
        if self.current is not None:
            self.longest_wait = max(self.longest_wait, time.monotonic() - self.current[3])
        self.current = None

    @contextlib.contextmanager
    def counting(self, signature: str, *, waits: bool) -> Iterator[None]:
        """One counted call around its body: numbered and fingerprinted, waited in (``waits``) until it
        returns; calls made inside it are not counted. A failure ends the process where a peer's log
        shows a mismatch (:attr:`on_failure`)."""
        self.enter(signature, user_line(), waits=waits)
        self._depth += 1
        try:
            yield
        except Exception:
            if self.on_failure is not None:
                self.on_failure()  # a mismatch the peers' logs show ends the process here
            self.current = None
            raise
        finally:
            self._depth -= 1
        self.leave()

    def wrap(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (``torch.distributed.<op>``), counting each call this log's thread makes on the default group."""
        group_at, tensor_at = _torch.collective_parameters(fn)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth or threading.get_ident() != self.thread:
                return fn(*args, **kwargs)
            group = args[group_at] if group_at is not None and len(args) > group_at else kwargs.get("group")
            if not _torch.is_default_group(group):
                return fn(*args, **kwargs)
            tensor = None
            if tensor_at is not None:
                tensor = args[tensor_at[0]] if len(args) > tensor_at[0] else kwargs.get(tensor_at[1])
            with self.counting(self.signature(op, tensor), waits=not kwargs.get("async_op", False)):
                return fn(*args, **kwargs)

        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        counted.__name__ = getattr(fn, "__name__", op)
        counted.__doc__ = fn.__doc__
        return counted


FLIGHT_RECORDER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""torch's flight recorder records this many collectives per process where either is above 0."""


def flight_recorder_on() -> bool:
    """Whether torch's flight recorder runs in this process (``ddpkit run`` turns it on)."""

    return any(os.environ.get(name, "0").strip() not in ("", "0") for name in FLIGHT_RECORDER_ENV)


@dataclasses.dataclass(frozen=True)
class Flight:
    """What torch's flight recorder shows of this process (:func:`flight`)."""

    line: str = ""
    """The collective in flight (or the last one) and its state, in a line ("" where the recorder is off or empty)."""
    pending: str = ""
    """The oldest collective still in flight, in words ("": none)."""
    since: float = 0.0
    """The wall time (``time.time()``) that one was started at."""
    pending_seq: int = 0
    """The number of the default group's oldest collective in flight (0: none). The default group is
    the first every rank makes, so its numbers are alike on every rank; other groups' may not be."""
    last: int = 0
    """The number of the default group's last collective recorded (0: none)."""
    latest: str = ""
    """The default group's last collective recorded (where it has none, any group's), in words."""
    pending_call: str = ""
    """The default group's oldest collective in flight as ``name sizes dtypes`` (``gloo:all_reduce [[4]] Float``)."""


def flight() -> Flight:
    """This process's flight recorder: its line, the oldest collective in flight and since when, each group's last.

    It sees what the log cannot: DDP's gradient exchange and every group's calls, from C++, so a
    rank waiting in DDP's backward is seen to wait. Empty where the recorder is off or recorded
    nothing.
    """
    if not flight_recorder_on():
        return Flight()
    entries = _torch.flight_recorder_dump().get("entries", [])
    pending = [e for e in entries if not e.get("retired", False)]
    oldest = min(pending, key=lambda e: e.get("time_created_ns") or 0) if pending else None
    shown = [e for e in entries if not e.get("is_p2p")]
    line = ""
    backend = _default_backend()  # once: a full ring holds 2000 entries
    default = [e for e in shown if _in_default_group(e, backend)]
    last = max((int(e.get("collective_seq_id") or 0) for e in default), default=0)
    if shown:
        in_flight = [e for e in shown if not e.get("retired", False)]
        entry = in_flight[0] if in_flight else (default or shown)[-1]  # the default group's, which peers share
        what = _entry_words(entry)
        line = f"in flight {what} ({entry.get('state')})" if in_flight else f"none in flight; the last {what} done"
    latest = _entry_words((default or shown)[-1]) if shown else ""
    if oldest is None:
        return Flight(line, last=last, latest=latest)
    waited_in = [e for e in default if not e.get("retired", False)]
    first = min(waited_in, key=lambda e: e.get("time_created_ns") or 0, default=None)
    return Flight(
        line,
        _entry_words(oldest),
        (oldest.get("time_created_ns") or 0) / 1e9,
        0 if first is None else int(first.get("collective_seq_id") or 0),
        last,
        latest,
        "" if first is None else _call_words(first),
    )


def flight_status() -> dict[str, dict[str, Any]]:
    """The flight recorder's counters of each group, without its entries (microseconds, where
    :func:`flight` takes milliseconds): while they stay the same, so does what :func:`flight` reads.
    Empty where the recorder is off."""
    return _torch.flight_recorder_status() if flight_recorder_on() else {}


def _in_default_group(entry: dict[str, Any], backend: str | None) -> bool:
    """Whether a recorded collective is the default group's: group 0 of the default group's
    ``backend`` (NCCL's and gloo's recorders number their groups apart)."""
    return (
        entry.get("pg_id") == 0
        and backend is not None
        and str(entry.get("profiling_name", "")).startswith(f"{backend}:")
    )


def _default_backend() -> str | None:
    """The default group's backend (``"gloo"``, ``"nccl"``), None where there is no default group."""
    import torch.distributed as dist

    return str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else None


def flight_line() -> str:
    """This process's flight recorder in a line: the collective in flight (or the last one) and its state."""
    return flight().line


def _entry_words(entry: dict[str, Any]) -> str:
    number = entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")
    return f"#{number} {_call_words(entry)} of group {entry.get('pg_id')}"


def _call_words(entry: dict[str, Any]) -> str:
    dtypes = ",".join(str(d) for d in entry.get("input_dtypes") or [])
    return f"{entry.get('profiling_name')} {entry.get('input_sizes')} {dtypes}"


def turn_on_flight_recorder() -> bool:
    """Turn torch's flight recorder on for the process groups made from now on, unless the user set it.

    ``ddpkit run`` turns it on in its workers' environment; :func:`ddpkit.init` calls this before
    it makes the default group, so jobs under ``torchrun``, ``srun`` or ``ddpkit.launch`` have it too
    and the watchdog sees a rank wait in DDP's gradient exchange. NCCL's dump on a timeout stays off
    unless the user asks for it (:data:`DUMP_ON_TIMEOUT`): it would write to a shared ``/tmp`` name.
    False where the user set the recorder's variables (``0`` keeps it off) or this torch has no
    recorder (the watchdog's rows then say so).
    """
    if any(name in os.environ for name in FLIGHT_RECORDER_ENV):
        return False
    try:
        variable = _torch.flight_recorder_buffer_variable()
    except _torch.PrivateApiChanged:
        return False  # no recorder in this torch: flight() raises it where the watchdog reads it
    os.environ[variable] = _torch.FLIGHT_RECORDER_SIZE
    # read in this process only: NCCL's dump on a timeout would go to torch's default
    # /tmp/nccl_trace_rank_<n>, a name any user of the machine can take first (ddpkit run points
    # it into the job's private directory instead)
    os.environ.setdefault(DUMP_ON_TIMEOUT, "0")
    return True


DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
"""Whether NCCL writes its flight recorder to ``TORCH_FR_DUMP_TEMP_FILE`` when its watchdog times out."""


_installed: list[tuple[Any, str, Any]] = []
_lock = threading.Lock()
_active: list[CollectiveLog] = []  # the installed log, if any


def install(log: CollectiveLog) -> None:
    """Count the collectives of ``torch.distributed``'s module functions in ``log`` until :func:`uninstall`."""
    with _lock:
        uninstall()
        for op in SHAPED + OTHERS:
            for module, original in _torch.distributed_functions(op):
                setattr(module, op, log.wrap(op, original))
                _installed.append((module, op, original))
        _active.append(log)


def uninstall() -> None:
    """Put ``torch.distributed``'s own functions back."""
    while _installed:
        module, op, original = _installed.pop()
        setattr(module, op, original)
    _active.clear()


EVAL_FORWARD = "batchnorm_average_before_an_eval_forward"
"""The counted wait of an eval-mode forward through a DDP model whose BatchNorm statistics each rank keeps
(:mod:`ddpkit.parallel.lazy_buffers`): it averages them first, a collective of every rank's."""


def counted_wait(op: str) -> contextlib.AbstractContextManager[None]:
    """A wait of ddpkit's own that every rank makes at the same point of the script, outside the default
    group (micro-shards' exchange, on a group of its own): counted as a call of the installed log
    (:meth:`CollectiveLog.counting`), so a rank waiting in it while a peer waits in another collective
    (a metric all-reduced on the main process only, say) is a mismatch named in seconds, not a peer
    that made no progress."""
    log = _active[0] if _active else None
    if log is None or log._depth or threading.get_ident() != log.thread:
        return contextlib.nullcontext()
    return log.counting(f"{op}()", waits=True)


__all__ = [
    "CollectiveLog",
    "DUMP_ON_TIMEOUT",
    "EVAL_FORWARD",
    "FLIGHT_RECORDER_ENV",
    "Flight",
    "MARK_EVERY",
    "OTHERS",
    "SHAPED",
    "flight",
    "flight_line",
    "flight_recorder_on",
    "flight_status",
    "install",
    "turn_on_flight_recorder",
    "uninstall",
    "counted_wait",
    "user_line",
]
