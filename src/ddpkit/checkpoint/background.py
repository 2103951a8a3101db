"""Checkpoint writes in the background: a save returns once its snapshot is taken.

``rt.save`` and ``rt.checkpoint`` meet every rank through the launcher's store, each bringing its
RNG states and BatchNorm statistics (:mod:`ddpkit.checkpoint.resume`); rank 0 then copies the
state (:func:`snapshot`: tensors into host memory, so the next steps may change the model and
optimizer in place) and hands the copy to :data:`WRITER`, whose thread serialises, fsyncs,
checksums and renames it into place (:func:`ddpkit.checkpoint.pt.write`, unchanged, so a
checkpoint's name never points at bytes not yet all there). The optimizer's memory is copied
on that thread too, first (:class:`Later`), while the next forward and backward run; the next
optimizer step waits for it.

At most one write is in flight in a process: a save waits for the previous one before it takes
its snapshot, so the extra host memory is one state's. What needs the bytes on disk waits for
them: the next save, :meth:`Runtime.close <ddpkit.Runtime.close>` (at the end of the script
too: the thread is not a daemon), a preemption's save (written before the exit with 75), and
the trackers' rows, released only once a durable checkpoint covers them. A write that failed
(a full disk) is reported in one line by the next save on every rank, or by ``close``; the
previous checkpoint stays, as the failed one never got its name.

Under an elastic agent SIGTERM means "stop now" (a peer failed, and torch's agent stops the
survivors, killing them 30 s later if still there). :func:`hold_term` makes that SIGTERM wait for
the write in flight, then end the process as the signal would, so a peer's death mid-write costs
no checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import errno
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ddpkit import _torch


def snapshot(
    payload: Mapping[str, Any],
    spare: Mapping[str, Any] | None = None,
    *,
    later: Later | None = None,
) -> dict[str, Any]:
    """A copy of ``payload`` that later steps cannot change: every tensor copied to host memory.

    Plain containers and values are deep-copied; tensors sharing storage still share it in the
    copy (``copy.deepcopy``'s own bookkeeping), except device tensors, which are copied to the
    host one by one (no second copy of the state in device memory). ``spare``, an earlier
    snapshot of the same structure whose write is done, lends its tensors: copied into, not
    allocated again (a fresh 150 MB costs its page faults on every save).

    ``later``: the tensors :meth:`Later.take` keeps for later (memory only an optimizer's step changes) get
    their place in the copy now and their values later, on the writer's thread
    (:meth:`Writer.submit`), while the next forward and backward run.
    """
    found = tensors(payload)
    lent = tensors(spare) if spare is not None else []
    memo: dict[int, Any] = {}
    storages = {t.untyped_storage().data_ptr() for t in lent}
    if (
        len(lent) == len(found)
        and len(storages) == len(lent)  # no two of them share memory: each copy lands apart
        and all(_fits(t, s) for t, s in zip(found, lent))
    ):
        for tensor, into in zip(found, lent):
            if id(tensor) not in memo:
                place = later.take(tensor, into) if later is not None else None
                memo[id(tensor)] = place if place is not None else into.copy_(tensor.detach())
    else:
        for tensor in found:
            if id(tensor) in memo:
                continue
            place = later.take(tensor, None) if later is not None else None
            if place is not None:
                memo[id(tensor)] = place
            elif tensor.device.type != "cpu" or tensor.requires_grad:
                memo[id(tensor)] = tensor.detach().to("cpu", copy=True)
    return copy.deepcopy(dict(payload), memo)


class Later:
    """The tensors of a snapshot copied behind the loop: an optimizer's parameters and state.

    Between a save and the next optimizer step nothing else of the training loop changes them
    (the forward and backward only read the parameters), so their copy runs on the writer's
    thread meanwhile, and every optimizer's step first waits for it (a global step pre-hook).
    A change made in place meanwhile anyway (``p.mul_(...)`` outside a step) shows in the
    tensor's version counter: the save then fails in one line rather than keeping a torn copy.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._memory: set[int] = set()
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                self._memory.update(p.untyped_storage().data_ptr() for p in group["params"])
            for values in optimizer.state.values():
                self._memory.update(
                    v.untyped_storage().data_ptr() for v in values.values() if isinstance(v, torch.Tensor)
                )
        self.pending: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        """(the live tensor, its place in the copy, its version when the save returned)."""

    def take(self, tensor: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor | None:
        """``tensor``'s place in the copy (``into``, or a fresh host tensor) where it is copied later,
        noted as pending; None where it is not one of the optimizers' (copy it now)."""
        if tensor.layout != torch.strided or tensor.untyped_storage().data_ptr() not in self._memory:
            return None
        source = tensor.detach()
        place = torch.empty_like(source, device="cpu") if into is None else into
        self.pending.append((source, place, _torch.version_of(source)))
        return place

    def copy(self) -> None:
        """Copy every pending tensor (the writer's thread); raise if one changed since the save."""
        for source, into, version in self.pending:
            into.copy_(source)
            if _torch.version_of(source) != version:
                raise RuntimeError(
                    f"a tensor of shape {tuple(source.shape)} was changed in place between the save and "
                    "the next optimizer step, outside the step, while it was being copied; save with "
                    "blocking=True in a loop that changes parameters there"
                )


def tensors(payload: Any) -> list[torch.Tensor]:
    """The tensors of ``payload``, depth first in the containers' order (each object once)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in seen:
                seen.add(id(obj))
                found.append(obj)
        elif isinstance(obj, Mapping):
            for value in obj.values():
                visit(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                visit(value)

    visit(payload)
    return found


def _fits(tensor: torch.Tensor, into: torch.Tensor) -> bool:
    """``into`` (a host tensor of an earlier snapshot) can take ``tensor``'s values as they are."""
    return (
        into.device.type == "cpu"
        and into.shape == tensor.shape
        and into.dtype == tensor.dtype
        and into.stride() == tensor.stride()
        and into.storage_offset() == 0
        and into.untyped_storage().nbytes() == into.numel() * into.element_size()
    )


def nbytes(payload: Any) -> int:
    """Bytes of tensor data in ``payload`` (each storage once): the host memory a snapshot holds."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors(payload)}
    return sum(storages.values())


def why(exc: BaseException, path: str | os.PathLike) -> str:
    """One line on why writing ``path`` failed; a full disk said as such.

    torch's zip writer reports a full disk as ``[enforce fail at inline_container.cc:...]
    unexpected pos``, which names neither the disk nor the space.
    """
    detail = " ".join(str(exc).split()) or type(exc).__name__
    directory = os.path.dirname(os.path.abspath(path))
    try:
        free = os.statvfs(directory)
        left = free.f_bavail * free.f_frsize
    except OSError:
        return detail
    full = getattr(exc, "errno", None) == errno.ENOSPC or left < 1 << 20
    if not full:
        return detail
    return f"no space left on the device of {directory} ({left / 2**20:.1f} MiB free): {detail}"


@dataclass
class Done:
    """What the last write came to, once it ended."""

    error: str | None = None
    """One line: what went wrong, and which checkpoint did not get written."""
    write_s: float = 0.0
    """Seconds the write took in the background."""
    held_bytes: int = 0
    """Host memory its snapshot held until then."""
    step_wait_s: float = 0.0
    """Seconds an optimizer's step waited for the copy behind the loop (:class:`Later`)."""


class Writer:
    """At most one checkpoint write in flight, on a thread of its own."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._done: Done | None = None
        self._data: Mapping[str, Any] | None = None
        self.spare: Mapping[str, Any] | None = None
        """The last snapshot, once written: the next one copies into its tensors."""
        self.finished: list[Done] = []
        """Every write waited for, in order (what ``ddpkit bench --checkpoints`` reports)."""
        self._copied: threading.Event | None = None
        self._step_wait_s = 0.0

    def busy(self) -> bool:
        """True while a write runs."""
        return self._thread is not None and self._thread.is_alive()

    def submit(
        self,
        name: str,
        write: Callable[[], object],
        *,
        held_bytes: int,
        data: Mapping[str, Any],
        later: Later | None = None,
    ) -> None:
        """Run ``write()`` on the writer's thread; its outcome is :meth:`wait`'s.

        Args:
            name: the checkpoint written, for the error line.
            write: does the writing (and what follows it: pruning, the trackers' rows).
            held_bytes: host memory ``data`` holds until the write ends.
            data: the snapshot written: once the write is done, the next snapshot's spare.
            later: the snapshot's tensors still to copy, first (every optimizer's next step
                waits for them).

        Raises:
            RuntimeError: a write is still in flight (:meth:`wait` for it first, as ``save`` does).
        """
        if self._thread is not None:
            raise RuntimeError("a checkpoint write is already in flight; wait() for it first")
        copied = threading.Event()
        if later is None or not later.pending:
            copied.set()
        elif not _step_hook:
            _step_hook.append(register_optimizer_step_pre_hook(_before_step))

        def run() -> None:
            start = time.perf_counter()
            try:
                try:
                    if later is not None:
                        later.copy()
                finally:
                    copied.set()  # a step never waits for a copy that failed
                write()
            except BaseException as exc:  # noqa: BLE001 - reported by wait(), on the training thread
                self._done = Done(f"could not write checkpoint {name} in the background: {why(exc, name)}")
            else:
                self._done = Done()
            self._done.write_s = time.perf_counter() - start
            self._done.held_bytes = held_bytes

        self._done, self._data, self.spare = None, data, None
        self._copied, self._step_wait_s = copied, 0.0
        thread = threading.Thread(target=run, name="ddpkit-checkpoint-writer", daemon=False)
        thread.start()
        self._thread = thread  # started first: join() from another thread never meets an unstarted one

    def copied(self) -> None:
        """Wait until the snapshot in flight is wholly copied (an optimizer's step, before it
        changes what the copy reads); the time it waited counts in the write's :class:`Done`."""
        event = self._copied
        if event is None or event.is_set() or threading.current_thread() is self._thread:
            return
        start = time.perf_counter()
        event.wait()
        self._step_wait_s += time.perf_counter() - start

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the write in flight without taking its outcome (any thread);
        True once none is running."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return not self.busy()

    def wait(self) -> Done | None:
        """Wait for the write in flight; its outcome (None when there was none since the last wait)."""
        thread = self._thread
        if thread is None:
            return None
        thread.join()
        self._thread = None  # after the join: a SIGTERM meanwhile still sees the write in flight
        done, self._done = self._done, None
        self.spare, self._data = self._data, None
        if done is not None:
            done.step_wait_s = self._step_wait_s
            self.finished = [*self.finished[-99:], done]
        return done


WRITER = Writer()
"""This process's writer (rank 0 writes; a process has one run at a time)."""

_step_hook: list[Any] = []
"""The handle of :func:`_before_step`, once registered (for every optimizer of the process)."""


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Every optimizer's step pre-hook: a step waits for the copy of the snapshot in flight."""
    WRITER.copied()


TERM_GRACE_S = 20.0
"""How long a "stop now" SIGTERM waits for the write in flight: within the 30 s torch's agent
gives its workers before it kills them."""

_held: list[int] = []
"""The read and write ends of the pipe SIGTERM is noted in, once :func:`hold_term` held it."""
_at_fork: list[bool] = []
"""Whether :func:`_release_in_child` is registered to run after a fork."""


def hold_term(environ: Mapping[str, str] | None = None) -> bool:
    """Under an elastic agent, make SIGTERM wait for :data:`WRITER`'s write in flight (at most
    :data:`TERM_GRACE_S`), then end this process by SIGTERM as before. True where it is held.

    Called on the main thread by a background save, once per process. The main thread may be
    blocked in a collective on a dead peer, where a Python handler would never run, so a thread of
    its own reads the signal from Python's wakeup fd and acts. Left alone: a process not under an
    agent (there SIGTERM is a preemption notice, handled by ``ddpkit.distributed.preemption``),
    one whose SIGTERM has a handler already, or one that set a wakeup fd of its own (asyncio).
    """
    environ = os.environ if environ is None else environ
    if _held:
        return True
    if "TORCHELASTIC_RUN_ID" not in environ or threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if previous != -1:  # someone else's: give it back
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return False
    signal.signal(signal.SIGTERM, _noted)
    _held.extend((read_fd, write_fd))
    if not _at_fork:
        os.register_at_fork(after_in_child=_release_in_child)
        _at_fork.append(True)
    threading.Thread(target=_watch_term, args=(read_fd,), name="ddpkit-sigterm-after-write", daemon=True).start()
    return True


def _noted(signum: int, frame: Any) -> None:
    """SIGTERM's Python handler, where the main thread runs Python: tells :func:`_watch_term` as the
    wakeup fd does (in case something replaced that fd since)."""
    if _held:
        with contextlib.suppress(OSError):
            os.write(_held[1], bytes([int(signal.SIGTERM)]))


def _watch_term(read_fd: int) -> None:
    """Read the signals Python's handler noted; on SIGTERM wait for the write, then die by it.
    Whatever goes wrong here ends the process as SIGTERM would, never leaves it deaf to SIGTERM."""
    try:
        while True:
            select.select([read_fd], [], [])
            try:
                numbers = os.read(read_fd, 64)
            except BlockingIOError:
                continue
            if int(signal.SIGTERM) in numbers and signal.getsignal(signal.SIGTERM) is _noted:  # else the script's own
                WRITER.join(TERM_GRACE_S)
                break
    finally:
        _die_by(signal.SIGTERM)


def _release_in_child() -> None:
    """After a fork: the child has the handler and the pipe but not the watcher; SIGTERM goes back
    to its default there, and a SIGTERM to the child never reaches the parent's watcher."""
    if not _held:
        return
    read_fd, write_fd = _held
    _held.clear()
    if threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
            if signal.getsignal(signal.SIGTERM) is _noted:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for fd in (read_fd, write_fd):
        with contextlib.suppress(OSError):
            os.close(fd)


def _die_by(signum: int) -> None:
    """End this process by ``signum``'s default action (from any thread: ``signal.signal`` is the
    main thread's only, the C library's ``signal`` is not)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal(int(signum), None)  # SIG_DFL
    os.kill(os.getpid(), signum)
    time.sleep(5)
    os._exit(128 + int(signum))  # the signal was blocked on this thread's mask: end as it would


__all__ = ["TERM_GRACE_S", "WRITER", "Done", "Later", "Writer", "hold_term", "nbytes", "snapshot", "tensors"]
