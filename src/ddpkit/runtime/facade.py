"""``rt``, the object a user script holds: a thin facade over the run's parts.

:class:`Runtime` composes the place in the world, one :class:`~ddpkit.state.run.RunState`, the
run's :class:`~ddpkit.checkpoint.resume.Peers` and its :class:`~ddpkit.observe.reporter.Reporter`;
each method hands its work to the module that owns it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from ddpkit import rng
from ddpkit.checkpoint import restore
from ddpkit.checkpoint import resume as resuming
from ddpkit.distributed import collectives, process_group, store_sync
from ddpkit.distributed.environment import Environment
from ddpkit.errors import DdpkitError, UsageError, called_from_user_code, note_failures, warn
from ddpkit.loop import build, dataloaders
from ddpkit.loop import steps as loop_steps
from ddpkit.observe import heartbeats, progress
from ddpkit.observe.metrics import as_floats
from ddpkit.observe.reporter import Reporter
from ddpkit.parallel.modes import reduced_over
from ddpkit.parallel.options import SetupOptions
from ddpkit.parallel.wrap import full_state_dict
from ddpkit.runtime import saving, setting_up
from ddpkit.state.precision import Precision
from ddpkit.state.run import RunState


class Runtime:
    """Rank, device and backend of this process, the collectives it may call, and the training API.

    Create it with :func:`ddpkit.init`, not directly. Its state is one :class:`~ddpkit.state.run.RunState`;
    the settings it was given are ``ddpkit.init``'s arguments.
    """

    def __init__(
        self,
        env: Environment,
        device: torch.device,
        backend: str,
        settings: Any,
        *,
        run: RunState,
        peers: resuming.Peers,
        reporter: Reporter,
        on_close: Callable[[Runtime], None] | None = None,
    ) -> None:
        self.device = device
        """This process's device: the local rank's GPU where CUDA is usable, else the CPU."""
        self._env, self._backend, self._settings = env, backend, settings
        self._checkpoint_dir = Path(settings.checkpoint_dir) if settings.checkpoint_dir is not None else None
        self._run, self._peers, self._reporter = run, peers, reporter
        self._on_close = on_close  # init's: forget the current runtime
        self._local_first_count = 0
        self._closed = self._failed = self._told_replica = False
        self._outcome: str | None = None  # "KILLED" after a preempted save
        if run.tracking is not None:
            run.tracking.outcome = lambda: self._outcome or ("FAILED" if self._failed else "FINISHED")
        previous = sys.excepthook
        self._forget_failures = note_failures(self._note_failure)  # ddpkit.launch's children call it too

        def note_failure(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
            self._note_failure(value)
            previous(kind, value, traceback)

        sys.excepthook = note_failure

    def _note_failure(self, error: BaseException) -> None:
        """The script ends by ``error``: close as failed (no peer takes its missing calls for a mismatch)."""
        if not isinstance(error, SystemExit):
            self._failed = True  # close at exit ends the tracker runs as failed
            if self._reporter.watchdog is not None:  # a peer that left: a mismatch the report names
                self._reporter.watchdog.uncaught(error)

    @property
    def rank(self) -> int:
        """Global rank of this process.

        In a fault-tolerant job each replica is a one-process group: ``rt.rank`` is 0 in every
        replica, and :attr:`replica` says which replica this is (read from a script, it says so once).
        """
        if self._run.world.replica is not None and not self._told_replica and called_from_user_code():
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
        :meth:`checkpoint` (or :meth:`save`), which then ends the process with exit code 75 once the
        checkpoint is on disk (``if rt.preempted: rt.checkpoint(state)``). Restart the job with
        ``resume="auto"`` (a requeued SLURM job does) to continue where it stopped.
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
        self._refuse("rt.barrier")
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
        self._run.local_first = True  # rt.loader skips its collective check: local rank 0 is here alone
        try:
            with store_sync.local_main_first(self._env.node_rank, self._env.local_rank == 0, self._local_first_count):
                yield
        finally:
            self._run.local_first = False

    def all_reduce(self, value: Any, op: str = "sum") -> Any:
        """Sum, mean, max or min of ``value`` across ranks (see :func:`ddpkit.all_reduce`)."""
        self._refuse("rt.all_reduce")
        return collectives.all_reduce(value, op, over=reduced_over(self._run.modes))

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
        it in long stretches of your own (a slow export), so that peers waiting for this rank in a
        collective do not count it as stuck. No I/O; nothing with ``hang_timeout=0`` or one process.
        """
        self._reporter.beat(self.global_step, phase)

    def _watch_progress(self, probe: Callable[[], int]) -> None:
        """Count a rise of ``probe()`` (samples a loader's workers read) as progress for the watchdog."""
        self._reporter.watch(probe)

    def setup(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *optimizers: torch.optim.Optimizer,
        **options: Any,
    ) -> Any:
        """Move ``model`` to the device and wrap it as its options say: DDP when world > 1 (the
        default), FSDP, an infrequent sync, or micro-shards.

        Parameters keep their identity, so an optimizer built before ``setup`` stays valid.
        Checkpoints hold plain parameter names whether the model is compiled or wrapped. With a
        seed (``ddpkit.init(seed=...)``), each rank draws from a random stream of its own from here
        on: dropout masks differ between ranks, as they would between the samples of one process.
        Draw random data that must be equal on every rank before ``setup``. Under ``micro_shards``
        every rank goes on with rank 0's stream instead, keyed again by each batch and each shard.

        Example:
            >>> model, optimizer = rt.setup(model, optimizer, sync_batchnorm=True)   # doctest: +SKIP
            >>> model, optimizer = rt.setup(model, optimizer, micro_shards=2)        # doctest: +SKIP

        Several optimizers over parts of the model (a head's and a body's at other rates, a learned
        temperature's of its own), ``rt.setup(model, head, body)``, come back with it, in order.

        Args:
            model: the model (maybe compiled already).
            optimizer: its optimizer; returned with the model, and stepped by :meth:`step`.
            *optimizers: more of its optimizers, returned after the first.
            **options: the fields of :class:`~ddpkit.parallel.options.SetupOptions`, each documented
                there (``sync_batchnorm``, ``compile``, ``grad_compression``, ``strategy``, ``sync``,
                ``sync_every``, ``micro_shards``, ...); a keyword of ``DistributedDataParallel``'s
                goes to it (``find_unused_parameters=True``, ...), and any other is refused in one line.

        Returns:
            The model, or ``(model, optimizer, ...)`` when optimizers are given.
        """
        if optimizers and optimizer is None:
            raise UsageError("rt.setup(model, None, other): give the optimizers in order, without None")
        model, index = setting_up.adopt(
            self._run,
            model,
            optimizer,
            SetupOptions.from_keywords(options),
            others=optimizers,
            device=self.device,
            rank=self.rank,
            world_size=self.world_size,
            is_main=self.is_main,
            timeout_s=self._settings.timeout,
        )
        restore.restore_pending(self._run, index, is_main=self.is_main)
        loop_steps.watch_direct_steps(self._run)  # a script's own optimizer.step() is a step of the run too
        loop_steps.watch_forwards(self._run, model)
        self.heartbeat("start")  # the parameters are in place everywhere: the set-up made progress
        if self._run.seed is not None:
            # Identical weights came from one seed; dropout and the like now differ per rank. Under
            # micro_shards every rank goes on with rank 0's stream, one process's: what the loop draws
            # outside the shards (mixup's lam for the batch) is then the same on any world size.
            stream = 0 if self._run.micro_shards else self.rank
            rng.seed_everything(self._run.seed + 1_000_003 * (stream + 1))
        return model if optimizer is None else (model, optimizer, *optimizers)

    def shards(self, *batch: Any) -> Iterator[Any]:
        """The micro-shards of the batch in hand, one at a time (``rt.setup(..., micro_shards=M)``).

        ``for x, y in rt.shards(inputs, targets): rt.backward(loss_fn(model(x), y))``, then
        :meth:`step`. Each item of ``batch`` (a tensor, or lists, tuples and dicts of them) is cut
        along its first dimension; one argument yields one part, several yield a tuple. See
        :mod:`ddpkit.parallel.exact`.
        """
        return loop_steps.shards(self._run, batch)

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
            dataset: a map-style dataset or an ``IterableDataset``; or a ``DataLoader``, whose batch size
                is then the global batch and whose sampler, collate_fn and workers become the options
                (:mod:`ddpkit.loop.dataloaders`; those given here win).
            **options: the fields of :class:`ddpkit.loop.build.LoaderOptions`, each documented there
                (``global_batch_size``, ``shuffle``, ``num_workers``, ``name``, ...).
        """
        if isinstance(dataset, torch.utils.data.DataLoader):
            dataset, options = dataloaders.from_dataloader(dataset, options)
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
        last epoch yields nothing, and says so in one line. Each loop of a script is a stage of its
        own (a warm-up's ``rt.epochs(2)``, then a fine-tuning's ``rt.epochs(3)`` yields 0 to 2), while
        ``rt.epoch`` goes on counting; a run resumed inside a later loop skips the ones before it.
        """
        return loop_steps.epochs(self._run, n, start)

    def autocast(self) -> ContextManager[Any]:
        """Autocast for the run's precision (nothing for fp32)."""
        return self._run.precision.autocast()

    def backward(self, loss: torch.Tensor, count: Any = None) -> None:
        """Backward of the mean loss of this rank's batch, weighted by its true sample count.

        ``loss`` must be the mean over the local batch (PyTorch's default reduction). Uneven
        last batches then count every sample once, as in a single process.

        A loss averaged over units of its own, such as the tokens a language model's loss counts
        (``ignore_index`` left out), passes their number as ``count``: the step's gradient is then
        the mean over every unit of the step, on any number of processes and accumulated batches,
        where a mean of per-rank means weighs a rank's few tokens as much as another's many.

        Example:
            >>> loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)  # doctest: +SKIP
            >>> rt.backward(loss, count=(labels != -100).sum())                                    # doctest: +SKIP

        Args:
            loss: the mean loss of this rank's batch (or micro-shard).
            count: the units ``loss`` averages (a number or a one-element tensor); pass it to every
                ``rt.backward`` of a step or to none (:mod:`ddpkit.loop.counted`).
        """
        loop_steps.backward(self._run, loss, count)

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

    def unscale_gradients(self, *optimizers: torch.optim.Optimizer) -> None:
        """Make the step's gradients final now, for the script's own code before :meth:`step`.

        After the step's last :meth:`backward` (and the end of its ``rt.shards`` loop), the gradients
        are those of a plain DDP step, except where the step itself still finishes them: fp16 divides
        them by its loss scale (Accelerate's ``unscale_gradients``), ``rt.backward(loss, count=n)`` by
        every rank's units, a fault-tolerant replica averages them over the step's quorum. This does
        it now, so that code of the script may read, clip (``torch.nn.utils.clip_grad_norm_``) or
        change them. Without it such a change is refused at the next call in one line, never applied
        to the wrong numbers. :meth:`clip_grad_norm_` calls it itself. Under fp16, ``optimizers`` are
        the ones unscaled (none: every one given to :meth:`setup` or :meth:`step`). Does nothing on an
        :meth:`accumulate` micro-step that does not sync; a :meth:`backward` after it in the same step
        is refused where it changed the gradients.
        """
        loop_steps.unscale_gradients(self._run, optimizers)

    def should_stop(self, flag: bool) -> bool:
        """True on every rank when any rank passes True: early stopping without a stranded rank.

        Every rank must call it at the same point (it is one small all-reduce).
        """
        self._refuse("rt.should_stop")
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
        ``"max"`` or None to keep rank 0's). Returns the values written. While a batch of
        ``rt.loader`` is in hand (its pass not over), the mean weighs each rank's value by its samples
        of that batch, so a batch's mean loss logs as one process's mean over the global batch (a rank
        with no sample of a short last batch adds nothing, its NaN included); a value the same on
        every rank logs as it is. Elsewhere (after the pass) each rank counts the same. A fault-tolerant replica
        reduces nothing (its group is itself): the replica ranked first in the step's quorum writes its
        own values, so sum a metric over the quorum first with ``rt.all_reduce`` inside the step.
        """
        self._refuse("rt.log")
        values = as_floats(metrics)
        active = self._run.latest  # (not the training batch's under a validation pass: that pass's, or none)
        if reduce == "mean" and self.world_size > 1 and values and active is not None and active.live:
            # a batch of rt.loader in hand: each rank's value weighs by its samples of it, as one
            # process's mean over the global batch does (a rank with none of a short last batch adds
            # nothing: its loss is the NaN mean of no sample)
            weighted = collectives.weighted_mean(list(values.values()), float(active.local_count))
            values = dict(zip(values, weighted))
        elif reduce is not None and self.world_size > 1 and values:
            reduced = collectives.all_reduce(torch.tensor(list(values.values()), dtype=torch.float64), reduce)
            values = dict(zip(values, reduced.tolist()))
        if self.is_main:
            step = self.global_step if step is None else step
            resumed = (self._run.loop.resumed_from, self._run.loop.resumed_step)
            self._reporter.write(values, step, resumed=resumed, tracking=self._run.tracking)
        return values

    def _plot_loss(self) -> Path | None:
        """Draw ``out_dir``/loss.png from the logged losses (rank 0; None elsewhere)."""
        return self._reporter.plot_loss()

    # saving and loading: ddpkit.runtime.saving
    save = saving.save
    load = saving.load
    checkpoint = saving.checkpoint
    resume = saving.resume
    _exit_preempted = saving.exit_preempted

    def close(self) -> None:
        """Wait for the checkpoint being written, flush logs and destroy the process group.

        Runs at exit too, also when the script raised. A checkpoint written in the background
        that failed raises here, in one line (at exit: printed, and the process exits with 1).
        """
        if self._closed:
            return
        self._closed = True
        failed = resuming.settle(self._run)  # None where nothing was written
        self._failed = self._failed or failed is not None
        try:
            self._close()
        finally:
            if failed is not None:
                raise DdpkitError(failed)

    def _close_at_exit(self) -> None:
        """:meth:`close` at interpreter exit: a failed background write ends the process with 1."""
        try:
            self.close()
        except DdpkitError as exc:
            from ddpkit.distributed import entry

            sys.stderr.write(f"ddpkit: error: {exc}\n")
            entry.flush_open_files()
            entry.leave(1)  # an atexit handler cannot set the exit status otherwise

    def _close(self) -> None:
        loop_steps.unwatch_direct_steps(self._run)  # first: torch's global hooks never outlive the run
        self._forget_failures()
        self._reporter.close(failed=self._failed)
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
