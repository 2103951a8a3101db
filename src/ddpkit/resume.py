"""Saving and resuming a run's whole state: the user's objects and ddpkit's own.

:class:`Resumable` is a base of :class:`ddpkit.training.Training`: ``rt.save``, ``rt.load``,
``rt.checkpoint`` and ``rt.resume``. A checkpoint holds epoch, step, each loader's position,
every rank's RNG states and the precision's scaler, so a resumed run continues with the very
next batch and the same random streams (:mod:`ddpkit.checkpoint` is the file format).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, MutableMapping

from ddpkit import checkpoint, collectives
from ddpkit.errors import DdpkitError, UsageError


class Resumable:
    """Save, load and resume; uses the training state that :class:`Training` keeps on ``self``."""

    rank: int
    world_size: int
    is_main: bool
    epoch: int
    global_step: int
    seed: int | None
    keep_checkpoints: int
    checkpoint_dir: Path | None
    resume_from: str | None
    precision: Any
    _loaders: list[Any]

    def barrier(self) -> None:   # provided by Runtime
        raise NotImplementedError

    def heartbeat(self, phase: str) -> None:   # provided by Runtime
        raise NotImplementedError

    def save(self, path: str | os.PathLike, state: Mapping[str, Any]) -> Path:
        """Save ``state`` plus ddpkit's own (epoch, step, loader positions, RNGs, scaler).

        Global rank 0 writes atomically; the others wait. A directory ``path`` gets
        ``ckpt-stepNNNNNNNN.pt`` and keeps the newest ``keep_checkpoints``.
        """
        self.heartbeat("save")
        path = Path(path)
        rotate = path.is_dir() or path.suffix == ""
        target = checkpoint.step_path(path, self.global_step) if rotate else path
        rngs = collectives.all_gather_object(checkpoint.rng_state())
        if self.is_main:
            payload = {
                "format": checkpoint.FORMAT, "version": checkpoint.VERSION, "ddpkit_version": _version(),
                "user": checkpoint.user_state(state),
                "ddpkit": {
                    "epoch": self.epoch, "step": self.global_step,
                    "loaders": [made.state_dict() for made in self._loaders],
                    "rng": rngs, "world_size": self.world_size,
                    "precision": self.precision.state_dict(),
                    "config": {"seed": self.seed, "precision": self.precision.name},
                },
            }
            checkpoint.write(target, payload)
            if rotate:
                checkpoint.prune(path, self.keep_checkpoints)
        self.barrier()
        return target

    def load(self, path: str | os.PathLike, state: MutableMapping[str, Any]) -> Path:
        """Restore ``state`` and ddpkit's own on every rank; a directory means its newest checkpoint.

        Resumes mid-epoch exactly: the next batch is the one after the last trained.
        """
        target = Path(path)
        if target.is_dir():
            found = self._newest_agreed(target)
            if found is None:
                raise DdpkitError(f"no complete checkpoint in {target}")
            return self._restore(found, state, verified=True)
        return self._restore(target, state, verified=False)

    def _restore(self, target: Path, state: MutableMapping[str, Any], *, verified: bool) -> Path:
        payload = checkpoint.read(target, verified=verified)
        checkpoint.restore_user_state(state, payload["user"], target)
        own = payload["ddpkit"]
        self.precision.load_state_dict(own["precision"])
        self.epoch, self.global_step = int(own["epoch"]), int(own["step"])
        for made, saved in zip(self._loaders, own.get("loaders", [])):
            made.load_state_dict(saved)
        if self._loaders and all(m.position >= len(m) for m in self._loaders):
            self.epoch += 1            # saved at the end of an epoch: go on with the next
            for made in self._loaders:
                made.set_epoch(self.epoch)
        saved_world = int(own.get("world_size", 1))
        if saved_world == self.world_size:
            checkpoint.set_rng_state(own["rng"][self.rank])
        elif self.is_main:
            import warnings

            warnings.warn(f"checkpoint {target} was written by {saved_world} process(es) and resumes on "
                          f"{self.world_size}: the data order and per-sample randomness continue exactly, "
                          "per-process random streams (dropout) start afresh", stacklevel=2)
        return target

    def checkpoint(self, state: Mapping[str, Any]) -> Path:
        """Save ``state`` into ``checkpoint_dir`` (given to :func:`ddpkit.init`), keeping the newest few."""
        if self.checkpoint_dir is None:
            raise UsageError("rt.checkpoint(state) needs ddpkit.init(checkpoint_dir=...)")
        return self.save(self.checkpoint_dir, state)

    def resume(self, state: MutableMapping[str, Any]) -> Path | None:
        """Load what ``init(resume=...)`` names into ``state``; returns the checkpoint, or None.

        ``resume="auto"`` takes the newest complete checkpoint of ``checkpoint_dir`` and does
        nothing when there is none yet, so one script serves the first start and every
        restart of ``ddpkit run --max-restarts K``.
        """
        if self.resume_from is None:
            return None
        if self.resume_from == "auto":
            found = None if self.checkpoint_dir is None else self._newest_agreed(self.checkpoint_dir)
            return None if found is None else self._restore(found, state, verified=True)
        return self.load(self.resume_from, state)

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
        if not Path(found).is_file():
            import socket

            raise DdpkitError(
                f"rank 0 resumes from {found}, which rank {self.rank} cannot read on {socket.gethostname()}: "
                "put checkpoint_dir on a filesystem every node shares"
            )
        return Path(found)


def _version() -> str:
    from ddpkit import __version__

    return __version__
