"""Saving and resuming a run's whole state: the user's objects and ddpkit's own.

:class:`Resumable` is a base of :class:`ddpkit.training.Training`: ``rt.save``, ``rt.load``,
``rt.checkpoint`` and ``rt.resume``. A checkpoint holds the loop state (:mod:`ddpkit.loopstate`:
epoch, step, the training loaders' positions by name, the accumulation group), every rank's RNG
states, the precision's scaler and, inside an accumulation group, each rank's part-accumulated
gradients, so a resumed run continues with the very next batch and the same random streams
(:mod:`ddpkit.checkpoint` is the file format).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, MutableMapping

from ddpkit import checkpoint, rng
from ddpkit.checkpoint import dcp
from ddpkit.dist import collectives, store_sync
from ddpkit.errors import DdpkitError, UsageError


class Resumable:
    """Save, load and resume; uses the loop state that :class:`Training` keeps in ``self.loop``."""

    rank: int
    world_size: int
    is_main: bool
    seed: int | None
    keep_checkpoints: int
    checkpoint_dir: Path | None
    resume_from: str | None
    precision: Any
    loop: Any
    timeout_s: float
    save_timeout: float
    _models: list[Any]
    _compressors: list[Any]
    _saved_compression: Any
    _buffers: list[Any]
    _saved_buffers: Any

    def barrier(self) -> None:   # provided by Runtime
        raise NotImplementedError

    def heartbeat(self, phase: str) -> None:   # provided by Runtime
        raise NotImplementedError

    def save(self, path: str | os.PathLike, state: Mapping[str, Any]) -> Path:
        """Save ``state`` plus ddpkit's own (loop state, every rank's RNGs, scaler).

        Every rank must call it (it gathers each rank's random state); called on rank 0 alone it
        fails within ``save_timeout`` seconds, naming the ranks that did not come. Global rank 0
        writes atomically; if the write fails, every rank raises. A directory ``path`` gets
        ``ckpt-stepNNNNNNNN.pt`` and keeps the newest ``keep_checkpoints``.
        """
        self.heartbeat("save")
        if self._sharded():
            return self._save_sharded(Path(path), state)
        meeting_point = store_sync.all_arrive("save", self.save_timeout)
        path = Path(path)
        rotate = path.is_dir() or path.suffix == ""
        target = checkpoint.step_path(path, self.loop.step) if rotate else path
        rngs = collectives.all_gather_object(rng.rng_state())
        grads = self._open_group_grads()
        own_stats, averages = None, {}
        if any(b is not None for b in self._buffers):         # lazily averaged BatchNorm statistics
            for syncer in self._buffers:
                if syncer is not None:
                    syncer.agree()      # a layer trained on one rank only is saved as dirty on all
            own_stats = collectives.all_gather_object([None if b is None else b.state_dict() for b in self._buffers])
            averages = {b: b.averaged() for b in self._buffers if b is not None}    # out of place
        compression = None
        if any(c is not None for c in self._compressors):    # the same models on every rank
            compression = collectives.all_gather_object(
                [None if c is None else c.state_dict() for c in self._compressors])
        if not self.is_main:
            store_sync.share_outcome(meeting_point, None, self.timeout_s)
            return target
        own = self._own_state(rngs)
        if grads is not None:
            own["accumulated_grads"] = grads
        if compression is not None:
            own["compression"] = compression      # per rank, per model: the compressor's state
        if own_stats is not None:
            own["buffers"] = own_stats            # per rank, per model: its own statistics, for resume
        payload = {"format": checkpoint.FORMAT, "version": checkpoint.VERSION, "ddpkit_version": _version(),
                   "user": self._with_averages(checkpoint.user_state(state), state, averages), "ddpkit": own}
        try:
            checkpoint.write(target, payload)
            if rotate:
                checkpoint.prune(path, self.keep_checkpoints)
        except Exception as exc:
            store_sync.share_outcome(meeting_point, f"could not write checkpoint {target}: {exc}", self.timeout_s)
            raise
        store_sync.share_outcome(meeting_point, None, self.timeout_s)
        return target

    @staticmethod
    def _with_averages(user: dict[str, Any], state: Mapping[str, Any], averages: Mapping[Any, Any]) -> dict[str, Any]:
        """The saved model entries with BatchNorm statistics replaced by their cross-rank averages."""
        from ddpkit.parallel import lazy_buffers

        for key, value in state.items():
            found = averages.get(lazy_buffers.of(value))      # by syncer; empty when nothing was dirty
            if found:
                saved = user[key]
                user[key] = type(saved)({k: found.get(k, v) for k, v in saved.items()})
                if hasattr(saved, "_metadata"):           # torch's per-module versions, for load
                    user[key]._metadata = saved._metadata
        return user

    def _open_group_grads(self) -> list[Any] | None:
        """Every rank's part-accumulated gradients when a save falls inside an accumulation group."""
        if self.loop.micro_step == 0:
            return None
        mine = [[None if p.grad is None else p.grad.detach().cpu().clone() for p in model.parameters()]
                for model in self._models]
        return collectives.all_gather_object(mine)

    def _own_state(self, rngs: list[Any]) -> dict[str, Any]:
        """ddpkit's part of every checkpoint: the loop, every rank's RNGs, precision, settings."""
        return {"loop": self.loop.state_dict(), "epoch": self.loop.epoch, "step": self.loop.step,
                "rng": rngs, "world_size": self.world_size, "precision": self.precision.state_dict(),
                "config": {"seed": self.seed, "precision": self.precision.name}}

    def _sharded(self) -> bool:
        from ddpkit.parallel.fsdp import is_sharded

        return any(is_sharded(model) for model in self._models)

    def _save_sharded(self, path: Path, state: Mapping[str, Any]) -> Path:
        """A DCP checkpoint in a fresh step directory of ``path`` (see :mod:`ddpkit.checkpoint.dcp`)."""
        import uuid

        if path.suffix == ".pt":
            raise UsageError(f"rt.save({str(path)!r}): under strategy='fsdp' a checkpoint is a directory of "
                             "shards; give a checkpoint directory (each save makes a ckpt-stepNNNNNNNN in it)")
        if self.loop.micro_step:
            raise UsageError("rt.save inside an accumulation group under strategy='fsdp' is not supported; "
                             "save at the step that ends a group")
        meeting_point = store_sync.all_arrive("save", self.save_timeout)
        target = checkpoint.step_dir(path, self.loop.step)
        rngs = collectives.all_gather_object(rng.rng_state())
        token = collectives.broadcast_object(uuid.uuid4().hex[:12] if self.is_main else None)
        own = None
        if self.is_main:
            plain = {key: state[key] for key in dcp.plain_entries(state)}
            own = {**self._own_state(rngs), "user": checkpoint.user_state(plain),
                   "ddpkit_version": _version(), "strategy": "fsdp"}
        try:
            dcp.save(target, state, own, token)
            if self.is_main:
                dcp.prune(path, self.keep_checkpoints, token)
        except Exception as exc:
            store_sync.share_outcome(meeting_point, f"could not write checkpoint {target}: {exc}" if self.is_main
                                     else None, self.timeout_s)
            raise
        store_sync.share_outcome(meeting_point, None, self.timeout_s)
        return target

    def _restore_sharded(self, target: Path, state: MutableMapping[str, Any], strict: bool, *,
                         verified: bool) -> Path:
        problem = None
        if self.is_main and not verified:      # checkpoint.latest verified what it found
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
        self.precision.load_state_dict(own["precision"])
        self.loop.restore(own["loop"], source=str(target), strict=strict)
        self._restore_rng(own, target)
        return target

    def _restore_rng(self, own: Mapping[str, Any], target: Path) -> None:
        saved_world = int(own.get("world_size", 1))
        if saved_world == self.world_size:
            rng.set_rng_state(own["rng"][self.rank])
        elif self.is_main:
            import warnings

            warnings.warn(f"checkpoint {target} was written by {saved_world} process(es) and resumes on "
                          f"{self.world_size}: the data order and per-sample randomness continue exactly, "
                          "per-process random streams (dropout) start afresh", stacklevel=3)

    def load(self, path: str | os.PathLike, state: MutableMapping[str, Any], *, strict: bool = True) -> Path:
        """Restore ``state`` and ddpkit's own on every rank; a directory means its newest checkpoint.

        Resumes mid-epoch exactly: the next batch is the one after the last trained, also for
        loaders built after ``load``. A saved position that matches no loader, or a loader built
        differently from the saved one, is an error (a warning with ``strict=False``, and that
        loader's epoch starts over). Every rank must call it.
        """
        store_sync.all_arrive("load", self.save_timeout)
        target = Path(path)
        if target.is_dir() and not dcp.is_dcp(target):
            found = self._newest_agreed(target)
            if found is None:
                raise DdpkitError(f"no complete checkpoint in {target}")
            return self._restore(found, state, verified=True, strict=strict)
        return self._restore(target, state, verified=False, strict=strict)

    def _restore(self, target: Path, state: MutableMapping[str, Any], *, verified: bool,
                 strict: bool = True) -> Path:
        if dcp.is_dcp(target):           # a sharded checkpoint: rank 0 verifies it for everyone
            return self._restore_sharded(target, state, strict, verified=verified)
        payload = checkpoint.read(target, verified=verified)
        own = payload["ddpkit"]
        if "loop" not in own:
            raise DdpkitError(f"checkpoint {target} was written by ddpkit {payload.get('ddpkit_version', '?')}, "
                              "before loader positions were keyed by name: its weights load with "
                              "ddpkit.checkpoint.read(path)['user'], but it cannot resume a loop")
        saved_world = int(own.get("world_size", 1))
        if own["loop"].get("micro_step") and saved_world != self.world_size:      # before anything changes
            raise DdpkitError(f"checkpoint {target} was saved inside an accumulation group on {saved_world} "
                              f"process(es); resume it on {saved_world}, or save at the step that ends a group")
        taken: list[str] = []
        if self._sharded():             # a replicated (DDP) run's checkpoint, into sharded models
            taken = dcp.load_plain_into_sharded(state, payload["user"])
        _restore_entries(state, {k: v for k, v in payload["user"].items() if k not in taken},
                         [key for key in state if key not in taken], target)
        self.precision.load_state_dict(own["precision"])
        self.loop.restore(own["loop"], source=str(target), strict=strict)
        if "accumulated_grads" in own:
            self._restore_grads(own["accumulated_grads"][self.rank], target)
        saved = own.get("compression")
        mine = None if saved is None else saved[min(self.rank, saved_world - 1)]
        self._saved_compression = (mine, saved_world == self.world_size, str(target))
        stats = own.get("buffers")
        # on another world size every rank keeps the averages the model entry holds
        self._saved_buffers = stats[self.rank] if stats is not None and saved_world == self.world_size else None
        if self._saved_buffers is None:
            for syncer in self._buffers:        # the loaded statistics are equal on every rank
                if syncer is not None:
                    syncer.dirty.clear()
        for index in range(len(self._models)):
            self._restore_compression(index)
            self._restore_buffers(index)
        self._restore_rng(own, target)
        return target

    def _restore_buffers(self, index: int) -> None:
        """Give model ``index`` this rank's own saved BatchNorm statistics (load before or after setup)."""
        saved = self._saved_buffers
        if saved is None or index >= len(saved) or saved[index] is None or self._buffers[index] is None:
            return
        self._buffers[index].load_state_dict(saved[index])

    def _restore_compression(self, index: int) -> None:
        """Give model ``index``'s compressor its saved state (load may come before or after setup)."""
        if self._saved_compression is None:
            return
        import warnings

        states, same_world, source = self._saved_compression
        saved = states[index] if states is not None and index < len(states) else None
        compressor = self._compressors[index]
        with warnings.catch_warnings():
            if not self.is_main:
                warnings.simplefilter("ignore")
            if compressor is not None:
                compressor.load_state_dict(saved or {"name": None}, same_world=same_world, source=source)
            elif saved is not None:
                warnings.warn(f"checkpoint {source} was trained with grad_compression={saved['name']!r} and "
                              "resumes without compression", stacklevel=3)

    def _restore_grads(self, saved: list[list[Any]], target: Path) -> None:
        if len(saved) != len(self._models):
            raise DdpkitError(f"checkpoint {target} holds the gradients of {len(saved)} model(s) of an open "
                              f"accumulation group; call rt.setup for each ({len(self._models)} so far) before load")
        for model, grads in zip(self._models, saved):
            for param, grad in zip(model.parameters(), grads):
                if grad is None:
                    param.grad = None
                elif param.grad is None:
                    param.grad = grad.to(param.device)
                else:
                    param.grad.copy_(grad)

    def checkpoint(self, state: Mapping[str, Any]) -> Path:
        """Save ``state`` into ``checkpoint_dir`` (given to :func:`ddpkit.init`), keeping the newest few."""
        if self.checkpoint_dir is None:
            raise UsageError("rt.checkpoint(state) needs ddpkit.init(checkpoint_dir=...)")
        return self.save(self.checkpoint_dir, state)

    def resume(self, state: MutableMapping[str, Any], *, strict: bool = True) -> Path | None:
        """Load what ``init(resume=...)`` names into ``state``; returns the checkpoint, or None.

        ``resume="auto"`` takes the newest complete checkpoint of ``checkpoint_dir`` and does
        nothing when there is none yet, so one script serves the first start and every
        restart of ``ddpkit run --max-restarts K``. ``strict`` as for :meth:`load`.
        """
        if self.resume_from is None:
            return None
        if self.resume_from == "auto":
            found = None if self.checkpoint_dir is None else self._newest_agreed(self.checkpoint_dir)
            if found is None:
                return None
            return self._restore(found, state, verified=True, strict=strict)
        return self.load(self.resume_from, state, strict=strict)

    def _newest_agreed(self, directory: Path) -> Path | None:
        """The newest complete checkpoint in ``directory`` as rank 0 sees it, the same on every rank.

        Ranks looking on their own could disagree (a node-local disk holds no checkpoints, a
        save lands between two looks) and silently train from different states; and only rank
        0 hashes the file. Every rank must call it.
        """
        found = checkpoint.latest(directory) if self.is_main else None     # verifies what it returns
        found = collectives.broadcast_object(None if found is None else str(found))
        if found is None:
            return None
        if not Path(found).exists():
            import socket

            raise DdpkitError(
                f"rank 0 resumes from {found}, which rank {self.rank} cannot read on {socket.gethostname()}: "
                "put checkpoint_dir on a filesystem every node shares"
            )
        return Path(found)


def _restore_entries(state: MutableMapping[str, Any], saved: Mapping[str, Any], keys: list[str], path: Path) -> None:
    """Load ``saved`` into the entries ``keys`` of ``state`` (objects in place, plain values replaced)."""
    part = {key: state[key] for key in keys}
    checkpoint.restore_user_state(part, saved, path)
    state.update(part)


def _version() -> str:
    from ddpkit import __version__

    return __version__
