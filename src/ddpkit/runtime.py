"""The object a user script holds: its place in the world, its device, and the group's life.

Example:
    >>> import ddpkit
    >>> rt = ddpkit.init()          # a world of one under plain python
    >>> rt.world_size, rt.is_main
    (1, True)
    >>> rt.close()
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ddpkit import watchdog
from ddpkit.dist import collectives, process_group, store_sync
from ddpkit.dist.environment import Environment, detect
from ddpkit.precision import Precision
from ddpkit.training import Training, seed_everything

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_SAVE_TIMEOUT_S = 60.0

_current: "Runtime | None" = None


class Runtime(Training):
    """Rank, device and backend of this process, the collectives it may call, and the
    training API of :class:`ddpkit.training.Training`.

    Create it with :func:`ddpkit.init`, not directly.
    """

    def __init__(self, env: Environment, device: torch.device, backend: str, timeout_s: float, *,
                 seed: int | None = None, precision: str = "fp32", out_dir: str | None = None,
                 keep_checkpoints: int = 3, hang_timeout: float | None = None,
                 save_timeout: float = DEFAULT_SAVE_TIMEOUT_S):
        self.env = env
        self.device = device
        self.backend = backend
        self.timeout_s = timeout_s
        self.hang_timeout = hang_timeout
        self.save_timeout = save_timeout
        self._local_first_count = 0
        self._init_training(seed=seed, precision=precision, out_dir=out_dir, keep_checkpoints=keep_checkpoints)
        self._watchdog: watchdog.Watchdog | None = None
        self._closed = False

    # -- place in the world -------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def node_rank(self) -> int:
        return self.env.node_rank

    @property
    def launcher(self) -> str:
        return self.env.launcher

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the one process that prints, logs and saves."""
        return self.env.rank == 0

    @property
    def is_local_main(self) -> bool:
        """True on local rank 0 of each node: the one that prepares node-local files."""
        return self.env.local_rank == 0

    # -- talking ------------------------------------------------------------------------
    def print(self, *args: Any, all_ranks: bool = False, **kwargs: Any) -> None:
        """``print`` on rank 0 only (every rank, prefixed, with ``all_ranks=True``).

        The line is composed first and handed to the stream in one ``write``, so lines printed by
        several ranks onto one shared pipe do not interleave mid-line (with ``PYTHONUNBUFFERED``
        the builtin ``print`` writes the text and its newline separately).
        """
        if not (self.is_main or all_ranks):
            return
        if all_ranks and self.world_size > 1:
            args = (f"[rank {self.rank}]", *args)
        stream = kwargs.pop("file", None) or sys.stdout
        flush = kwargs.pop("flush", True)
        line = io.StringIO()
        builtins.print(*args, file=line, **kwargs)
        stream.write(line.getvalue())
        if flush:
            stream.flush()

    def barrier(self) -> None:
        """Wait until every rank reaches this point."""
        collectives.barrier()

    @contextlib.contextmanager
    def local_main_first(self) -> Iterator[None]:
        """Local rank 0 of each node runs the block first; the node's other ranks wait, then run it.

        For node-local work such as unpacking or caching a data set: one process per node
        prepares the files, the others find them ready. Ranks of other nodes do not wait.

        Example:
            >>> with rt.local_main_first():
            ...     data = load_or_prepare("data/")          # doctest: +SKIP
        """
        if self.world_size == 1 or self.env.local_world_size == 1:
            yield
            return
        from ddpkit._torch import default_store

        self._local_first_count += 1
        key = f"ddpkit/local_main_first/node{self.node_rank}/{self._local_first_count}"
        store = default_store()
        if self.is_local_main:
            try:
                yield
            finally:
                store.set(key, "done")    # also on failure, so the others fail on their own
        else:
            store.wait([key])
            yield

    def all_reduce(self, value: Any, op: str = "sum") -> Any:
        """Sum, mean, max or min of ``value`` across ranks (see :func:`ddpkit.all_reduce`)."""
        return collectives.all_reduce(value, op)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's rows concatenated in rank order; first dimensions may differ."""
        return collectives.all_gather(tensor)


    def heartbeat(self, phase: str) -> None:
        """Tell the hang watchdog this rank made progress and is now in ``phase``.

        ddpkit beats at ``start`` (end of :meth:`setup`), ``data``, ``backward``, ``optimizer``,
        ``save``, and ``eval`` (each batch of :func:`ddpkit.evaluate` and :func:`ddpkit.predict`);
        call it in long stretches of your own (a slow export) so they count as progress. It only
        records a tuple (no I/O), and does nothing without ``hang_timeout``.
        """
        if self._watchdog is not None:
            self._watchdog.beat(self.global_step, phase)

    def watch_progress(self, probe: Callable[[], int]) -> None:
        """Count a rise of ``probe()`` (samples a loader's workers read) as progress for the watchdog."""
        if self._watchdog is not None:
            self._watchdog.add_probe(probe)

    # -- life ---------------------------------------------------------------------------
    def close(self) -> None:
        """Flush logs and destroy the process group. Runs at exit too, also when the script raised."""
        global _current
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        self._close_training()
        process_group.destroy()
        if _current is self:
            _current = None

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Runtime(launcher={self.launcher!r}, rank={self.rank}, local_rank={self.local_rank}, "
            f"world_size={self.world_size}, device={str(self.device)!r}, backend={self.backend!r})"
        )


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
            rank exits with code 124 (see :mod:`ddpkit.watchdog`). None: no watchdog.
        save_timeout: seconds ``rt.save`` and ``rt.load`` wait for every rank to arrive before
            failing with one line that names the missing ranks (e.g. a save under ``if rt.is_main``).

    Returns:
        The :class:`Runtime`; calling ``init`` again with the same settings returns the same one
        until it is closed.

    Raises:
        UsageError: ``init`` was already called with other settings and not closed.
    """
    global _current
    settings = {"seed": seed, "precision": precision, "backend": backend, "device": device, "timeout": timeout,
                "out_dir": None if out_dir is None else str(out_dir), "keep_checkpoints": keep_checkpoints,
                "checkpoint_dir": None if checkpoint_dir is None else str(checkpoint_dir),
                "resume": None if resume is None else str(resume), "hang_timeout": hang_timeout,
                "save_timeout": save_timeout}
    if _current is not None and not _current._closed:
        differ = {k: v for k, v in settings.items() if _current._settings.get(k) != v}
        if differ:
            from ddpkit.errors import UsageError

            shown = ", ".join(f"{k}={v!r} (running: {_current._settings.get(k)!r})" for k, v in differ.items())
            raise UsageError(f"ddpkit.init was already called with other settings: {shown}; "
                             "call rt.close() first, or pass the same settings")
        return _current
    Precision(precision, torch.device("cpu"))   # a bad name fails before any process group exists
    if resume == "auto" and checkpoint_dir is None:
        from ddpkit.errors import UsageError

        raise UsageError("resume='auto' needs checkpoint_dir=... to look in")
    watchdog.check_timeout(hang_timeout)
    env = detect()
    chosen_device = process_group.choose_device(env, device)
    chosen_backend = process_group.choose_backend(chosen_device, backend)
    if env.distributed:
        process_group.init(env, chosen_backend, chosen_device, timeout)
        import uuid

        store_sync.begin(collectives.broadcast_object(uuid.uuid4().hex if env.rank == 0 else None))
    if seed is not None:
        seed_everything(seed)
    runtime = Runtime(env, chosen_device, chosen_backend, timeout, seed=seed, precision=precision,
                      out_dir=None if out_dir is None else str(out_dir), keep_checkpoints=keep_checkpoints,
                      hang_timeout=hang_timeout, save_timeout=save_timeout)
    runtime._settings = settings
    runtime.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
    runtime.resume_from = None if resume is None else str(resume)
    if hang_timeout is not None:
        runtime._watchdog = watchdog.watch(hang_timeout, rank=env.rank, world_size=env.world_size)
    _current = runtime
    atexit.register(runtime.close)
    return runtime


def current() -> Runtime | None:
    """The runtime made by the last :func:`init`, if it is still open."""
    return _current
