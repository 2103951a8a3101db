"""Saving and resuming a run's whole state: the user's objects and ddpkit's own.

``rt.save``, ``rt.load``, ``rt.checkpoint`` and ``rt.resume`` are these functions of the run's
state (:class:`~ddpkit.state.run.RunState`) and of :class:`Peers` (this rank, the world, how long
ranks wait for one another); with a world of one they need no process group. A checkpoint holds
the loop state (epoch, step, the training loaders' positions by name, the accumulation group),
every rank's RNG states, the precision's scaler and, inside an accumulation group, each rank's
part-accumulated gradients, so a resumed run continues with the very next batch and the same
random streams (:mod:`ddpkit.checkpoint.pt` and :mod:`ddpkit.checkpoint.dcp` are the formats).

The run's state is only read and changed through its attributes here (its class lives in the
loop, a layer above); :class:`RunState` names what is used.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpkit import checkpoint, rng
from ddpkit._version import __version__
from ddpkit.checkpoint import dcp
from ddpkit.distributed import collectives, store_sync
from ddpkit.errors import DdpkitError, UsageError, warn
from ddpkit.observe.heartbeats import beat
from ddpkit.parallel import lazy_buffers, periodic
from ddpkit.parallel.periodic import SYNCS
from ddpkit.state.run import RunState


@dataclass(frozen=True)
class Peers:
    """The ranks that save or load together: who this is, how many, how long they wait."""

    rank: int = 0
    """This process's global rank."""
    world_size: int = 1
    """Processes of the job."""
    timeout_s: float = 600.0
    """How long a rank waits for rank 0's outcome of a save."""
    save_timeout: float = 60.0
    """How long ``save`` and ``load`` wait for every rank to arrive."""

    @property
    def is_main(self) -> bool:
        """Global rank 0, the one that writes."""
        return self.rank == 0


_HEADER = frozenset({"format", "version", "ddpkit_version", "user", "ddpkit"})
"""ddpkit's keys at the top of a ``.pt`` checkpoint; a user entry of one of these names is in ``user`` only."""


def save(run: RunState, peers: Peers, path: str | os.PathLike, state: Mapping[str, Any], *, keep: int = 3) -> Path:
    """Save ``state`` plus ddpkit's own (loop state, every rank's RNGs, scaler).

    Every rank must call it (it gathers each rank's random state); called on rank 0 alone it
    fails within ``save_timeout`` seconds, naming the ranks that did not come. Global rank 0
    writes atomically; if the write fails, every rank raises. A directory ``path`` gets
    ``ckpt-stepNNNNNNNN.pt`` and keeps the newest ``keep``.

    Args:
        run: the run's state (loop, precision, models and their compressors and statistics).
        peers: this rank, the world and the timeouts.
        path: a ``.pt`` file, or a checkpoint directory (a DCP step directory under fsdp).
        state: the user's objects by name (modules, optimizers, schedulers, plain values).
        keep: newest checkpoints kept in a directory.

    Returns:
        The checkpoint written.
    """
    beat("save")
    if run.sharded():
        return _save_sharded(run, peers, Path(path), state, keep)
    meeting_point = store_sync.all_arrive("save", peers.save_timeout)
    path = Path(path)
    target = target_of(path, run.loop.step)
    rotate = target != path
    rngs = collectives.all_gather_object(rng.rng_state())
    grads = _open_group_grads(run)
    own_stats, averages = None, {}
    if any(b is not None for b in run.buffers):  # lazily averaged BatchNorm statistics
        for syncer in run.buffers:
            if syncer is not None:
                syncer.agree()  # a layer trained on one rank only is saved as dirty on all
        own_stats = collectives.all_gather_object([None if b is None else b.state_dict() for b in run.buffers])
        averages = {b: b.averaged() for b in run.buffers if b is not None}  # out of place
    compression = None
    states = [entry.mode.state_dict() for entry in run.entries]
    if any(state is not None for state in states):  # the same models on every rank
        compression = collectives.all_gather_object(states)
    if not peers.is_main:
        store_sync.share_outcome(meeting_point, None, peers.timeout_s)
        return target
    own = _own_state(run, peers, rngs)
    if grads is not None:
        own["accumulated_grads"] = grads
    if compression is not None:
        own["compression"] = compression  # per rank, per model: the compressor's state
    if own_stats is not None:
        own["buffers"] = own_stats  # per rank, per model: its own statistics, for resume
    user = _with_averages(checkpoint.user_state(state), state, averages)
    # each entry at the top level too (the same tensors, stored once): torch.load(path)["model"] reads
    # as a torch.save({"model": ...}) file would, for the scripts that read checkpoints themselves
    payload = {
        **{key: value for key, value in user.items() if key not in _HEADER},
        "format": checkpoint.FORMAT,
        "version": checkpoint.VERSION,
        "ddpkit_version": __version__,
        "user": user,
        "ddpkit": own,
    }
    try:
        checkpoint.write(target, payload)
        if rotate:
            checkpoint.prune(path, keep)
    except Exception as exc:
        store_sync.share_outcome(meeting_point, f"could not write checkpoint {target}: {exc}", peers.timeout_s)
        raise
    store_sync.share_outcome(meeting_point, None, peers.timeout_s)
    _saved_tracking(run)
    return target


def target_of(path: str | os.PathLike, step: int) -> Path:
    """The file :func:`save` writes for ``path`` at ``step``: ``path`` itself, or in a checkpoint
    directory (an existing directory, or a path without a suffix) the step's ``ckpt-stepNNNNNNNN.pt``."""
    path = Path(path)
    return checkpoint.step_path(path, step) if path.is_dir() or path.suffix == "" else path


def _saved_tracking(run: RunState) -> None:
    """The checkpoint is on disk: the trackers get the rows it covers (rank 0)."""
    tracking = run.tracking
    if tracking is not None:
        tracking.saved(run.loop.step)


def _restore_tracking(run: RunState, own: Mapping[str, Any]) -> None:
    """Continue the checkpoint's tracker runs (rank 0); rows queued after its step are dropped."""
    tracking = run.tracking
    if tracking is not None:
        tracking.load_state_dict(own.get("trackers"), run.loop.step)


def _with_averages(user: dict[str, Any], state: Mapping[str, Any], averages: Mapping[Any, Any]) -> dict[str, Any]:
    """The saved model entries with BatchNorm statistics replaced by their cross-rank averages, and
    the synced weights of a model that syncs infrequently in place of rank 0's local ones."""
    for key, value in state.items():
        if isinstance(user.get(key), dict) and periodic.of(value) is not None:
            user[key] = periodic.exported(value, user[key])
        found = averages.get(lazy_buffers.of(value))  # by syncer; empty when nothing was dirty
        if found:
            saved = user[key]
            user[key] = type(saved)({k: found.get(k, v) for k, v in saved.items()})
            if hasattr(saved, "_metadata"):  # torch's per-module versions, for load
                user[key]._metadata = saved._metadata
    return user


def _open_group_grads(run: RunState) -> list[Any] | None:
    """Every rank's part-accumulated gradients when a save falls inside an accumulation group."""
    if run.loop.micro_step == 0:
        return None
    mine = [
        [None if p.grad is None else p.grad.detach().cpu().clone() for p in model.parameters()] for model in run.models
    ]
    return collectives.all_gather_object(mine)


def _own_state(run: RunState, peers: Peers, rngs: list[Any]) -> dict[str, Any]:
    """ddpkit's part of every checkpoint: the loop, every rank's RNGs, precision, settings."""
    tracking = run.tracking
    return {
        "loop": run.loop.state_dict(),
        "epoch": run.loop.epoch,
        "step": run.loop.step,
        "rng": rngs,
        "world_size": peers.world_size,
        "precision": run.precision.state_dict(),
        "config": {"seed": run.seed, "precision": run.precision.name},
        "trackers": tracking.state_dict(run.loop.step) if tracking is not None else {},
    }


def _save_sharded(run: RunState, peers: Peers, path: Path, state: Mapping[str, Any], keep: int) -> Path:
    """A DCP checkpoint in a fresh step directory of ``path`` (see :mod:`ddpkit.checkpoint.dcp`)."""
    import uuid

    if path.suffix == ".pt":
        raise UsageError(
            f"rt.save({str(path)!r}): under strategy='fsdp' a checkpoint is a directory of "
            "shards; give a checkpoint directory (each save makes a ckpt-stepNNNNNNNN in it)"
        )
    if run.loop.micro_step:
        raise UsageError(
            "rt.save inside an accumulation group under strategy='fsdp' is not supported; "
            "save at the step that ends a group"
        )
    meeting_point = store_sync.all_arrive("save", peers.save_timeout)
    target = checkpoint.step_dir(path, run.loop.step)
    rngs = collectives.all_gather_object(rng.rng_state())
    token = collectives.broadcast_object(uuid.uuid4().hex[:12] if peers.is_main else None)
    own = None
    if peers.is_main:
        plain = {key: state[key] for key in dcp.plain_entries(state)}
        own = {
            **_own_state(run, peers, rngs),
            "user": checkpoint.user_state(plain),
            "ddpkit_version": __version__,
            "strategy": "fsdp",
        }
    try:
        dcp.save(target, state, own, token)
        if peers.is_main:
            dcp.prune(path, keep, token)
    except Exception as exc:
        store_sync.share_outcome(
            meeting_point, f"could not write checkpoint {target}: {exc}" if peers.is_main else None, peers.timeout_s
        )
        raise
    store_sync.share_outcome(meeting_point, None, peers.timeout_s)
    _saved_tracking(run)
    return target


def _restore_sharded(
    run: RunState, peers: Peers, target: Path, state: MutableMapping[str, Any], strict: bool, *, verified: bool
) -> Path:
    problem = None
    if peers.is_main and not verified:  # checkpoint.latest verified what it found
        try:
            dcp.verify(target)
        except DdpkitError as exc:
            problem = str(exc)
    problem = collectives.broadcast_object(problem)
    if problem is not None:
        raise DdpkitError(problem)
    own = dcp.load_own(target)
    dcp.load(target, state)
    _restore_entries(state, own["user"], [k for k in dcp.plain_entries(state) if k in own["user"]], target)
    run.precision.load_state_dict(own["precision"])
    run.loop.restore(own["loop"], source=str(target), strict=strict)
    _restore_rng(peers, own, target)
    _restore_tracking(run, own)
    return target


def _restore_rng(peers: Peers, own: Mapping[str, Any], target: Path) -> None:
    saved_world = int(own.get("world_size", 1))
    if saved_world == peers.world_size:
        rng.set_rng_state(own["rng"][peers.rank])
    elif peers.is_main:
        warn(
            f"checkpoint {target} was written by {saved_world} process(es) and resumes on "
            f"{peers.world_size}: the data order and per-sample randomness continue exactly, "
            "per-process random streams (dropout) start afresh"
        )


def load(
    run: RunState, peers: Peers, path: str | os.PathLike, state: MutableMapping[str, Any], *, strict: bool = True
) -> Path:
    """Restore ``state`` and ddpkit's own on every rank; a directory means its newest checkpoint.

    Resumes mid-epoch exactly: the next batch is the one after the last trained, also for
    loaders built after ``load``. A saved position that matches no loader, or a loader built
    differently from the saved one, is an error (a warning with ``strict=False``, and that
    loader's epoch starts over). Every rank must call it.

    Args:
        run: the run's state, restored in place.
        peers: this rank, the world and the timeouts.
        path: a checkpoint file or DCP directory, or a directory of them (the newest complete one).
        state: the user's objects by name, restored in place.
        strict: a saved loader position that matches no loader is an error (else a warning).
    """
    store_sync.all_arrive("load", peers.save_timeout)
    target = Path(path)
    if target.is_dir() and not dcp.is_dcp(target):
        found = newest_agreed(peers, target)
        if found is None:
            raise DdpkitError(f"no complete checkpoint in {target}")
        return _restore(run, peers, found, state, verified=True, strict=strict)
    return _restore(run, peers, target, state, verified=False, strict=strict)


def _restore(
    run: RunState, peers: Peers, target: Path, state: MutableMapping[str, Any], *, verified: bool, strict: bool = True
) -> Path:
    if dcp.is_dcp(target):  # a sharded checkpoint: rank 0 verifies it for everyone
        return _restore_sharded(run, peers, target, state, strict, verified=verified)
    payload = checkpoint.read(target, verified=verified)
    own = payload["ddpkit"]
    if "loop" not in own:
        raise DdpkitError(
            f"checkpoint {target} was written by ddpkit {payload.get('ddpkit_version', '?')}, "
            "before loader positions were keyed by name: its weights load with "
            "ddpkit.checkpoint.read(path)['user'], but it cannot resume a loop"
        )
    saved_world = int(own.get("world_size", 1))
    if own["loop"].get("micro_step") and saved_world != peers.world_size:  # before anything changes
        raise DdpkitError(
            f"checkpoint {target} was saved inside an accumulation group on {saved_world} "
            f"process(es); resume it on {saved_world}, or save at the step that ends a group"
        )
    taken: list[str] = []
    if run.sharded():  # a replicated (DDP) run's checkpoint, into sharded models
        taken = dcp.load_plain_into_sharded(state, payload["user"])
    _restore_entries(
        state,
        {k: v for k, v in payload["user"].items() if k not in taken},
        [key for key in state if key not in taken],
        target,
    )
    run.precision.load_state_dict(own["precision"])
    run.loop.restore(own["loop"], source=str(target), strict=strict)
    if "accumulated_grads" in own:
        _restore_grads(run, peers, own["accumulated_grads"][peers.rank], target)
    saved = own.get("compression")
    mine = None if saved is None else saved[min(peers.rank, saved_world - 1)]
    run.saved_compression = (mine, saved_world == peers.world_size, str(target))
    stats = own.get("buffers")
    # on another world size every rank keeps the averages the model entry holds
    run.saved_buffers = stats[peers.rank] if stats is not None and saved_world == peers.world_size else None
    if run.saved_buffers is None:
        for syncer in run.buffers:  # the loaded statistics are equal on every rank
            if syncer is not None:
                syncer.dirty.clear()
    for index in range(len(run.models)):
        _restore_compression(run, index, peers.is_main)
        _restore_buffers(run, index)
    _restore_rng(peers, own, target)
    _restore_tracking(run, own)
    return target


def _restore_buffers(run: RunState, index: int) -> None:
    """Give model ``index`` this rank's own saved BatchNorm statistics (load before or after setup)."""
    saved = run.saved_buffers
    if saved is None or index >= len(saved) or saved[index] is None or run.buffers[index] is None:
        return
    run.buffers[index].load_state_dict(saved[index])


def _restore_compression(run: RunState, index: int, is_main: bool) -> None:
    """Give model ``index``'s compressor its saved state (load may come before or after setup)."""
    if run.saved_compression is None:
        return
    states, same_world, source = run.saved_compression
    saved = states[index] if states is not None and index < len(states) else None
    mode = run.entries[index].mode
    with warnings.catch_warnings():
        if not is_main:
            warnings.simplefilter("ignore")
        if mode.state_dict() is not None:
            mode.load_state_dict(saved or {"name": None}, same_world=same_world, source=source)
        elif saved is not None:
            if saved["name"] in SYNCS:
                warn(
                    f"checkpoint {source} was trained with sync={saved['name']!r} and resumes with a sync "
                    "every step, from its synced weights"
                )
            else:
                warn(
                    f"checkpoint {source} was trained with grad_compression={saved['name']!r} and "
                    "resumes without compression"
                )


def _restore_grads(run: RunState, peers: Peers, saved: list[list[Any]], target: Path) -> None:
    if len(saved) != len(run.models):
        raise DdpkitError(
            f"checkpoint {target} holds the gradients of {len(saved)} model(s) of an open "
            f"accumulation group; call rt.setup for each ({len(run.models)} so far) before load"
        )
    for model, grads in zip(run.models, saved):
        for param, grad in zip(model.parameters(), grads):
            if grad is None:
                param.grad = None
            elif param.grad is None:
                param.grad = grad.to(param.device)
            else:
                param.grad.copy_(grad)


def resume(
    run: RunState,
    peers: Peers,
    source: str | os.PathLike | None,
    directory: Path | None,
    state: MutableMapping[str, Any],
    *,
    strict: bool = True,
) -> Path | None:
    """Load what ``init(resume=...)`` names into ``state``; returns the checkpoint, or None.

    ``source="auto"`` takes the newest complete checkpoint of ``directory`` and does nothing when
    there is none yet, so one script serves the first start and every restart of ``ddpkit run
    --max-restarts K``. ``strict`` as for :func:`load`.

    Args:
        run: the run's state, restored in place.
        peers: this rank and the world.
        source: ``"auto"``, a checkpoint path, or None (nothing to resume).
        directory: where ``"auto"`` looks (``init(checkpoint_dir=...)``).
        state: the user's objects by name, restored in place.
        strict: a saved loader position that matches no loader is an error (else a warning).
    """
    if source is None:
        return None
    if str(source) == "auto":
        found = None if directory is None else newest_agreed(peers, directory)
        if found is None:
            return None
        return _restore(run, peers, found, state, verified=True, strict=strict)
    return load(run, peers, source, state, strict=strict)


def restore_pending(run: RunState, index: int, *, is_main: bool) -> None:
    """Give model ``index``, just set up, what a load before its setup saved for it."""
    _restore_compression(run, index, is_main)
    _restore_buffers(run, index)


def newest_agreed(peers: Peers, directory: Path) -> Path | None:
    """The newest complete checkpoint in ``directory`` as rank 0 sees it, the same on every rank.

    Ranks looking on their own could disagree (a node-local disk holds no checkpoints, a
    save lands between two looks) and silently train from different states; and only rank
    0 hashes the file. Every rank must call it.
    """
    found = checkpoint.latest(directory) if peers.is_main else None  # verifies what it returns
    found = collectives.broadcast_object(None if found is None else str(found))
    if found is None:
        return None
    if not Path(found).exists():
        import socket

        raise DdpkitError(
            f"rank 0 resumes from {found}, which rank {peers.rank} cannot read on {socket.gethostname()}: "
            "put checkpoint_dir on a filesystem every node shares"
        )
    return Path(found)


def _restore_entries(state: MutableMapping[str, Any], saved: Mapping[str, Any], keys: list[str], path: Path) -> None:
    """Load ``saved`` into the entries ``keys`` of ``state`` (objects in place, plain values replaced)."""
    part = {key: state[key] for key in keys}
    checkpoint.restore_user_state(part, saved, path)
    state.update(part)
