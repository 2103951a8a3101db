"""``rt``, the object a user script holds: a thin facade over the run's parts.

:class:`Runtime` composes the place in the world (:class:`~ddpkit.distributed.environment.Environment`,
device, backend), one :class:`~ddpkit.state.run.RunState` (loop position, precision, models,
optimizers, compressors, statistics) and the watchdog and metrics of :mod:`ddpkit.observe`. Each
method hands its work to the module that owns it: set-up to :mod:`ddpkit.parallel.wrap`, loaders
to :mod:`ddpkit.loop.build`, a step to :mod:`ddpkit.loop.steps`, save and load to
:mod:`ddpkit.checkpoint.resume`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import Any

import torch

from ddpkit import checkpoint, rng
from ddpkit.checkpoint import pt
from ddpkit.checkpoint import resume as resuming
from ddpkit.distributed import collectives, process_group, store_sync
from ddpkit.distributed.environment import Environment
from ddpkit.errors import DdpkitError, UsageError, warn
from ddpkit.loop import build
from ddpkit.loop import steps as loop_steps
from ddpkit.observe import heartbeats, progress, watchdog
from ddpkit.observe.metrics import MetricsLogger, as_floats
from ddpkit.parallel import exact, modes
from ddpkit.parallel.options import SetupOptions
from ddpkit.parallel.wrap import full_state_dict, wrap
from ddpkit.state.precision import Precision
from ddpkit.state.run import RunState


def _from_user_code() -> bool:
    """Whether the caller of the property asking is outside ddpkit (a script's own line)."""
    return not sys._getframe(2).f_code.co_filename.startswith(_PACKAGE)


_PACKAGE = str(Path(__file__).resolve().parents[1])


class Runtime:
    """Rank, device and backend of this process, the collectives it may call, and the training API.

    Create it with :func:`ddpkit.init`, not directly. Its state is one :class:`~ddpkit.state.run.RunState`;
    the settings it was given are ``ddpkit.init``'s arguments.
    """

    def __init__(self, env: Environment, device: torch.device, backend: str, settings: Any) -> None:
        self.device = device
        """This process's device: the local rank's GPU where CUDA is usable, else the CPU."""
        self._env = env
        self._backend = backend
        self._settings = settings
        self._out_dir = Path(settings.out_dir) if settings.out_dir is not None else None
        self._checkpoint_dir = Path(settings.checkpoint_dir) if settings.checkpoint_dir is not None else None
        self._run = RunState(Precision(settings.precision, device), seed=settings.seed)
        self._peers = resuming.Peers(env.rank, env.world_size, settings.timeout, settings.save_timeout)
        self._watchdog: watchdog.Watchdog | None = None
        self._logger: Any = None
        self._local_first_count = 0
        self._closed = False
        self._failed = False  # an uncaught exception ended the script (set by init's hook)
        self._outcome: str | None = None  # "KILLED" after a preempted save
        self._on_close: Callable[[Runtime], None] | None = None  # init's: forget the current runtime
        self._told_replica = False

    @property
    def rank(self) -> int:
        """Global rank of this process.

        In a fault-tolerant job each replica is a one-process group: ``rt.rank`` is 0 in every
        replica, and :attr:`replica` says which replica this is (read from a script, it says so once).
        """
        if self._run.world.replica is not None and not self._told_replica and _from_user_code():
            self._told_replica = True
            warn(
                "rt.rank is 0 in every replica of a fault-tolerant job (each replica is a one-process group); "
                "rt.replica says which replica this is, rt.is_main which one logs and saves"
            )
        return self._env.rank

    @property
    def replica(self) -> int | None:
        """In a fault-tolerant job, this replica's index, 0 to the job's replicas - 1 (kept across its
        restarts); None otherwise."""
        return self._run.world.replica

    @property
    def world_size(self) -> int:
        """Processes of the job."""
        return self._env.world_size

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the one process that prints, logs and saves.

        In a fault-tolerant job (``ddpkit run --fault-tolerant``): the replica ranked first in the
        latest step's quorum, so exactly one live replica logs and saves each step."""
        return self._run.world.is_main(self._env.rank)

    @property
    def precision(self) -> Precision:
        """Autocast, the fp16 GradScaler (``rt.precision.scaler``) and the optimizer step."""
        return self._run.precision

    @property
    def epoch(self) -> int:
        """The epoch being trained (or to be trained next)."""
        return self._run.loop.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._run.loop.epoch = value

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (several optimizers stepped together count once)."""
        return self._run.loop.step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self._run.loop.step = value

    @property
    def preempted(self) -> bool:
        """True on every rank, from the same step on, once any rank got SIGTERM (or SLURM's SIGUSR1).

        A save-and-exit is coming: ``ddpkit train`` saves by itself; a loop of your own saves with
        :meth:`checkpoint` (or :meth:`save`), which then ends the process with exit code 75
        (:data:`ddpkit.distributed.preemption.EXIT_CODE`) once the checkpoint is on disk. Restart the
        job with ``resume="auto"`` (a requeued SLURM job does) to continue where it stopped.

        Example:
            >>> rt.step(optimizer)                               # doctest: +SKIP
            >>> if rt.preempted:                                 # doctest: +SKIP
            ...     rt.checkpoint({"model": model, "optimizer": optimizer})   # saves, then exits 75
        """
        return self._run.preemption is not None and self._run.preemption.agreed

    def print(self, *args: Any, all_ranks: bool = False, **kwargs: Any) -> None:
        """``print`` on rank 0 only (every rank, prefixed, with ``all_ranks=True``), one whole line at a time."""
        if self.is_main or all_ranks:
            progress.print_line(
                *args, prefix=f"[rank {self.rank}]" if all_ranks and self.world_size > 1 else None, **kwargs
            )

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
        if self.world_size == 1 or self._env.local_world_size == 1:
            yield
            return
        self._local_first_count += 1
        with store_sync.local_main_first(self._env.node_rank, self._env.local_rank == 0, self._local_first_count):
            yield

    def all_reduce(self, value: Any, op: str = "sum") -> Any:
        """Sum, mean, max or min of ``value`` across ranks (see :func:`ddpkit.all_reduce`)."""
        self._refuse("rt.all_reduce")
        return collectives.all_reduce(value, op)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's rows concatenated in rank order; first dimensions may differ."""
        self._refuse("rt.all_gather")
        return collectives.all_gather(tensor)

    def _refuse(self, call: str) -> None:
        """Every mode of the run may refuse ``call`` in one line (a fault-tolerant replica's collectives)."""
        for mode in self._run.modes:
            mode.refuse(call)

    def heartbeat(self, phase: str) -> None:
        """Tell the hang watchdog this rank made progress and is now in ``phase``.

        ddpkit beats at ``start``, ``data``, ``backward``, ``optimizer``, ``save`` and ``eval``; call
        it in long stretches of your own (a slow export). No I/O; nothing without ``hang_timeout``.
        """
        if self._watchdog is not None:
            self._watchdog.beat(self.global_step, phase)

    def _watch_progress(self, probe: Callable[[], int]) -> None:
        """Count a rise of ``probe()`` (samples a loader's workers read) as progress for the watchdog."""
        if self._watchdog is not None:
            self._watchdog.add_probe(probe)

    def setup(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        sync_batchnorm: bool = False,
        compile: bool | dict[str, Any] = False,
        grad_compression: str | None = None,
        powersgd_rank: int = 2,
        powersgd_start: int | None = None,
        strategy: str = "ddp",
        fsdp_units: Any = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        sync: str = "every-step",
        sync_every: int | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        sync_dtype: str | None = None,
        sync_fragments: int = 1,
        sync_delay: int = 0,
        micro_shards: int | None = None,
        **ddp_kwargs: Any,
    ) -> Any:
        """Move ``model`` to the device, convert BatchNorm if asked, wrap it in DDP when world > 1.

        Parameters keep their identity, so an optimizer built before ``setup`` stays valid.
        Checkpoints hold plain parameter names whether the model is compiled or wrapped.

        Args:
            model: the model (maybe compiled already).
            optimizer: its optimizer; returned with the model, and stepped by :meth:`step`.
            sync_batchnorm: SyncBatchNorm across processes (world-size invariant statistics).
            compile: ``True`` or a dict of ``torch.compile`` arguments: compile the wrapped model.
            grad_compression: ``"fp16"``, ``"bf16"``, ``"powersgd"`` or ``"auto"`` (see
                :mod:`ddpkit.parallel.compression`): fewer bytes per step on slow links; its
                state is in every checkpoint.
            powersgd_rank: rank of PowerSGD's factors.
            powersgd_start: plain steps before PowerSGD compresses (default 10).
            strategy: ``"ddp"`` (replicated) or ``"fsdp"`` (FSDP2, :mod:`ddpkit.parallel.fsdp`:
                parameters, gradients and optimizer state sharded; the optimizer is rebound).
            fsdp_units: module classes that become FSDP units (else children above a size).
            reshard_after_forward: FSDP frees gathered parameters after each forward (ZeRO-3).
            cpu_offload: FSDP keeps shards and optimizer state in CPU memory.
            sync: ``"every-step"`` (DDP), or ``"local-sgd"``/``"diloco"``: train apart and meet every
                ``sync_every`` optimizer steps (:mod:`ddpkit.parallel.periodic`; the result then
                depends on the world size).
            sync_every: optimizer steps between syncs (required by ``"local-sgd"`` and ``"diloco"``).
            outer_lr: DiLoCo's outer learning rate.
            outer_momentum: DiLoCo's outer Nesterov momentum.
            sync_dtype: the sync's exchange of each rank's change, ``"bf16"`` (default) or ``"fp32"``.
            sync_fragments: Streaming DiLoCo: the model in this many fragments, each exchanged at its own
                step of the period (the link carries a fragment at a time).
            sync_delay: Streaming DiLoCo: inner steps each exchange runs in the background before it is
                applied; the rank keeps what it trained meanwhile.
            micro_shards: bitwise the same run on any power-of-two number of processes dividing it
                (:mod:`ddpkit.parallel.exact`): each global batch in this many shards, handed out by
                :meth:`shards`, each with its own BatchNorm statistics, summed along one fixed tree.
            **ddp_kwargs: further ``DistributedDataParallel`` arguments.

        With a seed (``ddpkit.init(seed=...)``), each rank draws from a random stream of its own
        from here on: dropout masks differ between ranks, as they would between the samples of one
        process. Draw random data that must be equal on every rank before ``setup``.

        Returns:
            The model, or ``(model, optimizer)`` when an optimizer is given.
        """
        options = SetupOptions(
            sync_batchnorm=sync_batchnorm,
            compile=compile,
            grad_compression=grad_compression,
            powersgd_rank=powersgd_rank,
            powersgd_start=powersgd_start,
            strategy=strategy,
            fsdp_units=fsdp_units,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
            ddp_kwargs=ddp_kwargs,
            sync=sync,
            sync_every=sync_every,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            sync_dtype=sync_dtype,
            sync_fragments=sync_fragments,
            sync_delay=sync_delay,
        )
        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        options.check(model, device=self.device, backend=backend, precision=self._run.precision.name)
        modes.check_combination(
            micro_shards=micro_shards,
            fault_tolerant=self._run.world.replica is not None,
            options=options,
            world_size=self.world_size,
            model=model,
            models_set_up=len(self._run.entries),
            micro_shards_set_up=any(isinstance(e.mode, modes.MicroShards) for e in self._run.entries),
        )
        if micro_shards is not None:
            mode: modes.Mode = modes.MicroShards(
                exact.setup(
                    model,
                    optimizer,
                    micro_shards,
                    device=self.device,
                    world_size=self.world_size,
                    rank=self.rank,
                    seed=self._run.seed,
                )
            )
            index = self._run.adopt(model, optimizer, mode=mode)
        else:
            model = self._run.world.prepare(model.to(self.device), options)
            wrapped = wrap(
                model,
                optimizer,
                options,
                device=self.device,
                world_size=self.world_size,
                is_main=self.is_main,
                precision=self._run.precision.name,
                timeout_s=self._settings.timeout,
            )
            if wrapped.sharded:
                self._run.precision.shard()
            model = wrapped.model
            index = self._run.adopt(
                model, optimizer, mode=wrapped.mode, buffers=wrapped.buffers, not_bitwise=wrapped.not_bitwise
            )
        resuming.restore_pending(self._run, index, is_main=self.is_main)
        self.heartbeat("start")  # the parameters are in place everywhere: the set-up made progress
        if self._run.seed is not None:
            # Identical weights came from one seed; dropout and the like now differ per rank.
            rng.seed_everything(self._run.seed + 1_000_003 * (self.rank + 1))
        return model if optimizer is None else (model, optimizer)

    def shards(self, *batch: Any) -> Iterator[Any]:
        """The micro-shards of the batch in hand, one at a time (``rt.setup(..., micro_shards=M)``).

        ``for x, y in rt.shards(inputs, targets): rt.backward(loss_fn(model(x), y))``, then
        :meth:`step`. Each item of ``batch`` (a tensor, or lists, tuples and dicts of them) is cut
        along its first dimension; one argument yields one part, several yield a tuple. See
        :mod:`ddpkit.parallel.exact`.
        """
        if not batch:
            raise UsageError("rt.shards needs the batch to cut, e.g. rt.shards(inputs, targets)")
        cut = next(
            (
                c
                for mode in self._run.modes
                if (c := mode.shards(self._run.active, self._run.loop.step, batch)) is not None
            ),
            None,
        )
        if cut is None:
            raise UsageError("rt.shards needs rt.setup(model, optimizer, micro_shards=M)")
        if not self._run.backward_since_step:
            self._run.unscaled.clear()  # a new step: fp16's unscaling is owed again (as rt.backward does)
        self._run.backward_since_step = self._run.uses_backward = True  # a rank with empty shards steps too
        return cut

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's state with plain names, on the CPU, on rank 0 (None elsewhere).

        Every rank must call it: fsdp gathers the shards (for export); DDP gives rank 0's copy.
        """
        return full_state_dict(model, is_main=self.is_main)

    def loader(self, dataset: Any, **options: Any) -> Any:
        """Batches of this rank's shard, on the device. Give exactly one of the two sizes.

        With ``global_batch_size`` every world size visits the same samples at each step. Each
        ``iter(loader)`` starts the epoch, like a ``DataLoader``; after :meth:`load` the next pass
        continues the saved one. An ``IterableDataset`` is read as a stream.

        Args:
            dataset: a map-style dataset or an ``IterableDataset``.
            **options: the fields of :class:`ddpkit.loop.build.LoaderOptions`: ``batch_size`` or
                ``global_batch_size``, ``shuffle``, ``drop_last``, ``num_workers``,
                ``collate_fn``, ``name`` (keys its position in checkpoints), ``weights`` and
                ``num_samples`` (drawn with replacement, like ``WeightedRandomSampler``),
                ``pin_memory``, ``prefetch_factor``, ``persistent_workers``, ``worker_init_fn``.
        """
        return build.build_loader(
            self._run,
            dataset,
            build.loader_options(options),
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            on_batch=lambda made: loop_steps.on_batch(self._run, made),
            watch=self._watch_progress,
        )

    def epochs(self, n: int, start: int = 0) -> Iterator[int]:
        """``n`` epochs, numbered from ``start``, from where a loaded checkpoint left off; sets every loader's epoch.

        ``for epoch in rt.epochs(10, start=1)`` yields 1 to 10, as ``range(1, 11)`` does; a run
        resumed after epoch 4 yields 5 to 10. A run resumed from a checkpoint written after its
        last epoch yields nothing, and says so in one line.
        """
        return loop_steps.epochs(self._run, n, start)

    def autocast(self) -> ContextManager[Any]:
        """Autocast for the run's precision (nothing for fp32)."""
        return self._run.precision.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the mean loss of this rank's batch, weighted by its true sample count.

        ``loss`` must be the mean over the local batch (PyTorch's default reduction). Uneven
        last batches then count every sample once, as in a single process.
        """
        loop_steps.backward(self._run, loss)

    def step(self, *optimizers: torch.optim.Optimizer) -> bool:
        """Optimizer step (through the GradScaler for fp16), then ``zero_grad``, for each optimizer.

        Several optimizers in one step (``rt.step(gen_opt, disc_opt)``, or one call each after the
        same backward) update the fp16 scaler once and count as one step. Inside :meth:`accumulate`
        only the last micro-step steps. Returns True when every optimizer updated its parameters;
        False when fp16 skipped the step for inf/nan gradients, or inside an accumulation group,
        so a learning-rate scheduler can follow (``if rt.step(opt): scheduler.step()``).
        """
        return loop_steps.step(self._run, optimizers)

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip the gradients of ``model`` to ``max_norm``; returns their total norm before clipping.

        Under fp16 the gradients are unscaled first (the optimizers given to :meth:`setup` or
        :meth:`step`). Inside :meth:`accumulate` it clips only on the micro-step that syncs,
        where the gradients are complete, and returns None on the others.
        """
        return loop_steps.clip_grad_norm_(self._run, model, max_norm, norm_type)

    def should_stop(self, flag: bool) -> bool:
        """True on every rank when any rank passes True: early stopping without a stranded rank.

        Every rank must call it at the same point (it is one small all-reduce).
        """
        return loop_steps.should_stop(flag, self.world_size)

    def accumulate(self, model: torch.nn.Module, steps: int) -> ContextManager[bool]:
        """One micro-step of gradient accumulation over ``steps`` batches.

        Gradients are not all-reduced (DDP ``no_sync``) except on the last micro-step, and
        :meth:`step` only steps there. Yields True on the last micro-step.
        """
        return loop_steps.accumulate(self._run, model, steps)

    def log(self, metrics: Mapping[str, Any], *, step: int | None = None, reduce: str | None = "mean") -> dict:
        """Write metrics on rank 0 (``out_dir``/metrics.jsonl, .csv, TensorBoard).

        Every rank must call it: values are reduced across ranks (``reduce="mean"``, ``"sum"``,
        ``"max"`` or None to keep rank 0's). Returns the values written.
        """
        values = as_floats(metrics)
        if reduce is not None and self.world_size > 1 and values:
            reduced = collectives.all_reduce(torch.tensor(list(values.values()), dtype=torch.float64), reduce)
            values = dict(zip(values, reduced.tolist()))
        if self.is_main and self._out_dir is not None:
            if self._logger is None:
                # Rows after the step we resumed from belong to work a crash undid; a fresh run
                # (nothing loaded) starts its files anew.
                chosen = self._settings.trackers
                self._logger = MetricsLogger(
                    self._out_dir,
                    resume=self._run.loop.resumed_from is not None,
                    resume_step=self._run.loop.resumed_step,
                    tensorboard=chosen is None or "tensorboard" in chosen,
                )
            at = self.global_step if step is None else step
            self._logger.log(values, step=at)
            if self._run.tracking is not None:
                self._run.tracking.log({"step": at, **values})
        return values

    def _plot_loss(self) -> Path | None:
        """Draw ``out_dir``/loss.png from the logged losses (rank 0; None elsewhere)."""
        return self._logger.plot_loss() if self._logger is not None else None

    def save(self, path: str | os.PathLike, state: Mapping[str, Any] | torch.nn.Module) -> Path:
        """Save ``state`` plus ddpkit's own (loop state, every rank's RNGs, scaler).

        Every rank must call it (it gathers each rank's random state); called on rank 0 alone it
        fails within ``save_timeout`` seconds, naming the ranks that did not come. Global rank 0
        writes atomically; if the write fails, every rank raises. A directory ``path`` gets
        ``ckpt-stepNNNNNNNN.pt`` and keeps the newest ``keep_checkpoints``. Each entry of ``state``
        is also at the top of a ``.pt`` file, so ``torch.load(path)["model"]`` reads it back.

        ``rt.save("model.pt", model)`` (a model, not a mapping) writes the model's weights alone,
        with plain names, as ``torch.save(model.state_dict(), path)`` does: what
        ``model.load_state_dict(torch.load(path))`` reads, and :meth:`load` with a model too.
        """
        if isinstance(state, torch.nn.Module):
            return self._save_weights(Path(path), state)
        if not self._run.world.writes(state):  # a replica that is not the one to write: it holds the same state
            return resuming.target_of(path, self._run.loop.step)
        saved = resuming.save(self._run, self._peers, path, state, keep=self._settings.keep_checkpoints)
        if self.preempted:
            self._exit_preempted(saved)
        return saved

    def _exit_preempted(self, saved: Path) -> None:
        """The preempted save is on disk: tell the launcher, end the tracker runs, exit with 75."""
        from ddpkit.distributed import preemption

        if self._env.local_rank == 0:
            preemption.mark_saved()
        self.print(
            f"ddpkit: preempted ({self._run.preemption.name}); saved {saved} at step {self.global_step}, "
            f"exiting with code {preemption.EXIT_CODE} (resume='auto' continues from it)",
            flush=True,
        )
        self._outcome = "KILLED"
        self.close()
        raise SystemExit(preemption.EXIT_CODE)

    def load(
        self, path: str | os.PathLike, state: MutableMapping[str, Any] | torch.nn.Module, *, strict: bool = True
    ) -> Path:
        """Restore ``state`` and ddpkit's own on every rank; a directory means its newest checkpoint.

        Resumes mid-epoch exactly: the next batch is the one after the last trained, also for
        loaders built after ``load``. A saved position that matches no loader, or a loader built
        differently from the saved one, is an error (a warning with ``strict=False``, and that
        loader's epoch starts over). Every rank must call it.

        With a model instead of a mapping, only its weights are loaded: from a file of weights
        (``rt.save(path, model)``, ``torch.save(model.state_dict(), path)``) or a checkpoint's
        ``"model"`` entry; the loop and random states are left as they are.
        """
        if isinstance(state, torch.nn.Module):
            return self._load_weights(Path(path), state)
        return resuming.load(self._run, self._peers, path, state, strict=strict)

    def _save_weights(self, path: Path, model: torch.nn.Module) -> Path:
        """``rt.save(file, model)``: the model's plain state dict, written by rank 0 atomically."""
        if path.is_dir():
            raise UsageError(
                f"rt.save({str(path)!r}, model) writes one file of weights; give a file name "
                "(a checkpoint directory takes a mapping: rt.save(path, {'model': model, ...}))"
            )
        weights = self.full_state_dict(model)
        error = None
        if self.is_main and weights is not None:
            try:
                pt.write(path, weights)
            except OSError as exc:
                error = f"rt.save: could not write {path} ({exc.strerror or exc})"
        error = collectives.broadcast_object(error)
        if error:
            raise DdpkitError(error)
        return path

    def _load_weights(self, path: Path, model: torch.nn.Module) -> Path:
        """``rt.load(file, model)``: weights alone, from a file of them or a checkpoint's ``"model"`` entry."""
        from ddpkit.checkpoint.safe import safe_load
        from ddpkit.checkpoint.state import restore_user_state

        if path.is_dir():
            found = checkpoint.latest(path) if not checkpoint.dcp.is_dcp(path) else path
            if found is None:
                raise UsageError(f"rt.load: no complete checkpoint in {path}")
            path = found
        if path.is_dir():
            saved = checkpoint.read(path)["user"]
        else:
            checkpoint.verify(path)
            saved = safe_load(path, path)
            if isinstance(saved, dict) and saved.get("format") == pt.FORMAT:
                saved = saved["user"]
            else:
                saved = {"model": saved}
        if "model" not in saved:
            raise UsageError(
                f"rt.load({str(path)!r}, model): the checkpoint has no 'model' entry (it has "
                f"{', '.join(sorted(saved))}); load it with a mapping naming its entries"
            )
        from ddpkit.parallel.fsdp import is_sharded

        if is_sharded(model):
            checkpoint.dcp.load_plain_into_sharded({"model": model}, {"model": saved["model"]})
        else:
            restore_user_state({"model": model}, {"model": saved["model"]}, str(path))
        return path

    def checkpoint(self, state: Mapping[str, Any]) -> Path:
        """Save ``state`` into ``checkpoint_dir`` (given to :func:`ddpkit.init`), keeping the newest few."""
        if self._checkpoint_dir is None:
            raise UsageError("rt.checkpoint(state) needs ddpkit.init(checkpoint_dir=...)")
        return self.save(self._checkpoint_dir, state)

    def resume(self, state: MutableMapping[str, Any], *, strict: bool = True) -> Path | None:
        """Load what ``init(resume=...)`` names into ``state``; returns the checkpoint, or None.

        ``resume="auto"`` takes the newest complete checkpoint of ``checkpoint_dir`` and does
        nothing when there is none yet, so one script serves the first start and every
        restart of ``ddpkit run --max-restarts K``. ``strict`` as for :meth:`load`.
        """
        if self._run.world.defer_resume(state, strict):
            return None
        return resuming.resume(
            self._run, self._peers, self._settings.resume, self._checkpoint_dir, state, strict=strict
        )

    def close(self) -> None:
        """Flush logs and destroy the process group. Runs at exit too, also when the script raised."""
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._logger is not None:
            self._logger.close()
        if self._run.tracking is not None:
            self._run.tracking.close(self._outcome or ("FAILED" if self._failed else "FINISHED"))
        if self._run.preemption is not None:
            self._run.preemption.uninstall()
        heartbeats.set_target(None)
        finished = not self._failed and self._outcome is None and self._run.loop.step > 0
        for mode in self._run.modes:
            mode.close(finished=finished)
        process_group.destroy()
        if self._on_close is not None:
            self._on_close(self)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Runtime(launcher={self._env.launcher!r}, rank={self.rank}, local_rank={self._env.local_rank}, "
            f"world_size={self.world_size}, device={str(self.device)!r}, backend={self._backend!r})"
        )
