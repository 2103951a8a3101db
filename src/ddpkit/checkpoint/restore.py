"""Loading a checkpoint into a run: ``rt.load`` and ``rt.resume`` as functions of its typed state (:class:`~ddpkit.state.run.RunState`) and of :class:`~ddpkit.checkpoint.resume.Peers`.

Every rank loads; the user's objects, the loop position, every RNG, the precision, each model's mode state and statistics, and the trackers' runs come back. A model set up after the load takes its part when it is adopted (:func:`restore_pending`)."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from ddpkit import checkpoint, rng
from ddpkit.checkpoint import dcp
from ddpkit.checkpoint.own import check as checked_own
from ddpkit.checkpoint.resume import Peers, meet
from ddpkit.distributed import collectives
from ddpkit.errors import DamagedCheckpoint, DdpkitError, warn
from ddpkit.parallel.periodic_parts import SYNCS
from ddpkit.state.run import RunState


def _restore_tracking(run: RunState, own: Mapping[str, Any]) -> None:
    """Continue the checkpoint's tracker runs (rank 0); rows queued after its step are dropped."""
    tracking = run.tracking
    if tracking is not None:
        tracking.load_state_dict(own.get("trackers"), run.loop.step)


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
    own = checked_own(dcp.load_own(target), target)
    dcp.load(target, state)
    _restore_entries(state, own["user"], [k for k in dcp.plain_entries(state) if k in own["user"]], target)
    run.precision.load_state_dict(own["precision"])
    run.loop.restore(own["loop"], source=str(target), strict=strict)
    _restore_rng(run, peers, own, target)
    _restore_tracking(run, own)
    return target


def _restore_rng(run: RunState, peers: Peers, own: Mapping[str, Any], target: Path) -> None:
    saved_world = int(own.get("world_size", 1))
    if saved_world == peers.world_size:
        rng.set_rng_state(own["rng"][peers.rank])
    elif peers.is_main:
        afresh = (  # a micro-shard's draws (its dropout) are keyed by step and shard, not by process
            "draws outside rt.shards start afresh"
            if run.micro_shards
            else "per-process random streams (dropout) start afresh; micro_shards keeps them too"
        )
        warn(
            f"checkpoint {target} was written by {saved_world} process(es) and resumes on "
            f"{peers.world_size}: the data order and per-sample randomness continue exactly, {afresh}"
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
    meet("load", peers.save_timeout)
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
    found = payload.get("ddpkit")
    if isinstance(found, dict) and "loop" not in found:
        raise DdpkitError(
            f"checkpoint {target} was written by ddpkit {payload.get('ddpkit_version', '?')}, "
            "before loader positions were keyed by name: its weights load with "
            "ddpkit.checkpoint.read(path)['user'], but it cannot resume a loop"
        )
    own = checked_own(found, target)
    if not isinstance(payload.get("user"), dict):
        raise DamagedCheckpoint(
            f"checkpoint {target} holds no dict of the script's entries under 'user'; it was not written so by ddpkit"
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
    _restore_rng(run, peers, own, target)
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
            if grad is not None and grad.shape != param.shape:
                raise DdpkitError(
                    f"checkpoint {target} holds an open accumulation group's gradient of shape {tuple(grad.shape)} "
                    f"for a parameter of shape {tuple(param.shape)}; build the model as it was saved"
                )
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
        loaded = _restore(run, peers, found, state, verified=True, strict=strict)
    else:
        loaded = load(run, peers, source, state, strict=strict)
    if peers.is_main:  # as Lightning's "Restored all states from the checkpoint at ..."
        sys.stderr.write(f"ddpkit: resumed from {loaded}: {run.loop.resumed_at()}\n")
    return loaded


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


__all__ = ["load", "newest_agreed", "restore_pending", "resume"]
