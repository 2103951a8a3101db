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
import os
import random
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Mapping, MutableMapping

import torch

from ddpkit import checkpoint, collectives, process_group, watchdog
from ddpkit.data import GlobalBatchSampler, ShardedLoader, check_batch_sizes
from ddpkit.env import Environment, detect
from ddpkit.precision import Precision

DEFAULT_TIMEOUT_S = 600.0

_current: "Runtime | None" = None


def _buffer_sync_arg() -> str:
    """DDP's name for per-forward buffer broadcasting (renamed in recent torch)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"


_BUFFER_SYNC_ARG = _buffer_sync_arg()


class Runtime:
    """Rank, device and backend of this process, and the collectives it may call.

    Create it with :func:`ddpkit.init`, not directly.
    """

    def __init__(self, env: Environment, device: torch.device, backend: str, timeout_s: float, *,
                 seed: int | None = None, precision: str = "fp32", out_dir: str | None = None,
                 keep_checkpoints: int = 3, hang_timeout: float | None = None):
        self.env = env
        self.device = device
        self.backend = backend
        self.timeout_s = timeout_s
        self.seed = seed
        self.precision = Precision(precision, device)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.keep_checkpoints = keep_checkpoints
        self.hang_timeout = hang_timeout
        self._local_first_count = 0
        self.checkpoint_dir: Path | None = None      # set by init(checkpoint_dir=...)
        self.resume_from: str | None = None          # set by init(resume=...)
        self.epoch = 0            # the epoch being trained (or to be trained next)
        self.global_step = 0      # optimizer steps taken
        self._loaders: list[ShardedLoader] = []
        self._active: ShardedLoader | None = None
        self._accumulation: tuple[int, bool] | None = None   # (steps, is this micro-step the last)
        self._micro_steps = 0
        self._logger: Any = None
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
        """``print`` on rank 0 only (every rank, prefixed, with ``all_ranks=True``)."""
        kwargs.setdefault("flush", True)
        if all_ranks and self.world_size > 1:
            builtins.print(f"[rank {self.rank}]", *args, **kwargs)
        elif self.is_main or all_ranks:
            builtins.print(*args, **kwargs)

    def barrier(self) -> None:
        """Wait until every rank reaches this point."""
        process_group.barrier()

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
        import torch.distributed as dist

        self._local_first_count += 1
        key = f"ddpkit/local_main_first/node{self.node_rank}/{self._local_first_count}"
        store = dist.distributed_c10d._get_default_store()
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


    # -- model, data, loop ---------------------------------------------------------------
    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
              sync_batchnorm: bool = False, **ddp_kwargs: Any) -> Any:
        """Move ``model`` to the device, convert BatchNorm if asked, wrap it in DDP when world > 1.

        Parameters keep their identity, so an optimizer built before ``setup`` stays valid.
        Returns the model, or ``(model, optimizer)`` when an optimizer is given.
        """
        model = model.to(self.device)
        if sync_batchnorm and self.world_size > 1:
            from ddpkit.sync_batchnorm import convert_sync_batchnorm

            model = convert_sync_batchnorm(model, self.device)
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            ddp_kwargs.setdefault("gradient_as_bucket_view", True)
            if sync_batchnorm and not ddp_kwargs.keys() & {"broadcast_buffers", "forward_sync_buffers"}:
                # Synced statistics are already equal on every rank; no need to broadcast them.
                ddp_kwargs[_BUFFER_SYNC_ARG] = False
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)
        if self.seed is not None:
            # Identical weights came from one seed; dropout and the like now differ per rank.
            _seed_everything(self.seed + 1_000_003 * (self.rank + 1))
        return model if optimizer is None else (model, optimizer)

    def loader(self, dataset: Any, *, batch_size: int | None = None, global_batch_size: int | None = None,
               shuffle: bool = False, drop_last: bool = False, num_workers: int = 0,
               collate_fn: Callable[[list[Any]], Any] | None = None) -> ShardedLoader:
        """Batches of this rank's shard, on the device. Give exactly one of the two sizes.

        With ``global_batch_size`` every world size visits the same samples at each step.
        """
        total = check_batch_sizes(self.world_size, batch_size, global_batch_size)
        sampler = GlobalBatchSampler(len(dataset), global_batch_size=total, rank=self.rank,
                                     world_size=self.world_size, shuffle=shuffle,
                                     seed=self.seed or 0, drop_last=drop_last)
        made = ShardedLoader(dataset, sampler, device=self.device, num_workers=num_workers,
                             collate_fn=collate_fn, seed=self.seed or 0, on_batch=self._on_batch)
        made.set_epoch(self.epoch)
        self._loaders.append(made)
        return made

    def _on_batch(self, loader: ShardedLoader) -> None:
        self._active = loader
        self.heartbeat("data")     # a batch is in hand; the forward follows

    def epochs(self, n: int) -> Iterator[int]:
        """Epoch numbers up to ``n``, from where a loaded checkpoint left off; sets every loader's epoch."""
        while self.epoch < n:
            for made in self._loaders:
                made.set_epoch(self.epoch)
            yield self.epoch
            self.epoch += 1

    def autocast(self) -> ContextManager[Any]:
        """Autocast for the run's precision (nothing for fp32)."""
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the mean loss of this rank's batch, weighted by its true sample count.

        ``loss`` must be the mean over the local batch (PyTorch's default reduction). Uneven
        last batches then count every sample once, as in a single process.
        """
        self.heartbeat("backward")
        weight = 1.0
        if self._active is not None and self._active.global_count:
            weight = self._active.batch_weight()
            if self._active.local_count == 0:
                loss = torch.nan_to_num(loss, nan=0.0)   # mean of nothing; contributes zero
        if self._accumulation is not None:
            weight /= self._accumulation[0]
        self.precision.backward(loss * weight if weight != 1.0 else loss)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Optimizer step (through the GradScaler for fp16), then ``zero_grad``.

        Inside :meth:`accumulate` only the last micro-step steps. Returns True when it stepped.
        """
        if self._accumulation is not None and not self._accumulation[1]:
            return False
        self.heartbeat("optimizer")
        stepped = self.precision.step(optimizer)
        self.global_step += 1
        return stepped

    @contextlib.contextmanager
    def accumulate(self, model: torch.nn.Module, steps: int) -> Iterator[bool]:
        """One micro-step of gradient accumulation over ``steps`` batches.

        Gradients are not all-reduced (DDP ``no_sync``) except on the last micro-step, and
        :meth:`step` only steps there. Yields True on the last micro-step.
        """
        if steps < 1:
            from ddpkit.errors import UsageError

            raise UsageError(f"accumulate needs steps >= 1, got {steps}")
        self._micro_steps += 1
        last = self._micro_steps % steps == 0
        self._accumulation = (steps, last)
        sync_off = model.no_sync() if not last and hasattr(model, "no_sync") else contextlib.nullcontext()
        try:
            with sync_off:
                yield last
        finally:
            self._accumulation = None

    def heartbeat(self, phase: str) -> None:
        """Tell the hang watchdog this rank made progress and is now in ``phase``.

        ddpkit beats at ``data``, ``backward``, ``optimizer`` and ``save``; call it in long
        stretches of your own (``"eval"``, a slow export) so they count as progress. It only
        records a tuple (no I/O), and does nothing without ``hang_timeout``.
        """
        if self._watchdog is not None:
            self._watchdog.beat(self.global_step, phase)

    # -- logging and checkpoints --------------------------------------------------------
    def log(self, metrics: Mapping[str, Any], *, step: int | None = None, reduce: str | None = "mean") -> dict:
        """Write metrics on rank 0 (``out_dir``/metrics.jsonl, .csv, TensorBoard).

        Every rank must call it: values are reduced across ranks (``reduce="mean"``, ``"sum"``,
        ``"max"`` or None to keep rank 0's). Returns the values written.
        """
        keys = list(metrics)
        values = {k: float(v.detach().float().mean()) if isinstance(v, torch.Tensor) else float(v)
                  for k, v in metrics.items()}
        if reduce is not None and self.world_size > 1 and keys:
            reduced = collectives.all_reduce(torch.tensor([values[k] for k in keys], dtype=torch.float64), reduce)
            values = dict(zip(keys, reduced.tolist()))
        if self.is_main and self.out_dir is not None:
            if self._logger is None:
                from ddpkit.tracking import MetricsLogger

                # Rows after the step we resumed from belong to work a crash undid.
                self._logger = MetricsLogger(self.out_dir, resume=self.global_step > 0,
                                             resume_step=self.global_step)
            self._logger.log(values, step=self.global_step if step is None else step)
        return values

    def plot_loss(self) -> Path | None:
        """Draw ``out_dir``/loss.png from the logged losses (rank 0; None elsewhere)."""
        return self._logger.plot_loss() if self._logger is not None else None

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
        from ddpkit.errors import DdpkitError

        target = Path(path)
        if target.is_dir():
            found = checkpoint.latest(target)
            if found is None:
                raise DdpkitError(f"no complete checkpoint in {target}")
            target = found
        payload = checkpoint.read(target)
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
            from ddpkit.errors import UsageError

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
            if self.checkpoint_dir is None or checkpoint.latest(self.checkpoint_dir) is None:
                return None
            return self.load(self.checkpoint_dir, state)
        return self.load(self.resume_from, state)

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
        if self._logger is not None:
            self._logger.close()
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

    Returns:
        The :class:`Runtime`; calling ``init`` again returns the same one until it is closed.
    """
    global _current
    if _current is not None and not _current._closed:
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
    if seed is not None:
        _seed_everything(seed)
    runtime = Runtime(env, chosen_device, chosen_backend, timeout, seed=seed, precision=precision,
                      out_dir=None if out_dir is None else str(out_dir), keep_checkpoints=keep_checkpoints,
                      hang_timeout=hang_timeout)
    runtime.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
    runtime.resume_from = None if resume is None else str(resume)
    if hang_timeout is not None:
        runtime._watchdog = watchdog.watch(hang_timeout, rank=env.rank, world_size=env.world_size)
    _current = runtime
    atexit.register(runtime.close)
    return runtime


def _seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _version() -> str:
    from ddpkit import __version__

    return __version__


def current() -> Runtime | None:
    """The runtime made by the last :func:`init`, if it is still open."""
    return _current
