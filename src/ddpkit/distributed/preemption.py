"""Preemption: a signal that says the job will be stopped soon, turned into a save and an exit.

SLURM sends ``SIGUSR1`` before the time limit (``#SBATCH --signal=B:USR1@SECONDS``, which
``ddpkit slurm --requeue`` writes); Kubernetes, spot instances and ``scancel`` send ``SIGTERM``.
``ddpkit run`` gets either and sends its workers SIGUSR1 (:func:`pass_on`); a process without an
elastic agent gets them itself (:func:`signals`). :meth:`Preemption.install` makes such a signal
set a flag instead of ending the process (a handler the user installed stays theirs). At the next step boundary every rank learns
whether any rank was signalled (about a second later: :func:`ddpkit.loop.steps.step`), ``rt.preempted`` turns True on
all of them at the same step, and ``ddpkit train`` (or the user's loop, on ``rt.preempted``)
saves a checkpoint; a save while preempted ends the process with :data:`EXIT_CODE` once the
checkpoint is on disk, which ``ddpkit run`` passes on and the requeue script turns into
``scontrol requeue``.

Saves are atomic, so a second signal, or the grace period running out during the save, leaves
the previous checkpoint as the newest.

Example:
    >>> watch = Preemption()
    >>> watch.received is None, watch.agreed
    (None, False)
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Any

from ddpkit._torch import elastic_signal_exception

EXIT_CODE = 75
"""A run that saved a checkpoint because it was preempted exits with this (``EX_TEMPFAIL``: resume it)."""
SIGNALS = ("SIGTERM", "SIGUSR1")
"""What counts as a preemption notice."""
NOTICE_ENV = "DDPKIT_PREEMPT_NOTICE"
"""Set by ``ddpkit run`` for its workers: a file in which its agent writes the signal it got
(SIGTERM or SIGUSR1) before it sends its workers SIGUSR1."""


def signals(environ: Any = None) -> tuple[str, ...]:
    """The signals that mean preemption for this process.

    Under an elastic agent SIGTERM means "stop now": torch's agent sends it to the survivors when a
    worker failed, and a Python handler would only run once a blocked collective or store wait
    returns, so a restart would wait for nothing. There only SIGUSR1 is caught: ``ddpkit run``
    turns the SIGTERM or SIGUSR1 it gets into SIGUSR1 for its workers (:func:`pass_on`), and a
    plain ``torchrun`` passes SIGUSR1 on with ``--signals-to-handle``. Without an agent (python,
    ``srun`` with one task per rank) SIGTERM and SIGUSR1 are both preemption notices.
    """
    environ = os.environ if environ is None else environ
    return ("SIGUSR1",) if "TORCHELASTIC_RUN_ID" in environ else SIGNALS


MARKER_ENV = "DDPKIT_PREEMPTED_FILE"
"""Set by ``ddpkit run`` for its workers: local rank 0 creates the file once the preempted save is
on disk, so the launcher, whose workers torch's agent stops, can tell a save from a kill."""


class Preemption:
    """This process's notice of preemption (``received``) and the world's agreement (``agreed``)."""

    def __init__(self) -> None:
        self.received: int | None = None
        """The signal number that arrived first, or None."""
        self.agreed = False
        """Every rank knows some rank was signalled (set at a step boundary, on all ranks at once)."""
        self.armed = False
        """Training has begun (the first ``rt.step``): a signal now waits for the next step boundary.
        Before, a signal does what it would without ddpkit (the process ends)."""
        self.installed: list[int] = []
        self.next_check = 0
        """The step at which the ranks next ask one another (``ddpkit.loop.steps``)."""
        self.checked_at: float | None = None
        self.checked_step = 0

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.armed:  # nothing to save yet: end as the signal's default would
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.received is None:
            self.received = signum

    def install(self) -> list[str]:
        """Catch the preemption signals of this launcher (:func:`signals`) where their handler is
        still Python's default; the names caught. Only the main thread can set handlers."""
        if threading.current_thread() is not threading.main_thread():
            return []
        caught = []
        for name in signals():
            number = getattr(signal, name, None)
            if number is None or signal.getsignal(number) not in (signal.SIG_DFL, None):
                continue
            signal.signal(number, self._handle)
            self.installed.append(number)
            caught.append(name)
        return caught

    def uninstall(self) -> None:
        """Give the signals back their default action."""
        for number in self.installed:
            if signal.getsignal(number) == self._handle:
                signal.signal(number, signal.SIG_DFL)
        self.installed.clear()

    @property
    def name(self) -> str:
        """The received signal's name (``SIGTERM``), or ``""``."""
        if self.received is None:
            return ""
        notice = os.environ.get(NOTICE_ENV)
        if notice and os.path.exists(notice):  # what ddpkit run itself got
            with contextlib.suppress(OSError):
                return Path(notice).read_text().strip() or "SIGUSR1"
        return signal.Signals(self.received).name if self.received > 0 else "a signal to another rank"


def stopped(sigval: int, saved: bool, notice: str | None = None) -> int:
    """``ddpkit run``'s exit code and one line when its agent was stopped by ``sigval`` (the name in
    ``notice``, when :func:`pass_on` wrote it, is the signal ``ddpkit run`` itself got)."""
    import sys

    name = signal.Signals(sigval).name
    if notice and os.path.exists(notice):
        name = Path(notice).read_text().strip() or name
        sigval = getattr(signal, name, sigval)
    if saved:
        sys.stderr.write(
            f"ddpkit run: stopped by {name}; the workers saved a checkpoint first, exit code "
            f"{EXIT_CODE} (resume='auto' continues from it)\n"
        )
        return EXIT_CODE
    sys.stderr.write(
        f"ddpkit run: stopped by {name} before the workers saved a checkpoint "
        f"(exit code {128 + int(sigval)}); a resume starts from the newest earlier one\n"
    )
    return 128 + int(sigval)


def mark_saved() -> None:
    """Tell ``ddpkit run`` (through :data:`MARKER_ENV`) that the preempted save is on disk."""
    target = os.environ.get(MARKER_ENV)
    if target:
        Path(target).touch()


def pass_on(notice: str) -> Any:
    """In ``ddpkit run``'s process: SIGTERM and SIGUSR1 write their name into ``notice``, then stop
    torch's agent the way its own handler does, asking it to send SIGUSR1 to every worker (which
    gives them its grace period to save). Returns an undo."""
    exception = elastic_signal_exception()

    def handler(signum: int, frame: Any) -> None:
        Path(notice).write_text(signal.Signals(signum).name)
        # the agent stops its workers with the signal in the exception: SIGUSR1, which they catch
        raise exception(f"Process {os.getpid()} got signal: {signal.Signals(signum)}", sigval=signal.SIGUSR1)

    previous = {number: signal.signal(number, handler) for number in (signal.SIGTERM, signal.SIGUSR1)}

    def undo() -> None:
        for number, old in previous.items():
            signal.signal(number, old)

    return undo


__all__ = [
    "EXIT_CODE",
    "MARKER_ENV",
    "NOTICE_ENV",
    "pass_on",
    "signals",
    "Preemption",
    "SIGNALS",
    "mark_saved",
    "stopped",
]
