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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddpkit import checkpoint, rng
from ddpkit._torch import unwrap
from ddpkit._version import __version__
from ddpkit.checkpoint import background, dcp, safe
from ddpkit.distributed import collectives, store_sync
from ddpkit.errors import DdpkitError, UsageError
from ddpkit.observe.collectives import counted_wait
from ddpkit.observe.heartbeats import beat
from ddpkit.parallel import lazy_buffers, periodic
from ddpkit.parallel.modes import ProcessGroup
from ddpkit.state.run import RunState


def meet(what: str, timeout_s: float, part: bytes = b"1") -> str:
    """:func:`~ddpkit.distributed.store_sync.all_arrive` at ``rt.<what>``, waited in as a collective of
    every rank's (:func:`~ddpkit.observe.collectives.counted_wait`): a rank that waits here while a
    peer waits in another collective (DDP's exchange, on a rank with one more batch of its own) is a
    mismatch named in seconds, with both lines, not a peer that missed ``rt.<what>`` after a minute."""
    with counted_wait(f"rt.{what}"):
        return store_sync.all_arrive(what, timeout_s, part)


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


def save(
    run: RunState,
    peers: Peers,
    path: str | os.PathLike,
    state: Mapping[str, Any],
    *,
    keep: int = 3,
    blocking: bool = True,
) -> Path:
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
        blocking: write before returning; else rank 0 returns once its snapshot is taken and
            writes in the background (:mod:`ddpkit.checkpoint.background`). Either way a save
            first waits for the write in flight, and a failed one raises here on every rank.

    Returns:
        The checkpoint written (or being written).
    """
    beat("save")
    if run.sharded():
        safe.check_loadable(checkpoint.user_state(state))  # on every rank, before the meeting: none waits
        return _save_sharded(run, peers, Path(path), state, keep, blocking)
    light = {"rng": rng.rng_state(), "buffers": [None if b is None else b.captured() for b in run.buffers]}
    # each rank brings its RNG states and statistics to the meeting (the launcher's store keeps them
    # when a rank dies right after), so rank 0 writes them behind the loop with no collective
    meeting_point = meet("save", peers.save_timeout, b"1" if peers.is_main else collectives.object_bytes(light))
    # after the meeting: a long write in flight on rank 0 is never taken for a rank that did not come
    lazy_buffers.average_copies(state)  # a copy's statistics (an EMA's), equal on every rank (collectives)
    failed = settle(run)  # at most one write in flight (rank 0's, in all but a fault-tolerant replica)
    path = Path(path)
    target = target_of(path, run.loop.step)
    rotate = target != path
    heavy = _heavy(run)  # part-accumulated gradients, compression: gathered now, when there are any
    if not peers.is_main:
        store_sync.share_outcome(meeting_point, None, peers.timeout_s)
        if failed is not None:
            raise DdpkitError(failed)
        return target
    others = store_sync.take_parts(meeting_point)
    users = _users_of_buffers(run, state)
    user = _with_exports(checkpoint.user_state(state), state)
    # each entry at the top level too (the same tensors, stored once): torch.load(path)["model"] reads
    # as a torch.save({"model": ...}) file would, for the scripts that read checkpoints themselves
    payload = {
        **{key: value for key, value in user.items() if key not in _HEADER},
        "format": checkpoint.FORMAT,
        "version": checkpoint.VERSION,
        "ddpkit_version": __version__,
        "user": user,
        "ddpkit": {**_own_state(run, peers, []), **heavy},
    }
    if failed is not None:  # the previous save's bytes never got there: every rank stops here
        store_sync.share_outcome(meeting_point, failed, peers.timeout_s)
        raise DdpkitError(failed)
    problem = safe.unloadable(user)  # what the resume would refuse, in what rank 0 writes: every rank stops
    if problem is not None:
        store_sync.share_outcome(meeting_point, problem, peers.timeout_s, usage=True)
        raise UsageError(problem)

    step = run.loop.step

    def write(data: Mapping[str, Any]) -> None:
        data = _completed(data, [light, *map(collectives.object_from, others)], users)
        checkpoint.write(target, data)
        if rotate:
            checkpoint.prune(path, keep)  # after the new one is durable: the previous one stays till then
        _saved_tracking(run, step)  # right after the rename, on whichever thread wrote

    if not blocking:
        if run.tracking is not None:
            run.tracking.saving()  # rows logged from now on wait for a checkpoint, as after a blocking save
        later = background.Later(_optimizers(run, state))  # their memory is copied behind the loop
        try:
            copied = background.snapshot(payload, background.WRITER.spare, later=later)
        except Exception as exc:
            store_sync.share_outcome(meeting_point, f"could not copy checkpoint {target}: {exc}", peers.timeout_s)
            raise
        # a peer's death now waits for this write before the agent's SIGTERM ends us: held before the
        # peers learn the outcome, since one may leave (and the agent send SIGTERM) right after
        background.hold_term()
        store_sync.share_outcome(meeting_point, None, peers.timeout_s)
        held = background.nbytes(copied) + background.nbytes(light) + sum(map(len, others))
        # the snapshot stays as taken (the next one's spare): what the write adds goes into new containers
        background.WRITER.submit(str(target), lambda: write(copied), held_bytes=held, data=copied, later=later)
        return target
    try:
        write(payload)
    except Exception as exc:
        why = background.why(exc, target)
        store_sync.share_outcome(meeting_point, f"could not write checkpoint {target}: {why}", peers.timeout_s)
        raise
    store_sync.share_outcome(meeting_point, None, peers.timeout_s)
    return target


def refuse_unapplied(run: RunState, call: str) -> None:
    """Refuse, on every rank, a save between ``rt.backward`` and the step that applies its gradients
    outside an ``rt.accumulate`` group (whose checkpoints keep the group's gradients): accumulation by
    hand (``rt.backward(loss / k)``, ``rt.step`` every k batches), a save before ``rt.step``, or a pass
    that ends mid-group and carries its gradients into the next. The checkpoint would hold the weights
    of the last step without those gradients, so a run resumed from it would not continue this one.

    Raises:
        UsageError: gradients of a backward wait for their step.
    """
    if not run.backward_since_step or run.loop.micro_step:
        return
    if not any(p.grad is not None for model in run.models for p in model.parameters()):
        return  # dropped (optimizer.zero_grad()) without a step: nothing is lost
    raise UsageError(
        f"{call} at step {run.loop.step}: the gradients of rt.backward since the last rt.step are not "
        "applied yet, and a checkpoint here would hold the last step's weights without them, so a run "
        "resumed from it would not continue this one; save after rt.step (step at a pass's last batch too, or call "
        "optimizer.zero_grad() to drop them), or accumulate with rt.accumulate(model, k), whose "
        "checkpoints keep an open group"
    )


def refuse_incomplete(run: RunState, state: Mapping[str, Any], call: str) -> None:
    """Refuse, on every rank, a state that leaves out an optimizer the run steps, or a learning-rate
    scheduler of one: a run resumed from it would start them anew, silently not continuing this one (a
    schedule restarted at its warm-up, momentum lost). ``rt.resume`` asks for the optimizers given to
    ``rt.setup``; a save for those stepped since the last save (Adam for a warm-up, then SGD: SGD alone).
    A scheduler is asked for where one of the optimizer's is alive and the state holds none: one dropped
    (a warm-up over) is not. An optimizer counts as held through a wrapper over its groups (Lookahead)
    or an object of the script's own that keeps it (or its scheduler) as an attribute; their state dicts
    kept as plain values are not looked into.

    Raises:
        UsageError: the optimizer or scheduler the state lacks, and the entry to add.
    """
    held = _held(state)
    plain = [value for value in held if isinstance(value, Mapping)]
    needed = list(run.given) if call == "rt.resume" else [o for o in run.optimizers if o in run.stepped]
    if not any("param_groups" in value for value in plain):  # (no optimizer's state dict, loaded by hand)
        for optimizer in needed:
            if not any(_same_optimizer(value, optimizer) for value in held):
                raise UsageError(
                    f"{call}: the state holds no {type(optimizer).__name__} optimizer, which this run steps: a run "
                    "resumed from it would start that optimizer anew (its momentum or moments lost), not continue "
                    "this one; add it to the state (state['optimizer'] = optimizer)"
                )
    if any("last_epoch" in value or "base_lrs" in value for value in plain):
        return  # a scheduler's state dict, restored by hand
    optimizers = [value for value in held if isinstance(getattr(value, "param_groups", None), list)]
    for optimizer in [*optimizers, *(o for o in needed if not any(_same_optimizer(h, o) for h in optimizers))]:
        if call != "rt.resume" and not any("initial_lr" in group for group in optimizer.param_groups):
            continue  # (every scheduler of torch's and timm's but ReduceLROnPlateau sets it: no search)
        if any(_same_optimizer(getattr(value, "optimizer", None), optimizer) for value in held):
            continue
        live = _live_scheduler(optimizer)
        if live is not None:
            raise UsageError(
                f"{call}: the {type(optimizer).__name__} optimizer has a learning-rate scheduler "
                f"({type(live).__name__}), but the state holds none: a run resumed from it would start the "
                "schedule over, not continue this one; add it to the state (state['scheduler'] = scheduler)"
            )


def _held(state: Mapping[str, Any]) -> list[Any]:
    """The state's values, and what an object of the script's own with a ``state_dict`` keeps as its
    attributes (directly, or in a list, tuple or dict): a trainer holding the optimizer and its scheduler."""
    held = [unwrap(value) for value in state.values()]
    for value in list(held):
        if isinstance(value, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor, Mapping)):
            continue
        if not callable(getattr(value, "state_dict", None)) or _is_scheduler(value):
            continue  # (a scheduler keeps its optimizer, but its state leaves it out)
        for part in getattr(value, "__dict__", {}).values():
            held += list(part.values()) if isinstance(part, Mapping) else [part]
            held += list(part) if isinstance(part, (list, tuple)) else []
    return held


def _same_optimizer(value: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``value`` is ``optimizer``, or steps its groups (a wrapper: Lookahead's are its inner one's)."""
    if value is optimizer:
        return True
    groups = getattr(value, "param_groups", None)
    if not isinstance(groups, list):
        return False
    mine = optimizer.param_groups  # (the same group dicts: two optimizers over the same parameters are two)
    return groups is mine or (len(groups) == len(mine) > 0 and all(a is b for a, b in zip(groups, mine)))


def _is_scheduler(obj: Any) -> bool:
    """Whether ``obj`` is a learning-rate scheduler: torch's, or one named so (timm's ``CosineLRScheduler``)."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    kind = isinstance(obj, (LRScheduler, ReduceLROnPlateau)) or type(obj).__name__.endswith(("Scheduler", "LR"))
    return kind and callable(getattr(obj, "state_dict", None)) and hasattr(obj, "optimizer")


def _live_scheduler(optimizer: torch.optim.Optimizer) -> Any:
    """A learning-rate scheduler of ``optimizer`` that is still alive (found among what refers to it), or None."""
    import gc

    def scheduler(obj: Any) -> bool:
        return _is_scheduler(obj) and getattr(obj, "optimizer", None) is optimizer

    for referrer in gc.get_referrers(optimizer):
        if scheduler(referrer):
            return referrer
        if isinstance(referrer, dict):  # an instance's __dict__: its owner refers to it
            owner = next((obj for obj in gc.get_referrers(referrer) if scheduler(obj)), None)
            if owner is not None:
                return owner
    return None


def _optimizers(run: RunState, state: Mapping[str, Any]) -> list[torch.optim.Optimizer]:
    """The optimizers whose parameters and state a save may copy behind the loop: the run's and
    the saved ones. Only where the processes are one plain group: a fault-tolerant replica's
    parameters also change when it heals from a peer, outside any step."""
    if not isinstance(run.world, ProcessGroup):
        return []
    found = list(run.optimizers)
    found += [o for o in map(unwrap, state.values()) if isinstance(o, torch.optim.Optimizer) and o not in found]
    return found


def _heavy(run: RunState) -> dict[str, Any]:
    """What a checkpoint keeps of every rank that may be large, gathered (every rank calls it): the
    part-accumulated gradients inside an accumulation group, the models' compression and sync states."""
    found: dict[str, Any] = {}
    grads = _open_group_grads(run)
    if grads is not None:
        found["accumulated_grads"] = collectives.all_gather_object(grads)
    states = [entry.mode.state_dict() for entry in run.entries]
    if any(state is not None for state in states):  # the same models on every rank
        found["compression"] = collectives.all_gather_object(states)  # per rank, per model
    return found


def _completed(payload: Mapping[str, Any], ranks: list[dict[str, Any]], users: Mapping[str, int]) -> dict[str, Any]:
    """``payload`` with every rank's RNG states (``ranks``: each rank's, in rank order) and, where
    BatchNorm statistics are averaged lazily, each rank's own (for resume) and their averages in
    place of rank 0's in the model entries; new containers where it changes, so a snapshot stays as
    taken (the next one's spare)."""
    own = {**payload["ddpkit"], "rng": [r["rng"] for r in ranks]}
    if any(c is not None for c in ranks[0]["buffers"]):
        own_stats, averages = lazy_buffers.saved([r["buffers"] for r in ranks])
        own["buffers"] = own_stats  # per rank, per model: its own statistics, for resume
    else:
        averages = [{} for _ in ranks[0]["buffers"]]
    user = dict(payload["user"])
    for key, index in users.items():
        found = averages[index]
        if found:
            saved = user[key]
            user[key] = type(saved)({k: found.get(k, v) for k, v in saved.items()})
            if hasattr(saved, "_metadata"):  # torch's per-module versions, for load
                user[key]._metadata = saved._metadata
    out = dict(payload)
    out.update({key: value for key, value in user.items() if key not in _HEADER})
    out["user"], out["ddpkit"] = user, own
    return out


def settle(run: RunState) -> str | None:
    """Wait for the background write in flight; its error, if it failed (its tracker rows went out
    on the writer's thread as soon as it was in place)."""
    done = background.WRITER.wait()
    return None if done is None else done.error


def target_of(path: str | os.PathLike, step: int) -> Path:
    """The file :func:`save` writes for ``path`` at ``step``: ``path`` itself, or in a checkpoint
    directory (an existing directory, or a path without a suffix) the step's ``ckpt-stepNNNNNNNN.pt``."""
    path = Path(path)
    return checkpoint.step_path(path, step) if path.is_dir() or path.suffix == "" else path


def _saved_tracking(run: RunState, step: int) -> None:
    """The checkpoint of ``step`` is on disk: the trackers get the rows it covers (rank 0)."""
    tracking = run.tracking
    if tracking is not None:
        tracking.saved(step)


def _with_exports(user: dict[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
    """The saved model entries with the synced weights of a model that syncs infrequently in place
    of rank 0's local ones."""
    for key, value in state.items():
        if isinstance(user.get(key), dict) and periodic.of(value) is not None:
            user[key] = periodic.exported(value, user[key])
    return user


def _users_of_buffers(run: RunState, state: Mapping[str, Any]) -> dict[str, int]:
    """The entries of ``state`` whose model's BatchNorm statistics are averaged lazily: the index of
    its syncer in ``run.buffers`` by key (its checkpoint entry gets the averages)."""
    found = {}
    for key, value in state.items():
        syncer = lazy_buffers.of(value, copies=False)  # a set-up model's own entry: its averages go in by name
        index = next((i for i, b in enumerate(run.buffers) if syncer is not None and b is syncer), None)
        if index is not None:
            found[key] = index
    return found


def _open_group_grads(run: RunState) -> list[Any] | None:
    """This rank's part-accumulated gradients (copies) when a save falls inside an accumulation group."""
    if run.loop.micro_step == 0:
        return None
    return [
        [None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in model.parameters()]
        for model in run.models
    ]


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


def _save_sharded(run: RunState, peers: Peers, path: Path, state: Mapping[str, Any], keep: int, blocking: bool) -> Path:
    """A DCP checkpoint in a fresh step directory of ``path`` (see :mod:`ddpkit.checkpoint.dcp`);
    not ``blocking``: DCP's ``async_save`` on every rank, sealed by rank 0's writer thread."""
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
    meeting_point = meet("save", peers.save_timeout)
    failed = settle(run)  # every rank's shards of the previous save, and rank 0's seal (after the meeting)
    target = checkpoint.step_dir(path, run.loop.step)
    rngs = collectives.all_gather_object(rng.rng_state())
    token = collectives.broadcast_object(uuid.uuid4().hex[:12] if peers.is_main else None)
    failures = [f for f in collectives.all_gather_object(failed) if f is not None]
    if failures:  # every rank stops here, whichever rank's write failed
        if peers.is_main:
            store_sync.share_outcome(meeting_point, failures[0], peers.timeout_s)
        raise DdpkitError(failures[0])
    own = None
    if peers.is_main:
        plain = {key: state[key] for key in dcp.plain_entries(state)}
        own = {
            **_own_state(run, peers, rngs),
            "user": checkpoint.user_state(plain),
            "ddpkit_version": __version__,
            "strategy": "fsdp",
        }
    step = run.loop.step

    def seal_and_prune() -> None:
        if peers.is_main:
            dcp.prune(path, keep, token)
        _saved_tracking(run, step)

    try:
        if blocking:
            dcp.save(target, state, own, token)
            seal_and_prune()
        else:
            if run.tracking is not None:
                run.tracking.saving()
            background.hold_term()  # from here a peer's death waits for this write
            finish, held = dcp.save_in_background(
                target, state, None if own is None else background.snapshot(own), token
            )
    except Exception as exc:
        store_sync.share_outcome(
            meeting_point, f"could not write checkpoint {target}: {exc}" if peers.is_main else None, peers.timeout_s
        )
        raise
    store_sync.share_outcome(meeting_point, None, peers.timeout_s)
    if not blocking:

        def write() -> None:
            finish()
            seal_and_prune()

        background.WRITER.submit(str(target), write, held_bytes=held, data={})
    return target
