"""Everything one run carries from step to step, in one typed object: what ``rt`` composes.

Example:
    >>> import torch
    >>> from ddpkit.state.precision import Precision
    >>> run = RunState(Precision("fp32", torch.device("cpu")))
    >>> run.adopt(torch.nn.Linear(2, 2))
    0
    >>> [mode.name for mode in run.modes]
    ['process-group', 'replicated']
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ddpkit.parallel.fsdp import is_sharded
from ddpkit.parallel.modes import MicroShards, Mode, ProcessGroup, Replicated
from ddpkit.state.counted import Counted
from ddpkit.state.loop import LoopState
from ddpkit.state.precision import Precision


@dataclass(eq=False)
class Entry:
    """One set-up model: the model as ``rt.setup`` returned it, its mode, its lazily averaged statistics."""

    model: torch.nn.Module
    """The set-up model (DDP-wrapped, sharded, compiled, or the model itself)."""
    mode: Mode
    """How it trains (:mod:`ddpkit.parallel.modes`): replicated, sharded, periodic or micro-shards."""
    buffers: Any = None
    """Its lazily averaged BatchNorm statistics (:class:`~ddpkit.parallel.lazy_buffers.LazyBuffers`), or None."""


@dataclass(eq=False)
class HeldGradients:
    """The step's gradients that are not final yet, as the last backward left them (:mod:`ddpkit.loop.gradients`)."""

    entries: list[tuple[torch.Tensor, torch.Tensor, int, torch.optim.Optimizer | None]]
    """(parameter, its gradient, the gradient's version counter, the optimizer whose fp16 unscaling is
    all it waits for, else None)."""
    why: str
    """What they still await, for the message (``"fp16's division by its loss scale (65536)"``, ...)."""


@dataclass(eq=False)
class RunState:
    """Everything one run carries from step to step, in one place.

    The loop's position (:class:`~ddpkit.state.loop.LoopState`), the precision (autocast and the
    fp16 scaler), one :class:`Entry` a set-up model, how the processes meet (:attr:`world`), the
    optimizers, and the step in progress. The loop's functions (:mod:`ddpkit.loop.steps`) and the
    checkpoint's (:mod:`ddpkit.checkpoint.resume`) read and change it; nothing else holds training state.
    """

    precision: Precision
    """Autocast, the fp16 scaler and the optimizer step."""
    seed: int | None = None
    """The seed of ``ddpkit.init`` (None: unseeded); keys the data order."""
    loop: LoopState = field(default_factory=LoopState)
    """Epoch, step, loader positions, the open accumulation group."""
    entries: list[Entry] = field(default_factory=list)
    """The set-up models, in set-up order."""
    world: Mode = field(default_factory=ProcessGroup)
    """How this run's processes meet: one process group, or a fault-tolerant replica."""
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    """Every optimizer given to ``rt.setup`` or ``rt.step``."""
    given: list[torch.optim.Optimizer] = field(default_factory=list)
    """The optimizers given to ``rt.setup``, whose parameters a set-up model's mode exchanges."""
    stepped: weakref.WeakSet[torch.optim.Optimizer] = field(default_factory=weakref.WeakSet)
    """The optimizers stepped since the last ``rt.checkpoint`` (or ``rt.save`` into a directory of steps), which the next must hold
    (:func:`ddpkit.checkpoint.resume.refuse_incomplete`); one dropped (Adam, then SGD) is not asked for."""
    saved_compression: tuple[list[Any] | None, bool, str] | None = None
    """From a load (maybe before setup): (this rank's mode states per model, same world, source)."""
    saved_buffers: list[Any] | None = None
    """From a load on the same world size: this rank's saved statistics per model."""
    handed_out: list[weakref.ref[Any]] = field(default_factory=list)
    """The loaders that handed out a batch, the latest last (each once; :attr:`active` reads them)."""
    latest: Any = None
    """The loader that handed out a batch last (held, where the script dropped it)."""
    fed: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    """The loaders that handed out a batch since the last step (``zip(labeled, unlabeled)`` two)."""
    accumulation: tuple[float, bool] | None = None
    """Inside ``rt.accumulate``: (divisor, whether this micro-step is the group's last)."""
    backward_since_step: bool = False
    """A backward ran since the last optimizer step."""
    uses_backward: bool = False
    """The script calls ``rt.backward`` (otherwise every ``rt.step`` counts as a step)."""
    warned_plain_backward: bool = False
    """``rt.step`` said once that a step's gradients came from ``loss.backward()`` on an uneven batch."""
    stepping: bool | torch.optim.Optimizer = False
    """Inside ``rt.step``'s optimizer steps (an ``optimizer.step()`` outside it is the script's own), or
    the script's own optimizer whose step is in progress."""
    forward_since_step: bool = False
    """A set-up model ran forward since the last counted step (a script's own ``optimizer.step()`` after
    ``loss.backward()`` counts once however many optimizers it steps)."""
    parameter_ids: tuple[int, set[int]] = field(default_factory=lambda: (0, set()))
    """(models set up, the ids of their parameters): what a script's own ``optimizer.step()`` is looked up
    in, made again only when another model is set up, not at every step."""
    checked_optimizers: weakref.WeakKeyDictionary[Any, tuple[int, ...]] = field(
        default_factory=weakref.WeakKeyDictionary
    )
    """Optimizers not given to ``rt.setup`` found to hold nothing outside what the run exchanges, by the
    sizes of their groups when checked (a group added since is checked again)."""
    step_hooks: list[Any] = field(default_factory=list)
    """The optimizer step hooks that count a script's own ``optimizer.step()`` (:func:`ddpkit.loop.steps.watch_direct_steps`)."""
    forward_hooks: list[Any] = field(default_factory=list)
    """The set-up models' forward hooks that note :attr:`forward_since_step` (:func:`ddpkit.loop.steps.watch_forwards`)."""
    checked_weights: bool = False
    """``rt.step`` checked at this process's first step that every rank holds the same weights."""
    local_first: bool = False
    """Inside ``rt.local_main_first()``, where ranks run the block one after another."""
    unscaled: set[int] = field(default_factory=set)
    """Optimizers (by id) whose fp16 gradients are unscaled this step."""
    held: HeldGradients | None = None
    """The step's gradients that still owe something at ``rt.step``, checked for the script's changes."""
    finished: str | None = None
    """What made this step's gradients final before ``rt.step`` (``"rt.clip_grad_norm_"``) where that
    changed them: a backward after it is refused."""
    counted: Counted = field(default_factory=Counted)
    """The step's units, where ``rt.backward(loss, count=n)`` weighs losses by them (:mod:`ddpkit.loop.counted`)."""
    preemption: Any = None
    """The run's :class:`~ddpkit.distributed.preemption.Preemption` (None: signals are not caught)."""
    tracking: Any = None
    """On rank 0, the W&B/MLflow runs (:class:`~ddpkit.observe.trackers.Remote`): their ids go into
    checkpoints, and a save sends them the rows it covers."""

    @property
    def active(self) -> Any:
        """The loader whose batch is in hand: the last to hand one out (:attr:`latest`). Where its pass is over
        and an earlier one's is not (a validation pass through ``rt.loader`` at the top of a training batch's
        body), the earlier one; where its pass is over and the forwards since took none of its batches, or it
        fed no training (a validation pass, or a training loop, then batches of the script's own), none."""
        last = self.latest
        if last is None or last.live:
            return last
        live = next(
            (loader for ref in reversed(self.handed_out) if (loader := ref()) is not None and loader.live), None
        )
        if live is not None:
            return live
        if last.reread:  # a forward took a batch of the pass after it (a probe trained again and again)
            return last
        if last.forward_after:  # forwards after the pass, on batches of the script's own
            return None
        return last if last._pass_trained or last.forwarded else None  # (a loss of the pass, backward after it)

    def hand_out(self, loader: Any) -> None:
        """``loader`` handed out a batch: it is the latest (:attr:`active`). Live loaders stay listed, however many."""
        if self.latest is loader:
            return
        self.latest = loader  # (held: a probe of a loader built inline, next(iter(rt.loader(...))), keeps it)
        kept = [ref for ref in self.handed_out if (held := ref()) is not None and held is not loader]
        over = [ref for ref in kept if not ref().live]
        drop = set(map(id, over[: max(0, len(kept) - 7)]))  # the oldest passes that are over, beyond 7
        self.handed_out = [ref for ref in kept if id(ref) not in drop] + [weakref.ref(loader)]

    @property
    def models(self) -> list[torch.nn.Module]:
        """The set-up models, in set-up order."""
        return [entry.model for entry in self.entries]

    @property
    def buffers(self) -> list[Any]:
        """Per model: its lazily averaged BatchNorm statistics, or None."""
        return [entry.buffers for entry in self.entries]

    @property
    def micro_shards(self) -> bool:
        """Whether a model of the run trains with ``micro_shards`` (:class:`~ddpkit.parallel.modes.MicroShards`)."""
        return any(isinstance(entry.mode, MicroShards) for entry in self.entries)

    @property
    def local_micro_shards(self) -> int:
        """The micro-shards this process computes of a batch (``micro_shards`` over the processes); 0 without them."""
        for entry in self.entries:
            if isinstance(entry.mode, MicroShards):
                return int(entry.mode.exact.local_shards)
        return 0

    @property
    def modes(self) -> list[Mode]:
        """Every mode of the run: how its processes meet, then each model's, each once."""
        found: list[Mode] = [self.world]
        for entry in self.entries:
            if not any(entry.mode is mode for mode in found):
                found.append(entry.mode)
        return found

    def adopt(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        mode: Mode | None = None,
        buffers: Any = None,
        not_bitwise: str | None = None,
    ) -> int:
        """Track a set-up model (and its optimizer) for steps and checkpoints; returns its index.

        Args:
            model: the set-up model (DDP-wrapped, sharded, compiled, or the model itself).
            optimizer: its optimizer (None: none given); kept once however many models share it.
            mode: how it trains (None: replicated, with no compression).
            buffers: its lazily averaged BatchNorm statistics, or None.
            not_bitwise: why a resume of this run would not be bitwise (None: it would); the first reason kept.
        """
        self.entries.append(Entry(model, mode if mode is not None else Replicated(), buffers))
        self.loop.not_bitwise = self.loop.not_bitwise or not_bitwise
        if optimizer is not None:
            self.adopt_optimizer(optimizer)
        return len(self.entries) - 1

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer given to ``rt.setup``: stepped by the run, its parameters the set-up model's mode's."""
        if optimizer not in self.optimizers:
            self.optimizers.append(optimizer)
        if optimizer not in self.given:
            self.given.append(optimizer)

    def sharded(self) -> bool:
        """Whether any set-up model is sharded (``strategy="fsdp"``: checkpoints are DCP directories)."""
        return any(is_sharded(model) for model in self.models)


__all__ = ["Entry", "RunState"]
