"""The training half of the runtime: model setup, sharded loaders, the loop and its logs.

:class:`Training` holds what a training run changes (epoch, step, loaders, precision, the
metrics logger) and the methods a user script calls on ``rt`` for it. :class:`ddpkit.runtime.Runtime`
builds on it with the place in the world (rank, device, barrier, heartbeat) and the process
group's life; the methods here use those through ``self``. Saving and resuming the whole
state is :class:`ddpkit.resume.Resumable`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Mapping

import torch

from ddpkit import collectives
from ddpkit.data import GlobalBatchSampler, ShardedLoader, check_batch_sizes
from ddpkit.errors import UsageError
from ddpkit.precision import Precision
from ddpkit.resume import Resumable


def _buffer_sync_arg() -> str:
    """DDP's name for per-forward buffer broadcasting (renamed in recent torch)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"


_BUFFER_SYNC_ARG = _buffer_sync_arg()


class Training(Resumable):
    """Training state and the loop's API; the base of :class:`ddpkit.runtime.Runtime`.

    Subclasses provide ``device``, ``rank``, ``world_size``, ``is_main``, ``barrier()`` and
    ``heartbeat(phase)``.
    """

    device: torch.device
    rank: int
    world_size: int
    is_main: bool

    def _init_training(self, *, seed: int | None, precision: str, out_dir: str | None,
                       keep_checkpoints: int) -> None:
        self.seed = seed
        self.precision = Precision(precision, self.device)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.keep_checkpoints = keep_checkpoints
        self.checkpoint_dir: Path | None = None      # set by init(checkpoint_dir=...)
        self.resume_from: str | None = None          # set by init(resume=...)
        self.epoch = 0            # the epoch being trained (or to be trained next)
        self.global_step = 0      # optimizer steps taken
        self._loaders: list[ShardedLoader] = []
        self._active: ShardedLoader | None = None
        self._accumulation: tuple[float, bool] | None = None   # (divisor, is this micro-step the last)
        self._micro_steps = 0
        self._group: tuple[int, float] = (1, 1.0)
        self._logger: Any = None

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
            if self.device.type == "cpu":
                _fix_bucket_layout(model)
        self.heartbeat("start")     # DDP's parameter broadcast is done: the set-up made progress
        if self.seed is not None:
            # Identical weights came from one seed; dropout and the like now differ per rank.
            seed_everything(self.seed + 1_000_003 * (self.rank + 1))
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
        active = self._active
        if active is not None and active.global_count:
            weight = active.batch_weight()
            if self._accumulation is not None:      # a share of the group's samples, not the batch's
                weight *= active.global_count / active.sampler.global_batch_size
            if active.local_count == 0:
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
            raise UsageError(f"accumulate needs steps >= 1, got {steps}")
        if self._micro_steps == 0:
            self._group = self._group_weight(steps)
        self._micro_steps += 1
        group_batches, divisor = self._group
        last = self._micro_steps >= group_batches
        if last:
            self._micro_steps = 0
        self._accumulation = (divisor, last)
        sync_off = model.no_sync() if not last and hasattr(model, "no_sync") else contextlib.nullcontext()
        try:
            with sync_off:
                yield last
        finally:
            self._accumulation = None

    def _group_weight(self, steps: int) -> tuple[int, float]:
        """(batches, divisor) of the accumulation group starting with the batch in hand.

        A group never runs past the end of a pass over the data: a pass of 10 batches with
        ``steps=4`` steps after 4, 8 and 10. The divisor counts full global batches, so a short
        group (or one ending in a short batch) is the exact mean over the samples it saw.
        """
        loader = self._active
        if loader is None or not len(loader):
            return steps, float(steps)
        first = loader.position - 1                      # index of the batch just handed out
        batches = max(1, min(steps, len(loader) - first))
        full = loader.sampler.global_batch_size
        seen = sum(loader.sampler.global_count(first + i) for i in range(batches))
        return batches, seen / full if seen else float(batches)

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

    def _close_training(self) -> None:
        if self._logger is not None:
            self._logger.close()


def _fix_bucket_layout(model: Any) -> None:
    """Settle DDP's gradient buckets now, so every step of every attempt uses the same layout.

    DDP starts with one bucket in parameter order and, after the first backward, re-buckets in
    the order gradients became ready. A run resumed from a checkpoint would take its first step
    with the starting layout where the uninterrupted run used the re-bucketed one; with three or
    more processes a ring allreduce sums each element in an order that depends on where it sits
    in the bucket, so the two runs part by a rounding error. Re-bucketing at once (parameter
    order, DDP's own size caps) makes resume bitwise exact. CPU only: on GPUs the ready order
    lets communication overlap the backward pass, and bitwise results are not on offer anyway.
    Uses DDP's private join hooks; without them (another torch) DDP's default stays.
    """
    reducer = getattr(model, "reducer", None)
    try:
        reducer._push_all_rebuilt_params()
        reducer._rebuild_buckets()         # a collective: every rank calls setup
    except (AttributeError, RuntimeError):
        pass


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch identically (the same initial weights on every rank)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
