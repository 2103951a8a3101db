"""``rt.save``, ``rt.load``, ``rt.checkpoint`` and ``rt.resume``: methods of :class:`~ddpkit.runtime.facade.Runtime`
written in a module of their own (the facade names them), each handing its work to
:mod:`ddpkit.checkpoint.resume` or, for a model alone, to :mod:`ddpkit.runtime.weights`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ddpkit.checkpoint import restore
from ddpkit.checkpoint import resume as resuming
from ddpkit.distributed import preemption
from ddpkit.errors import DdpkitError, UsageError
from ddpkit.loop import steps as loop_steps
from ddpkit.runtime import weights

if TYPE_CHECKING:
    from ddpkit.runtime.facade import Runtime


def save(
    self: Runtime, path: str | os.PathLike, state: Mapping[str, Any] | torch.nn.Module, *, blocking: bool = False
) -> Path:
    """Save ``state`` plus ddpkit's own (loop state, every rank's RNGs, scaler).

    Every rank must call it (it gathers each rank's random state); called on rank 0 alone it
    fails within ``save_timeout`` seconds, naming the ranks that did not come. Global rank 0
    writes atomically. A directory ``path`` gets ``ckpt-stepNNNNNNNN.pt`` and keeps the newest
    ``keep_checkpoints``. Each entry of ``state`` is also at the top of a ``.pt`` file, so
    ``torch.load(path)["model"]`` reads it back.

    It returns once a consistent copy of the state is taken; rank 0 writes the copy in the
    background while training goes on (:mod:`ddpkit.checkpoint.background`). The next save,
    :meth:`close` and the end of the script wait for that write; a write that failed raises
    there on every rank, in one line, and the previous checkpoint stays. ``resume="auto"`` and
    ``ddpkit predict`` only ever take a checkpoint whose bytes are all written and checked.
    ``blocking=True`` writes before returning, for a script that reads the file next; a save
    made because the job is preempted always does. A sharded (``strategy="fsdp"``)
    checkpoint is written in the background too, by DCP's ``async_save`` on every rank.

    ``rt.save("model.pt", model)`` (a model, not a mapping) writes the model's weights alone,
    with plain names, as ``torch.save(model.state_dict(), path)`` does: what
    ``model.load_state_dict(torch.load(path))`` reads, and :meth:`load` with a model too.
    It writes before returning.
    """
    _check_arguments("rt.save", path, state)
    if isinstance(state, torch.nn.Module):
        return weights.save(Path(path), self.full_state_dict(state), is_main=self.is_main)
    return _save(self, path, state, blocking=blocking, call="rt.save")


def _save(self: Runtime, path: str | os.PathLike, state: Mapping[str, Any], *, blocking: bool, call: str) -> Path:
    """``rt.save`` of a state, or ``rt.checkpoint`` (``call``). Into a directory of step checkpoints (a path
    without a suffix: the same on every rank), the state is checked whole for a resume first."""
    resuming.refuse_unapplied(self._run, call)
    rotating = call == "rt.checkpoint" or Path(path).suffix == ""
    if rotating:
        resuming.refuse_incomplete(self._run, state, call)
        self._run.stepped.clear()  # (on every replica: a fault-tolerant one that does not write too)
    loop_steps.rebind_state(self._run, state)  # an optimizer fsdp has not rebound yet: saved with its model
    if not self._run.world.writes(state):  # a replica that is not the one to write: it holds the same state
        return resuming.target_of(path, self._run.loop.step)
    blocking = blocking or self.preempted  # the exit with 75 says "saved": it must be on disk
    saved = resuming.save(self._run, self._peers, path, state, keep=self._settings.keep_checkpoints, blocking=blocking)
    if self.preempted:
        self._exit_preempted(saved)
    return saved


def exit_preempted(self: Runtime, saved: Path) -> None:
    """The preempted save is on disk: tell the launcher, end the tracker runs, exit with 75."""
    if self._env.local_rank == 0:
        preemption.mark_saved()
    self.print(
        f"ddpkit: preempted ({self._run.preemption.name}); saved {saved} at step {self.global_step}, "
        f"exiting with code {preemption.EXIT_CODE} (resume='auto' continues from it)",
        flush=True,
    )
    self._outcome = "KILLED"
    self.close()
    raise SystemExit(preemption.EXIT_CODE)


def load(
    self: Runtime, path: str | os.PathLike, state: MutableMapping[str, Any] | torch.nn.Module, *, strict: bool = True
) -> Path:
    """Restore ``state`` and ddpkit's own on every rank; a directory means its newest checkpoint.

    Resumes mid-epoch exactly: the next batch is the one after the last trained, also for
    loaders built after ``load``. A saved position that matches no loader, or a loader built
    differently from the saved one, is an error (a warning with ``strict=False``, and that
    loader's epoch starts over). Every rank must call it.

    With a model instead of a mapping, only its weights are loaded: from a file of weights
    (``rt.save(path, model)``, ``torch.save(model.state_dict(), path)``) or a checkpoint's
    ``"model"`` entry; the loop and random states are left as they are.
    """
    _check_arguments("rt.load", path, state)
    _written(self)
    if isinstance(state, torch.nn.Module):
        return weights.load(Path(path), state)
    loop_steps.rebind_state(self._run, state)  # an optimizer fsdp has not rebound yet: loaded with its model
    return restore.load(self._run, self._peers, path, state, strict=strict)


def _check_arguments(call: str, path: Any, state: Any) -> None:
    """``path`` first, then the state: torch.save's order (the object first) is refused in one line."""
    if isinstance(path, (str, os.PathLike)):
        _check_state(call, state, model_ok=True)
        return
    if isinstance(path, (torch.nn.Module, Mapping)) and isinstance(state, (str, os.PathLike)):
        raise UsageError(
            f"{call} takes the path first, then the state: {call}({str(state)!r}, {_kind(path)})"
            + (", not torch.save's order (the object first)" if call == "rt.save" else "")
        )
    raise UsageError(f"{call}'s path must be a str or a path-like object, got {type(path).__name__}")


def _check_state(call: str, state: Any, *, model_ok: bool) -> None:
    """``state`` is a mapping of named objects (or, where ``model_ok``, a model alone); else one line."""
    if isinstance(state, Mapping) or (model_ok and isinstance(state, torch.nn.Module)):
        return
    one = "{'model': model, 'optimizer': optimizer}"
    if isinstance(state, torch.nn.Module):
        raise UsageError(
            f"{call} takes a dict of named objects such as {one}, so that a resumed run gets every one "
            f"of them back, not a model alone; a model's weights alone go through {_alone(call)}(path, model)"
        )
    alone = ", or a model alone" if model_ok else ""
    raise UsageError(f"{call} takes a dict of named objects such as {one}{alone}, got {type(state).__name__}")


def _alone(call: str) -> str:
    """The call that takes a model's weights alone, in place of ``call``."""
    return "rt.load" if call == "rt.resume" else "rt.save"


def _kind(obj: Any) -> str:
    """How the fix names ``obj``: model, or state."""
    return "model" if isinstance(obj, torch.nn.Module) else "state"


def _written(self: Runtime) -> None:
    """A load reads what this process saved: the write in flight ends first (a failed one raises)."""
    failed = resuming.settle(self._run)
    if failed is not None:
        raise DdpkitError(failed)


def checkpoint(self: Runtime, state: Mapping[str, Any], *, blocking: bool = False) -> Path:
    """Save ``state`` into ``checkpoint_dir`` (given to :func:`ddpkit.init`), keeping the newest few.

    Written in the background unless ``blocking``, as :meth:`save` says.
    """
    if self._checkpoint_dir is None:
        raise UsageError("rt.checkpoint(state) needs ddpkit.init(checkpoint_dir=...)")
    _check_state("rt.checkpoint", state, model_ok=False)
    return _save(self, self._checkpoint_dir, state, blocking=blocking, call="rt.checkpoint")


def resume(self: Runtime, state: MutableMapping[str, Any], *, strict: bool = True) -> Path | None:
    """Load what ``init(resume=...)`` names into ``state``; returns the checkpoint, or None.

    ``resume="auto"`` takes the newest complete checkpoint of ``checkpoint_dir`` and does
    nothing when there is none yet, so one script serves the first start and every
    restart of ``ddpkit run --max-restarts K``. ``strict`` as for :meth:`load`.
    """
    _check_state("rt.resume", state, model_ok=False)
    resuming.refuse_incomplete(self._run, state, "rt.resume")
    _written(self)
    loop_steps.rebind_state(self._run, state)
    if self._run.world.defer_resume(state, strict):
        return None
    return restore.resume(self._run, self._peers, self._settings.resume, self._checkpoint_dir, state, strict=strict)


__all__ = ["checkpoint", "exit_preempted", "load", "resume", "save"]
