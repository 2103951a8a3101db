"""``ddpkit.init``: frozen :class:`Settings`, checked; the group joined; the :class:`Runtime` composed.

Example:
    >>> import ddpkit
    >>> rt = ddpkit.init()          # a world of one under plain python
    >>> rt.world_size, rt.is_main
    (1, True)
    >>> rt.close()
"""

from __future__ import annotations

import atexit
import os
import uuid
from dataclasses import asdict, dataclass

import torch

from ddpkit import rng
from ddpkit.observe import heartbeats, watchdog
from ddpkit.dist import collectives, process_group, store_sync
from ddpkit.dist.environment import Environment, detect
from ddpkit.errors import UsageError
from ddpkit.loop.precision import Precision
from ddpkit.runtime.facade import Runtime

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_SAVE_TIMEOUT_S = 60.0

_current: Runtime | None = None


@dataclass(frozen=True)
class Settings:
    """What :func:`init` was given, checked before any process group exists (see :func:`init`)."""

    seed: int | None = None
    precision: str = "fp32"
    backend: str | None = None
    device: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    out_dir: str | None = None
    keep_checkpoints: int = 3
    checkpoint_dir: str | None = None
    resume: str | None = None
    hang_timeout: float | None = None
    save_timeout: float = DEFAULT_SAVE_TIMEOUT_S

    def check(self) -> None:
        """Refuse bad settings in one line, before any process group work.

        Raises:
            UsageError: an unknown precision, ``resume="auto"`` without a ``checkpoint_dir``, or a
                ``hang_timeout`` that is not a positive number of seconds.
        """
        Precision(self.precision, torch.device("cpu"))
        if self.resume == "auto" and self.checkpoint_dir is None:
            raise UsageError("resume='auto' needs checkpoint_dir=... to look in")
        watchdog.check_timeout(self.hang_timeout)


def init(
    *,
    seed: int | None = None,
    precision: str = "fp32",
    backend: str | None = None,
    device: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    out_dir: str | os.PathLike | None = None,
    keep_checkpoints: int = 3,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    hang_timeout: float | None = None,
    save_timeout: float = DEFAULT_SAVE_TIMEOUT_S,
) -> Runtime:
    """Learn our place from the launcher, pick device and backend, and join the process group.

    Args:
        seed: seeds torch, numpy and random identically on every rank (identical initial
            weights) and keys the data order and per-sample randomness.
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + GradScaler).
        backend: ``"nccl"``, ``"gloo"`` or ``"mpi"``; chosen from the device when omitted.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; the local rank's GPU when CUDA is usable.
        timeout: seconds to wait for the master and for any collective.
        out_dir: where :meth:`Runtime.log` writes metrics (rank 0 only).
        keep_checkpoints: newest checkpoints kept when saving into a directory.
        checkpoint_dir: where :meth:`Runtime.checkpoint` saves and :meth:`Runtime.resume` looks.
        resume: ``"auto"`` (the newest complete checkpoint of ``checkpoint_dir``, if any: what
            a run restarted by ``ddpkit run --max-restarts`` needs), a checkpoint path, or None.
        hang_timeout: seconds in which no rank makes progress before the job counts as hung:
            ddpkit prints where each rank is and the stuck rank's Python stack, then every
            rank exits with code 124 (see :mod:`ddpkit.observe.watchdog`). None: no watchdog.
        save_timeout: seconds ``rt.save`` and ``rt.load`` wait for every rank to arrive before
            failing with one line that names the missing ranks (e.g. a save under ``if rt.is_main``).

    Returns:
        The :class:`Runtime`; calling ``init`` again with the same settings returns the same one
        until it is closed.

    Raises:
        UsageError: ``init`` was already called with other settings and not closed.
    """
    global _current
    settings = Settings(seed=seed, precision=precision, backend=backend, device=device, timeout=timeout,
                        out_dir=_text(out_dir), keep_checkpoints=keep_checkpoints,
                        checkpoint_dir=_text(checkpoint_dir), resume=_text(resume), hang_timeout=hang_timeout,
                        save_timeout=save_timeout)
    if _current is not None and not _current._closed:
        _same_settings(_current.settings, settings)
        return _current
    settings.check()                      # before any process group exists
    env, chosen_device, chosen_backend = join(settings)
    if seed is not None:
        rng.seed_everything(seed)
    runtime = Runtime(env, chosen_device, chosen_backend, settings)
    if hang_timeout is not None:
        runtime._watchdog = watchdog.watch(hang_timeout, rank=env.rank, world_size=env.world_size)
        heartbeats.set_target(runtime)
    runtime._on_close = _forget
    _current = runtime
    atexit.register(runtime.close)
    return runtime


def join(settings: Settings) -> tuple[Environment, torch.device, str]:
    """Learn this process's place from the launcher, pick device and backend, join the group.

    Returns:
        The environment, the device and the backend; with more than one process the default
        group is up and every rank shares one key for its store meetings.
    """
    env = detect()
    device = process_group.choose_device(env, settings.device)
    backend = process_group.choose_backend(device, settings.backend)
    if env.distributed:
        process_group.init(env, backend, device, settings.timeout)
        store_sync.begin(collectives.broadcast_object(uuid.uuid4().hex if env.rank == 0 else None))
    return env, device, backend


def current() -> Runtime | None:
    """The runtime made by the last :func:`init`, if it is still open."""
    return _current


def _forget(runtime: Runtime) -> None:
    global _current
    if _current is runtime:
        _current = None


def _text(value: str | os.PathLike | None) -> str | None:
    return None if value is None else str(value)


def _same_settings(running: Settings, asked: Settings) -> None:
    """Refuse a second ``init`` whose settings differ from the running one's."""
    mine, theirs = asdict(running), asdict(asked)
    differ = {k: v for k, v in theirs.items() if mine[k] != v}
    if differ:
        shown = ", ".join(f"{k}={v!r} (running: {mine[k]!r})" for k, v in differ.items())
        raise UsageError(f"ddpkit.init was already called with other settings: {shown}; "
                         "call rt.close() first, or pass the same settings")
