"""The training half of the runtime: model setup, sharded loaders, the loop and its logs.

:class:`Training` holds the methods a user script calls on ``rt`` for its loop; where the loop
stands (epoch, step, loader positions, accumulation) is one :class:`ddpkit.loopstate.LoopState`,
``rt.loop``. :class:`ddpkit.runtime.Runtime`
builds on it with the place in the world (rank, device, barrier, heartbeat) and the process
group's life; the methods here use those through ``self``. Saving and resuming the whole
state is :class:`ddpkit.resume.Resumable`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Mapping

import torch

from ddpkit.dist import collectives
from ddpkit.data import GlobalBatchSampler, check_batch_sizes
from ddpkit.errors import UsageError
from ddpkit.loader import ShardedLoader
from ddpkit.loopstate import LoopState
from ddpkit.precision import Precision
from ddpkit.parallel.ddp import replicate
from ddpkit.resume import Resumable


class Training(Resumable):
    """The loop's API; the base of :class:`ddpkit.runtime.Runtime`. Its state is ``self.loop``.

    Subclasses provide ``device``, ``rank``, ``world_size``, ``is_main``, ``barrier()`` and
    ``heartbeat(phase)``.
    """

    device: torch.device
    rank: int
    world_size: int
    is_main: bool
    timeout_s: float

    def _init_training(self, *, seed: int | None, precision: str, out_dir: str | None,
                       keep_checkpoints: int) -> None:
        self.seed = seed
        self.precision = Precision(precision, self.device)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.keep_checkpoints = keep_checkpoints
        self.checkpoint_dir: Path | None = None      # set by init(checkpoint_dir=...)
        self.resume_from: str | None = None          # set by init(resume=...)
        self.loop = LoopState()
        self._active: ShardedLoader | None = None
        self._accumulation: tuple[float, bool] | None = None   # (divisor, is this micro-step the last)
        self._models: list[torch.nn.Module] = []
        self._compressors: list[Any] = []            # per model: its gradient compressor, or None
        self._buffers: list[Any] = []                # per model: its lazily averaged statistics, or None
        self._saved_compression: Any = None     # from a load (maybe before setup): (per model, same world, source)
        self._saved_buffers: Any = None         # this rank's saved statistics per model, same world only
        self._optimizers: list[torch.optim.Optimizer] = []
        self._backward_since_step = False
        self._uses_backward = False       # the script calls rt.backward (else every rt.step counts)
        self._unscaled: set[int] = set()  # optimizers whose fp16 gradients are unscaled this step
        self._logger: Any = None

    @property
    def epoch(self) -> int:
        """The epoch being trained (or to be trained next)."""
        return self.loop.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.loop.epoch = value

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (several optimizers stepped together count once)."""
        return self.loop.step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.loop.step = value

    # -- model, data, loop ---------------------------------------------------------------
    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
              sync_batchnorm: bool = False, compile: bool | dict[str, Any] = False,
              grad_compression: str | None = None, powersgd_rank: int = 2, powersgd_start: int | None = None,
              strategy: str = "ddp", fsdp_units: Any = None, reshard_after_forward: bool = True,
              cpu_offload: bool = False, **ddp_kwargs: Any) -> Any:
        """Move ``model`` to the device, convert BatchNorm if asked, wrap it in DDP when world > 1.

        ``compile=True`` (or a dict of ``torch.compile`` arguments) compiles the wrapped model;
        a model compiled before ``setup`` works too. Checkpoints hold plain parameter names either way.
        ``grad_compression`` (``"fp16"``, ``"bf16"`` or ``"powersgd"``, see :mod:`ddpkit.parallel.compression`)
        sends fewer bytes per step on slow links; PowerSGD sends rank-``powersgd_rank`` factors
        after ``powersgd_start`` plain steps (default 10), and its state is in every checkpoint.
        Parameters keep their identity, so an optimizer built before ``setup`` stays valid.
        ``strategy="fsdp"`` shards parameters, gradients and optimizer state instead (FSDP2, see
        :mod:`ddpkit.parallel.fsdp`): per unit (``fsdp_units`` classes, else children above a size), with
        ``reshard_after_forward`` (ZeRO-3; False: ZeRO-2), bf16/fp16 compute under ``precision=`` with
        fp32 reductions and master weights, and ``cpu_offload`` (shards and optimizer state in CPU
        memory); the optimizer, made before or after, is rebound to the sharded parameters.
        Returns the model, or ``(model, optimizer)`` when an optimizer is given.
        """
        from ddpkit.parallel import compression

        if strategy not in ("ddp", "fsdp"):
            raise UsageError(f"unknown strategy {strategy!r}; choose 'ddp' (replicated) or 'fsdp' (sharded)")
        if strategy == "fsdp":
            return self._setup_fsdp(model, optimizer, sync_batchnorm=sync_batchnorm, compile=compile,
                                    grad_compression=grad_compression, fsdp_units=fsdp_units,
                                    reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload,
                                    ddp_kwargs=ddp_kwargs)
        if cpu_offload:
            raise UsageError("cpu_offload=True shards parameters to CPU memory: it needs strategy='fsdp'")

        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        compression.check(grad_compression, rank=powersgd_rank, start=powersgd_start, backend=backend,
                          device=self.device, precision=self.precision.name,
                          compile=compile or hasattr(model, "_orig_mod"))     # compiled before setup too
        replica = replicate(model, device=self.device, world_size=self.world_size, is_main=self.is_main,
                            sync_batchnorm=sync_batchnorm, compile=compile, grad_compression=grad_compression,
                            powersgd_rank=powersgd_rank, powersgd_start=powersgd_start,
                            timeout_s=self.timeout_s, **ddp_kwargs)
        self.loop.not_bitwise = self.loop.not_bitwise or replica.not_bitwise
        return self._adopt(replica.model, optimizer, replica.compressor, replica.buffers)

    def _adopt(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
               compressor: Any = None, syncer: Any = None) -> Any:
        """Track a set-up model (and its optimizer) for steps and checkpoints; seed per rank."""
        self._models.append(model)
        self._compressors.append(compressor)
        self._buffers.append(syncer)
        self._restore_compression(len(self._models) - 1)
        self._restore_buffers(len(self._models) - 1)
        if optimizer is not None and optimizer not in self._optimizers:
            self._optimizers.append(optimizer)
        self.heartbeat("start")     # the parameters are in place everywhere: the set-up made progress
        if self.seed is not None:
            # Identical weights came from one seed; dropout and the like now differ per rank.
            seed_everything(self.seed + 1_000_003 * (self.rank + 1))
        return model if optimizer is None else (model, optimizer)

    def _setup_fsdp(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                    sync_batchnorm: bool, compile: Any, grad_compression: str | None, fsdp_units: Any,
                    reshard_after_forward: bool, cpu_offload: bool, ddp_kwargs: dict[str, Any]) -> Any:
        from ddpkit.parallel import fsdp

        fsdp.check(grad_compression=grad_compression, compile=compile,
                   sync_batchnorm=sync_batchnorm, model=model, ddp_kwargs=ddp_kwargs)
        units = [fsdp_units] if isinstance(fsdp_units, type) else fsdp_units
        model = fsdp.shard(model, [optimizer] if optimizer is not None else [], device=self.device,
                           precision=self.precision.name, fsdp_units=units,
                           reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload)
        self.precision.shard()
        return self._adopt(model, optimizer)

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's state with plain names, on the CPU, on rank 0 (None elsewhere).

        Every rank must call it. Under ``strategy="fsdp"`` it gathers the shards (for export);
        under DDP it is rank 0's copy.
        """
        from ddpkit.parallel import fsdp
        from ddpkit._torch import unwrap

        if fsdp.is_sharded(model):
            return fsdp.full_state_dict(model)
        if not self.is_main:
            return None
        return {k: v.detach().cpu().clone() for k, v in unwrap(model).state_dict().items()}

    def loader(self, dataset: Any, *, batch_size: int | None = None, global_batch_size: int | None = None,
               shuffle: bool = False, drop_last: bool = False, num_workers: int = 0,
               collate_fn: Callable[[list[Any]], Any] | None = None, name: str | None = None,
               weights: Any = None, num_samples: int | None = None, pin_memory: bool | None = None,
               prefetch_factor: int | None = None, persistent_workers: bool | None = None,
               worker_init_fn: Callable[[int], None] | None = None) -> ShardedLoader:
        """Batches of this rank's shard, on the device. Give exactly one of the two sizes.

        With ``global_batch_size`` every world size visits the same samples at each step. Each
        ``iter(loader)`` starts the epoch, like a ``DataLoader``; after :meth:`load` the next pass
        continues the saved one. ``name`` keys its position in checkpoints (default: the dataset's
        type name; see :meth:`ddpkit.loopstate.LoopState.register`). ``weights`` (one per sample) draws each epoch's
        ``num_samples`` (default: all) with replacement, like ``WeightedRandomSampler``.
        ``pin_memory`` (default: on CUDA), ``prefetch_factor``, ``persistent_workers`` (default:
        on with workers) and ``worker_init_fn`` (run after ddpkit seeds the worker) go to the
        ``DataLoader``.
        """
        total = check_batch_sizes(self.world_size, batch_size, global_batch_size)
        if _is_stream(dataset):
            if weights is not None or num_samples is not None:
                raise UsageError("weights= and num_samples= need a map-style dataset (they draw indices); "
                                 "a stream is read in its own order")
            from ddpkit.streams.loader import StreamLoader

            stream = StreamLoader(dataset, global_batch_size=total, rank=self.rank, world_size=self.world_size,
                                  device=self.device, shuffle=shuffle, drop_last=drop_last, seed=self.seed or 0,
                                  num_workers=num_workers, collate_fn=collate_fn, on_batch=self._on_batch,
                                  pin_memory=pin_memory, prefetch_factor=prefetch_factor,
                                  persistent_workers=persistent_workers, worker_init_fn=worker_init_fn,
                                  watch=self.watch_progress)
            self.loop.register(stream, name)
            return stream
        sampler = GlobalBatchSampler(len(dataset), global_batch_size=total, rank=self.rank,
                                     world_size=self.world_size, shuffle=shuffle, seed=self.seed or 0,
                                     drop_last=drop_last, weights=weights, num_samples=num_samples)
        made = ShardedLoader(dataset, sampler, device=self.device, num_workers=num_workers,
                             collate_fn=collate_fn, seed=self.seed or 0, on_batch=self._on_batch,
                             pin_memory=pin_memory, prefetch_factor=prefetch_factor,
                             persistent_workers=persistent_workers, worker_init_fn=worker_init_fn)
        self.loop.register(made, name)
        return made

    def _on_batch(self, loader: ShardedLoader) -> None:
        self._active = loader
        self.heartbeat("data")     # a batch is in hand; the forward follows

    def epochs(self, n: int) -> Iterator[int]:
        """Epoch numbers up to ``n``, from where a loaded checkpoint left off; sets every loader's epoch."""
        while self.loop.epoch < n:
            for made in self.loop.loaders():
                made.set_epoch(self.loop.epoch)      # a no-op for a loader already there
            yield self.loop.epoch
            self.loop.epoch += 1

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
        if active is not None:
            active.mark_trained()
        self.loop.check_pending()
        if active is not None and active.global_count:
            weight = active.batch_weight()
            if self._accumulation is not None:      # a share of the group's samples, not the batch's
                weight *= active.global_count / active.sampler.global_batch_size
            if active.local_count == 0:
                loss = torch.nan_to_num(loss, nan=0.0)   # mean of nothing; contributes zero
        if self._accumulation is not None:
            weight /= self._accumulation[0]
        if not self._backward_since_step:
            self._unscaled.clear()
        self._backward_since_step = self._uses_backward = True
        self.precision.backward(loss * weight if weight != 1.0 else loss)

    def step(self, *optimizers: torch.optim.Optimizer) -> bool:
        """Optimizer step (through the GradScaler for fp16), then ``zero_grad``, for each optimizer.

        Several optimizers in one step (``rt.step(gen_opt, disc_opt)``, or one call each after the
        same backward) update the fp16 scaler once and count as one step. Inside :meth:`accumulate`
        only the last micro-step steps. Returns True when every optimizer updated its parameters;
        False when fp16 skipped the step for inf/nan gradients, or inside an accumulation group,
        so a learning-rate scheduler can follow (``if rt.step(opt): scheduler.step()``).
        """
        if not optimizers:
            raise UsageError("rt.step needs the optimizer(s) to step")
        if self._accumulation is not None and not self._accumulation[1]:
            return False
        self.heartbeat("optimizer")
        stepped = True
        for optimizer in optimizers:
            if optimizer not in self._optimizers:
                self._optimizers.append(optimizer)
            stepped = self.precision.step(optimizer) and stepped
        if self._backward_since_step or not self._uses_backward:
            self.loop.step += 1
            self._backward_since_step = False
        if not self._uses_backward:
            self.precision.flush()        # no rt.backward will come to apply the scaler update
        return stepped

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip the gradients of ``model`` to ``max_norm``; returns their total norm before clipping.

        Under fp16 the gradients are unscaled first (the optimizers given to :meth:`setup` or
        :meth:`step`). Inside :meth:`accumulate` it clips only on the micro-step that syncs,
        where the gradients are complete, and returns None on the others.
        """
        if self._accumulation is not None and not self._accumulation[1]:
            return None
        params = [p for p in model.parameters() if p.grad is not None]
        if self.precision.scaler is not None:
            mine = {id(p) for p in params}
            owners = [opt for opt in self._optimizers
                      if any(id(p) in mine for group in opt.param_groups for p in group["params"])]
            if not owners:
                raise UsageError("rt.clip_grad_norm_ under fp16 must unscale the gradients first: "
                                 "pass the optimizer to rt.setup(model, optimizer)")
            for opt in owners:
                if id(opt) not in self._unscaled:
                    self.precision.unscale_(opt)
                    self._unscaled.add(id(opt))
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def should_stop(self, flag: bool) -> bool:
        """True on every rank when any rank passes True: early stopping without a stranded rank.

        Every rank must call it at the same point (it is one small all-reduce).
        """
        if self.world_size == 1:
            return bool(flag)
        return bool(collectives.all_reduce(1.0 if flag else 0.0, "max") > 0)

    @contextlib.contextmanager
    def accumulate(self, model: torch.nn.Module, steps: int) -> Iterator[bool]:
        """One micro-step of gradient accumulation over ``steps`` batches.

        Gradients are not all-reduced (DDP ``no_sync``) except on the last micro-step, and
        :meth:`step` only steps there. Yields True on the last micro-step.
        """
        if steps < 1:
            raise UsageError(f"accumulate needs steps >= 1, got {steps}")
        loop = self.loop
        if loop.micro_step == 0:
            loop.group = self._group_weight(steps)
        loop.micro_step += 1
        group_batches, divisor = loop.group
        last = loop.micro_step >= group_batches
        if last:
            loop.micro_step = 0
        self._accumulation = (divisor, last)
        sync_off = contextlib.nullcontext()
        if not last and hasattr(model, "no_sync"):
            sync_off = model.no_sync()
        elif not last and hasattr(model, "set_requires_gradient_sync"):     # strategy="fsdp"
            from ddpkit.parallel.fsdp import no_gradient_sync

            sync_off = no_gradient_sync(model)
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
        if loader is not None and not getattr(loader, "length_known", True):
            raise UsageError("rt.accumulate over a plain stream: its length is unknown, so the last "
                             "group's size cannot be known; use ddpkit.Shards (lengths known) or step every batch")
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

                # Rows after the step we resumed from belong to work a crash undid; a fresh run
                # (nothing loaded) starts its files anew.
                self._logger = MetricsLogger(self.out_dir, resume=self.loop.resumed_from is not None,
                                             resume_step=self.global_step)
            self._logger.log(values, step=self.global_step if step is None else step)
        return values

    def plot_loss(self) -> Path | None:
        """Draw ``out_dir``/loss.png from the logged losses (rank 0; None elsewhere)."""
        return self._logger.plot_loss() if self._logger is not None else None

    def _close_training(self) -> None:
        if self._logger is not None:
            self._logger.close()


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch identically (the same initial weights on every rank)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _is_stream(dataset: Any) -> bool:
    """An ``IterableDataset`` (read as a stream); a bare iterator or generator is refused."""
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset):
        return True
    if isinstance(dataset, Iterator) and not hasattr(dataset, "__getitem__"):
        raise UsageError(f"rt.loader got a {type(dataset).__name__}, which can be read only once; wrap it "
                         "in a torch IterableDataset whose __iter__ starts it anew each epoch")
    return False
