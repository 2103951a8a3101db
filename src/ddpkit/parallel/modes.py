"""The ways ddpkit trains data-parallel, each an object behind one small protocol.

The step, the save and the set-up call :class:`Mode`'s methods on every mode of the run and never
ask which mode they hold. A run has one mode a set-up model, and one for how its processes meet:

- :class:`Replicated`: DDP, or one process (with its gradient compression hook, if any);
- :class:`Sharded`: FSDP;
- :class:`Periodic`: DiLoCo and local SGD (:mod:`ddpkit.parallel.periodic`);
- :class:`MicroShards`: the same bits on any world size (:mod:`ddpkit.parallel.exact`);
- :class:`Frozen`: a model that does not train (a distillation teacher), on every rank as rank 0 holds it;
- :class:`~ddpkit.parallel.replica.FaultTolerant`: a replica of ``ddpkit run --fault-tolerant``;
  every other run meets in a process group (:class:`ProcessGroup`).

Which combinations are refused, and why, is decided in one place: :func:`check_combination`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from ddpkit.errors import UsageError
from ddpkit.parallel import exact_tree
from ddpkit.parallel.fsdp import no_gradient_sync


def reduced_over(modes: Sequence[Mode]) -> Any:
    """Where a script's reduction goes when a mode makes it itself (a fault-tolerant replica's step
    quorum, :meth:`Mode.reduces_over`); None: the process group."""
    for mode in modes:
        group = mode.reduces_over()
        if group is not None:
            return group
    return None


class Mode:
    """What a mode does at each point of a run; the defaults do nothing (a plain DDP step).

    Set-up: :meth:`prepare`, :meth:`left_to_wrap`, :meth:`refuse` and :meth:`reduces_over`. A step: :meth:`on_batch`, :meth:`loss_weight`,
    :meth:`shards`, :meth:`after_backward`, :meth:`complete`, :meth:`commit`, :meth:`after_step`.
    Saving: :meth:`is_main`, :meth:`state_dict`, :meth:`load_state_dict`. The loop: :meth:`begin_epochs`,
    :meth:`end_training`. The end: :meth:`close`.
    """

    name = "replicated"
    """How the mode is named in messages and checkpoints."""

    same_weights = False
    """Every rank holds the same weights at each step's start (DDP, micro-shards, over one process
    group): ``rt.step`` checks it at the run's first step (:mod:`ddpkit.parallel.same_model`)."""

    @property
    def replica(self) -> int | None:
        """Which replica of a fault-tolerant job this process is (None: not one)."""
        return None

    @property
    def replicas(self) -> int:
        """Replicas of the job (1: not a fault-tolerant job)."""
        return 1

    quorum: Any = None
    """What splits each step's global batch over the replicas in it (a fault-tolerant job's
    :class:`~ddpkit.distributed.ft.Replica`); None: the ranks share every batch by rank."""

    def prepare(self, model: torch.nn.Module, options: Any) -> torch.nn.Module:
        """Another model being set up under this mode: refuse what it does not take, adapt the model."""
        return model

    def left_to_wrap(self, options: Any) -> Any:
        """``rt.setup``'s options less what this mode does itself (a fault-tolerant replica casts the
        gradients it averages over the quorum): what the model's wrapper is given."""
        return options

    def takes(self, mode: Mode) -> None:
        """A model's ``mode`` was set up under this one: a mode that meets the processes hands it what it
        meets through (a fault-tolerant replica's quorum, to an infrequent sync's exchanges: :meth:`meet_over`)."""

    def meet_over(self, replica: Any) -> None:
        """Make this mode's own exchanges over a fault-tolerant replica's quorum (a
        :class:`~ddpkit.distributed.ft.Replica`); a mode that has none ignores it."""

    def take_micro_shards(self) -> None:
        """The run's model trains with ``micro_shards``, whose fixed tree sums the gradients: a mode
        that meets the processes hands that exchange over (a fault-tolerant job's quorum shares the shards)."""

    def refuse(self, call: str) -> None:
        """Raise a one-line :class:`UsageError` if ``call`` (``"rt.accumulate"``, ``"rt.all_reduce"``,
        ``"ddpkit.all_gather_object"``, ...) cannot run under this mode."""

    def reduces_over(self) -> Any:
        """Where a script's ``rt.all_reduce`` goes when it is not the process group: an object with
        ``device`` and ``reduce_(tensor, op)`` (a fault-tolerant replica's step quorum); None: the
        process group."""
        return None

    def on_batch(self, models: Sequence[torch.nn.Module], loader: Any) -> None:
        """A batch of ``loader`` is in hand; its forward follows."""

    def changes_weights_on_batch(self) -> bool:
        """Whether :meth:`on_batch` will change the weights (an exchange due over a fault-tolerant quorum):
        a checkpoint still copying them in the background is waited for first."""
        return False

    def loss_weight(self, weight: Any, *, counted: bool = False) -> Any:
        """The weight of the loss ``rt.backward`` is given, from the one the batch's share gives
        (``counted``: from its units, ``rt.backward(loss, count=n)``, which the step divides by all of them)."""
        return weight

    def sums_gradients(self) -> bool:
        """Whether the step's exchange sums the processes' gradients rather than averaging them (a
        backward of counted units is then not multiplied by the world size)."""
        return False

    def shards(self, active: Any, step: int, batch: tuple[Any, ...]) -> Iterator[Any] | None:
        """The micro-shards of the batch in hand, if this mode cuts batches (None: it does not)."""
        return None

    def after_backward(self) -> None:
        """A backward has run."""

    def complete(self, params: Sequence[torch.Tensor], *, stepping: bool = False) -> None:
        """Make the gradients of ``params`` whole before they are clipped, read or stepped (a reduction
        that waited). ``stepping``: ``rt.step`` is about to commit, and a mode whose :meth:`commit` makes
        them whole itself leaves them to it."""

    def finishes_at_step(self) -> str | None:
        """What this mode still does to the step's gradients at ``rt.step``, after the script's code
        between the last backward and the step, that its :meth:`complete` would do now (a fault-tolerant
        replica averages them over the step's quorum); None: nothing. A script's change to them meanwhile
        is refused (:mod:`ddpkit.loop.gradients`)."""
        return None

    def accumulating(self, group: tuple[int, bool] | None) -> None:
        """``rt.accumulate`` opens a micro-step: (samples of its group, whether it is the last); None when it ends."""

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """A micro-step of ``rt.accumulate`` that keeps its gradients local (DDP's ``no_sync``)."""
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def exchanges_every_stepped(self) -> bool:
        """Whether the step exchanges the gradient of every parameter the stepped optimizers hold (a
        fault-tolerant replica's quorum average), so a parameter outside the set-up models needs no
        optimizer given to ``rt.setup``."""
        return False

    def also_steps(self, optimizer: torch.optim.Optimizer) -> None:
        """Another optimizer given to ``rt.setup`` with the model (``rt.setup(model, head, body)``): its
        parameters train under this mode as the first one's do (one outside the model too)."""

    def rebind(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer about to step: a mode that replaced the model's parameters at ``rt.setup`` (fsdp)
        points one built before it, and not given to it, at the new ones (else it would train nothing)."""

    def commit(self, params: Sequence[torch.Tensor], active: Any) -> bool:
        """Whether the step in hand is applied (False: nothing of it is; the batch comes again)."""
        return True

    def step_dropped(self) -> None:
        """The step in hand was not committed (a fault-tolerant replica died during it): put back what
        this mode changed in it; the batch comes again."""

    def after_step(self) -> None:
        """An optimizer step was taken."""

    def begin_epochs(self) -> None:
        """``rt.epochs`` is about to yield its first epoch: where the run stands must be known by then
        (a fault-tolerant replica joins its first quorum here, healing or resuming, so the epoch it
        yields is the one its loader reads)."""

    def end_training(self) -> None:
        """The run's training is over (``rt.epochs`` ran to its end): leave the processes at one
        common model. Every process calls it at the same point."""

    def is_main(self, rank: int) -> bool:
        """Whether this process is the one that prints, logs and saves."""
        return rank == 0

    def writes(self, state: Any) -> bool:
        """A save of ``state`` (the user's mapping): whether this process takes part in it."""
        return True

    def defer_resume(self, state: Any, strict: bool) -> bool:
        """``rt.resume(state)``: True when the mode resumes it later itself (a fault-tolerant replica
        heals from a live peer at its first quorum, or reads the checkpoint then)."""
        return False

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of the mode on this rank (None: nothing)."""
        return None

    def load_state_dict(self, saved: dict[str, Any], *, same_world: bool, source: str) -> None:
        """Take a state :meth:`state_dict` made (``same_world``: written on this many processes)."""

    def take_peer_state(self, saved: dict[str, Any], source: str) -> None:
        """Take a live peer's :meth:`state_dict` (a fault-tolerant replica healing): where the peer stands."""
        self.load_state_dict(saved, same_world=True, source=source)

    def close(self, *, finished: bool) -> None:
        """The run ends (``finished``: it ran to its end)."""


class ProcessGroup(Mode):
    """How the processes of every run but a fault-tolerant one meet: one process group."""

    name = "process-group"
    same_weights = True


class Replicated(Mode):
    """DDP (or one process), with a gradient compression hook (:mod:`ddpkit.parallel.compression`) or none."""

    same_weights = True

    def __init__(self, compressor: Any = None) -> None:
        self.compressor = compressor
        """The hook's state (PowerSGD's error feedback, ...), or None."""

    def after_step(self) -> None:
        """The compressor counts the step (PowerSGD starts compressing after its warm-up)."""
        if self.compressor is not None:
            self.compressor.after_step()

    def state_dict(self) -> dict[str, Any] | None:
        """The compressor's state (PowerSGD's error feedback and factors), or None."""
        return None if self.compressor is None else self.compressor.state_dict()

    def load_state_dict(self, saved: dict[str, Any], *, same_world: bool, source: str) -> None:
        """The compressor's state from a checkpoint."""
        if self.compressor is not None:
            self.compressor.load_state_dict(saved, same_world=same_world, source=source)


class Sharded(Mode):
    """FSDP: parameters, gradients and optimizer state sharded (:mod:`ddpkit.parallel.fsdp`)."""

    name = "sharded"

    def __init__(self, replaced: dict[int, tuple[Any, torch.nn.Parameter]] | None = None) -> None:
        self.replaced = replaced or {}
        """The model's parameters before sharding, by ``id``: (a weak reference to it, its sharded parameter)."""
        self._bound: weakref.WeakKeyDictionary[Any, tuple[int, ...]] = weakref.WeakKeyDictionary()
        """Optimizers already pointed at the sharded parameters, by their groups' sizes then."""

    def also_steps(self, optimizer: torch.optim.Optimizer) -> None:
        """Rebound to the sharded parameters at once, as the first one is (checked before sharding:
        :meth:`~ddpkit.parallel.options.SetupOptions.check_more_optimizers`)."""
        self.rebind(optimizer)

    def rebind(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer built on the model's parameters before ``rt.setup`` and not given to it (a second
        one, over part of the model) steps the sharded parameters, as the one given was rebound: it
        stepped parameters the model no longer held, and trained nothing, silently.

        Raises:
            UsageError: it stepped those parameters already (its state is theirs).
        """
        if not self.replaced:
            return
        sizes = tuple(len(group["params"]) for group in optimizer.param_groups)
        if self._bound.get(optimizer) == sizes:
            return
        for group in optimizer.param_groups:
            params = group["params"]
            if not any(id(p) in self.replaced for p in params):
                continue
            bound = []
            for p in params:
                entry = self.replaced.get(id(p))
                if entry is None or entry[0]() is not p:
                    bound.append(p)
                    continue
                if optimizer.state.get(p):
                    raise UsageError(
                        "an optimizer that stepped the model's parameters before rt.setup(..., strategy='fsdp') "
                        "replaced them steps again: build it before training, or after rt.setup from the set-up "
                        "model's parameters"
                    )
                bound.append(entry[1])
            group["params"] = bound
        self._bound[optimizer] = sizes

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """FSDP's own: gradients kept unsharded and unreduced until the last micro-step."""
        return no_gradient_sync(model)


class Periodic(Mode):
    """DiLoCo or local SGD: ranks train apart and meet every ``sync_every`` steps."""

    def __init__(self, syncer: Any) -> None:
        self.syncer = syncer
        """The model's :class:`~ddpkit.parallel.periodic.PeriodicSync`."""
        self.name = syncer.name

    def after_step(self) -> None:
        """The sync counts the step, and the ranks meet every H."""
        self.syncer.after_step()  # counts the step, and meets every H

    def refuse(self, call: str) -> None:
        """A loss weighted by its units (``rt.backward(count=...)``) is not built for replicas that train apart."""
        if call == "rt.backward(count=...)":
            raise UsageError(
                f"rt.backward(count=...) with sync={self.name!r} is not built yet (each replica steps on its own "
                "gradients between syncs); pass the loss alone, or train with sync='every-step'"
            )

    def meet_over(self, replica: Any) -> None:
        """Exchange over a fault-tolerant replica's quorum, inside each step's (:meth:`on_batch`)."""
        self.syncer.meet_over(replica)

    def complete(self, params: Sequence[torch.Tensor], *, stepping: bool = False) -> None:
        """Over a fault-tolerant quorum: the exchange running behind the step is waited for before its commit."""
        self.syncer.wait_in_flight()

    def on_batch(self, models: Sequence[torch.nn.Module], loader: Any) -> None:
        """Over a fault-tolerant quorum: the exchange due, before the forward of the step whose quorum it is in."""
        self.syncer.exchange_due()

    def changes_weights_on_batch(self) -> bool:
        """An exchange is due (over a fault-tolerant quorum), or the period is to be chosen, with an exchange at once."""
        return bool(self.syncer.due) or self.syncer.choice_due()

    def step_dropped(self) -> None:
        """The step was not committed: its quorum's exchange is taken back, and made in the next one."""
        self.syncer.step_dropped()

    def end_training(self) -> None:
        """The final exchange: what every rank trained since its last sync, so the model after the
        loop is the replicas' common one whatever step the run stopped at."""
        self.syncer.finish()

    def state_dict(self) -> dict[str, Any] | None:
        """The sync's state: the last synced weights, the outer optimizer, the step in the period."""
        return self.syncer.state_dict()

    def load_state_dict(self, saved: dict[str, Any], *, same_world: bool, source: str) -> None:
        """The sync's state from a checkpoint (on another world size, or written by one replica of a
        fault-tolerant job: from the synced weights)."""
        self.syncer.load_state_dict(
            saved, same_world=same_world, source=source, one_replicas=self.syncer.meet is not None
        )

    def take_peer_state(self, saved: dict[str, Any], source: str) -> None:
        """A peer's sync state, all of it: its local weights, feedback and where its period stands."""
        self.syncer.load_state_dict(saved, same_world=True, source=source)


class Frozen(Mode):
    """A model with no parameter that requires a gradient (a distillation teacher, a frozen encoder): nothing
    of it is averaged, so nothing wraps it (DDP refuses such a model), and every rank holds rank 0's weights.

    A parameter of it that trains later would keep each rank's own gradient: the step refuses it, on any
    number of processes alike."""

    name = "frozen"
    same_weights = True

    def __init__(self, model: torch.nn.Module) -> None:
        self.names = {id(p): name for name, p in model.named_parameters()}
        """Its parameters' names, by identity."""

    def complete(self, params: Sequence[torch.Tensor], *, stepping: bool = False) -> None:
        """Refuse a step that would apply a gradient to one of its parameters.

        Raises:
            UsageError: a parameter of the model was unfrozen after ``rt.setup`` and has a gradient.
        """
        trained = [self.names[id(p)] for p in params if id(p) in self.names and p.grad is not None]
        if trained:
            raise UsageError(
                f"rt.step: {len(trained)} parameter(s) of a model set up with none that requires a gradient "
                f"now train ({trained[0]}, ...), and ddpkit did not wrap that model, so their gradients would "
                "stay each rank's own; set it up with the parameters that will train unfrozen (freeze others "
                "after rt.setup), or keep it out of the optimizer"
            )


def frozen(model: torch.nn.Module) -> bool:
    """Whether ``model`` has no parameter that requires a gradient (nothing of it trains or is averaged)."""
    return not any(p.requires_grad for p in model.parameters())


class MicroShards(Mode):
    """``micro_shards=M``: the same bits on any power-of-two world size dividing M."""

    name = "micro-shards"
    same_weights = True

    def __init__(self, exact: Any) -> None:
        self.exact = exact
        """The run's :class:`~ddpkit.parallel.exact.Exact`."""

    def accumulating(self, group: tuple[int, bool] | None) -> None:
        """Each shard's gradient adds up over the group's batches; its loss weighs by the group's samples."""
        self.exact.accumulating(group)

    def state_dict(self) -> dict[str, Any] | None:
        """Nothing: a checkpoint falls between steps, where no shard gradient is held.

        Raises:
            UsageError: a save inside an accumulation group, whose shard gradients a checkpoint cannot hold yet.
        """
        if self.exact.cut:
            raise UsageError(
                "rt.checkpoint inside an rt.accumulate group with micro_shards: the shards' gradients so far "
                "are not saved; checkpoint after the rt.step of the group's last batch"
            )
        return None

    def on_batch(self, models: Sequence[torch.nn.Module], loader: Any) -> None:
        """The batch's random stream, the same on every rank (:meth:`~ddpkit.parallel.exact.Exact.key_batch`)."""
        self.exact.key_batch(loader)

    def shards(self, active: Any, step: int, batch: tuple[Any, ...]) -> Iterator[Any] | None:
        """This rank's micro-shards of the batch, each with its threads, random stream and BatchNorm."""
        return self.exact.shards(active, step, batch)

    def also_steps(self, optimizer: torch.optim.Optimizer) -> None:
        """Its parameters' gradients are summed along the tree too."""
        self.exact.others.append(optimizer)

    def refuse(self, call: str) -> None:
        """A collective of the script's (``rt.all_reduce``, ``rt.log``, ...) inside a shard: refused."""
        if call.rpartition(".")[2] in (
            "all_reduce",
            "all_gather",
            "all_gather_object",
            "broadcast_object",
            "barrier",
            "log",
            "should_stop",
        ):
            self.exact.refuse_inside_shard(call)

    def loss_weight(self, weight: Any, *, counted: bool = False) -> Any:
        """The micro-shard's share of the global batch (the tree sums the shards); counted: its units' weight."""
        share = self.exact.weight()  # a micro-shard: its share of the global batch, summed by the tree
        return weight if counted else share

    def sums_gradients(self) -> bool:
        """The fixed tree sums the shards' gradients."""
        return True

    def after_backward(self) -> None:
        """The shard's gradients are kept apart, for the fixed tree."""
        self.exact.after_backward()

    def complete(self, params: Sequence[torch.Tensor], *, stepping: bool = False) -> None:
        """Sum the shards' gradients along the fixed tree, across the ranks, if not done yet (the end of
        the step's ``rt.shards`` loop does it: the script's code after it finds them whole)."""
        if self.exact.cut:  # not yet reduced (by rt.clip_grad_norm_)
            self.exact.reduce()

    def after_step(self) -> None:
        """Let the last shard's own gradients go (:meth:`Exact.after_step`)."""
        self.exact.after_step()

    def step_dropped(self) -> None:
        """The same, for a step that did not commit."""
        self.exact.after_step()

    def close(self, *, finished: bool) -> None:
        """Give the process its own thread count back."""
        self.exact.restore_threads()  # the process's own thread count, for what follows

    @contextlib.contextmanager
    def probing(self) -> Iterator[None]:
        """Passes that change nothing of the run (the bench's timings)."""
        with self.exact.probing():
            yield


def check_combination(
    *,
    micro_shards: int | None,
    options: Any,
    world_size: int,
    model: torch.nn.Module,
    models_set_up: int,
    micro_shards_set_up: bool = False,
) -> None:
    """Refuse, in one line, a combination of modes that cannot hold its guarantees (before any collective).

    Args:
        micro_shards: ``rt.setup``'s ``micro_shards`` (None: not asked).
        options: the other ``rt.setup`` options (:class:`~ddpkit.parallel.options.SetupOptions`).
        world_size: processes of the job.
        model: the model being set up (maybe compiled already).
        models_set_up: models the run set up before this one.
        micro_shards_set_up: one of them trains with micro-shards.

    Raises:
        UsageError: which combination, why, and what to use instead.
    """
    refuse_sparse(model, options, micro_shards)
    if micro_shards is None:
        if micro_shards_set_up:
            raise UsageError(
                "rt.setup: this run set up a model with micro_shards, which is built for one model a run; "
                "train several models (a GAN's two, say) without micro_shards"
            )
        return
    exact_tree.check(
        micro_shards,
        world_size=world_size,
        sync_batchnorm=options.sync_batchnorm,
        grad_compression=options.grad_compression,
        strategy=options.strategy,
        sync=options.sync,
        ddp_kwargs=options.ddp_kwargs,
    )
    if models_set_up:
        raise UsageError(
            "rt.setup(micro_shards=...) is built for one model a run, and this run set one up already; "
            "train several models (a GAN's two, say) without micro_shards"
        )


def trainable(models: Iterable[torch.nn.Module], optimizers: Iterable[Any]) -> list[torch.Tensor]:
    """The parameters that train now, each once, in order: the models', then the optimizers' (a group
    added since set-up, a parameter outside the models), those with ``requires_grad``."""
    params = [p for model in models for p in model.parameters()]
    params += [p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]]
    return [p for p in {id(p): p for p in params}.values() if p.requires_grad]


def sparse_gradient_modules(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s modules that make sparse gradients (``nn.Embedding``/``nn.EmbeddingBag``
    with ``sparse=True``)."""
    return [
        name or type(module).__name__
        for name, module in model.named_modules()
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse
    ]


def refuse_sparse(
    model: torch.nn.Module, options: Any, micro_shards: int | None, *, fault_tolerant: bool = False
) -> None:
    """Refuse, in one line, a mode that cannot take a sparse gradient, for a model that makes one.

    DDP takes them (each in a bucket of its own, :func:`ddpkit.parallel.ddp.sparse_safe_average`); the
    fixed tree of micro-shards, fsdp's shards, the compression hooks and a fault-tolerant replica's flat
    average work on dense tensors.

    Args:
        model: the model being set up.
        options: its other ``rt.setup`` options (:class:`~ddpkit.parallel.options.SetupOptions`).
        micro_shards: ``rt.setup``'s ``micro_shards`` (None: not asked).
        fault_tolerant: set up in a fault-tolerant replica, which averages its gradients itself.

    Raises:
        UsageError: naming the module and the mode.
    """
    sparse = sparse_gradient_modules(model)
    if not sparse:
        return
    if micro_shards is not None:
        what, why = f"micro_shards={micro_shards}", "the fixed tree sums dense gradients"
    elif options.strategy != "ddp":
        what, why = f"strategy={options.strategy!r}", "its shards are cut from dense gradients"
    elif options.grad_compression is not None:
        what, why = f"grad_compression={options.grad_compression!r}", "the hooks compress dense buckets"
    elif fault_tolerant and options.sync == "every-step":
        what, why = "--fault-tolerant", "a replica averages its gradients as one dense tensor"
    else:
        return
    raise UsageError(
        f"{what} does not take sparse gradients ({why}), and the model's {sparse[0]!r} makes them "
        f"(sparse=True): build it with sparse=False, or leave {what} out"
    )


__all__ = [
    "Mode",
    "Frozen",
    "MicroShards",
    "Periodic",
    "ProcessGroup",
    "Replicated",
    "Sharded",
    "check_combination",
    "refuse_sparse",
    "sparse_gradient_modules",
    "trainable",
]
