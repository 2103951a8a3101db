"""One training step as functions of the run's state: backward, step, clip, accumulate, epochs.

What ``rt.backward``, ``rt.step``, ``rt.clip_grad_norm_``, ``rt.accumulate``, ``rt.epochs`` and
``rt.should_stop`` do, on a :class:`~ddpkit.state.run.RunState`. They send the watchdog their
heartbeats through :func:`ddpkit.observe.heartbeats.beat`, so nothing here knows the runtime.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import torch

from ddpkit.checkpoint import background
from ddpkit.distributed import collectives
from ddpkit.errors import UsageError, warn
from ddpkit.loop import counted, gradients
from ddpkit.observe.heartbeats import beat
from ddpkit.parallel import same_model
from ddpkit.parallel.modes import Mode
from ddpkit.state.run import RunState


def on_batch(run: RunState, loader: Any) -> None:
    """A loader handed out a batch: it is the one ``backward`` weighs, and the step made progress."""
    run.hand_out(loader)
    run.fed.add(loader)
    batch = loader.whole_batch  # its tensors, as a forward or rt.shards may take them (again: list(loader))
    plain = type(batch) in (tuple, list) and all(type(t) is torch.Tensor for t in batch)  # (no generator then)
    loader.handed.update((id(t), weakref.ref(t)) for t in (batch if plain else _tensors_in(batch)))
    if not isinstance(run.stepping, bool):  # a script's own optimizer.step() that raised, long over
        run.stepping = False
    if any(mode.changes_weights_on_batch() for mode in run.modes):
        background.WRITER.copied()  # a save may still be copying the weights the exchange changes
    for mode in run.modes:
        mode.on_batch(run.models, loader)
    beat("data")  # a batch is in hand; the forward follows


def epochs(run: RunState, n: int, start: int = 0) -> Iterator[int]:
    """``n`` epochs numbered from ``start``, from where a loaded checkpoint left off; sets every loader's epoch.

    Each ``rt.epochs`` loop of a script is a stage of its own (a warm-up's 2 epochs, then a
    fine-tuning's 3): it runs its ``n`` epochs, numbered from ``start`` again, while the run's epoch
    (the loaders' shuffles, ``rt.epoch``) goes on counting, after an epoch a ``break`` left too. A run
    resumed inside a later stage skips the loops before it. A run resumed from a checkpoint written
    after its last epoch has no epoch left: it says so in one line, since code after the loop runs
    without the loop's variables."""
    loop = run.loop
    loop.driven = True  # the loaders' passes read the epochs set here, not their own
    for mode in run.modes:
        mode.begin_epochs()  # (a fault-tolerant replica heals or resumes here, in its first quorum)
    index, loop.stages_called = loop.stages_called, loop.stages_called + 1
    if index < loop.stage or (index == loop.stage and loop.stage_left):
        return  # a loop the resumed run had run or left (break) before its checkpoint
    if index > loop.stage:  # the script's next loop: its epochs begin after the last one handed out
        if loop.epoch_begun:
            loop.epoch += 1
        loop.stage, loop.stage_start, loop.epoch_begun, loop.stage_left = index, loop.epoch, False, False
    if loop.epoch - loop.stage_start >= n and loop.resumed_from is not None and index == 0:
        warn(  # (a later loop's script goes on to it: nothing to say)
            f"rt.epochs({n}): the run resumed from {loop.resumed_from} had trained all {n} epochs of this loop, so "
            "it does not run; code after it must not use the loop's variables (or give a larger n)"
        )
    try:
        while loop.epoch - loop.stage_start < n:
            loop.set_epochs()  # (no loader is held here across the yield: one built anew each epoch is freed)
            loop.epoch_begun = True
            yield loop.epoch - loop.stage_start + start
            loop.epoch += 1
            loop.epoch_begun = False
    finally:
        loop.stage_left = True  # ran to its end, or left by break
    end_training(run)  # ran to its end (not left by break): the training is over


def end_training(run: RunState) -> None:
    """The last optimizer step is taken: every mode brings the processes to their common model
    (DiLoCo and local SGD exchange what they trained since their last sync; the others have nothing to do)."""
    background.WRITER.copied()  # a save just before may still be copying the weights the exchange changes
    for mode in run.modes:
        mode.end_training()


def shards(run: RunState, batch: tuple[Any, ...]) -> Iterator[Any]:
    """The micro-shards of the batch in hand (``rt.shards``): from the run's mode that cuts batches."""
    if not batch:
        raise UsageError("rt.shards needs the batch to cut, e.g. rt.shards(inputs, targets)")
    _refuse_kept_batch(run, "rt.shards", batch)
    cut = next((c for mode in run.modes if (c := mode.shards(run.active, run.loop.step, batch)) is not None), None)
    if cut is None:
        raise UsageError("rt.shards needs rt.setup(model, optimizer, micro_shards=M)")
    if not run.backward_since_step:
        _begin_step(run)
    run.backward_since_step = run.uses_backward = True  # a rank with empty shards steps too
    return _then_whole(run, cut)


def _then_whole(run: RunState, cut: Iterator[Any]) -> Iterator[Any]:
    """The shards, then (after the step's last, outside an accumulation group's earlier batches) their
    gradients summed along the tree: the script's code before ``rt.step`` (torch's own
    ``clip_grad_norm_``, a logged norm) finds them whole, as after a plain backward."""
    yield from cut
    if run.accumulation is None or run.accumulation[1]:
        params = gradients.trained(run, run.optimizers)
        for mode in run.modes:
            mode.complete(params)
        gradients.hold(run)


def _begin_step(run: RunState) -> None:
    """The first backward (or cut of micro-shards) since the last step: fp16's unscaling is owed again,
    and the step's units are counted anew."""
    run.unscaled.clear()
    run.finished = None
    run.counted.new_step()


def _tensors_in(values: Any, depth: int = 2) -> Iterator[torch.Tensor]:
    """The tensors of a batch or a call's arguments, ``depth`` containers deep (a tuple, a dict, a tokenizer's
    ``BatchEncoding``), as a script hands them to a forward or ``rt.shards``."""
    if isinstance(values, torch.Tensor):
        yield values
    elif depth and isinstance(values, Mapping):
        for value in values.values():
            yield from _tensors_in(value, depth - 1)
    elif depth and isinstance(values, (tuple, list)):
        for value in values:
            yield from _tensors_in(value, depth - 1)


def _handed(loader: Any, tensor: torch.Tensor) -> bool:
    """Whether ``loader`` handed ``tensor`` out in its current pass (not another tensor at the same address)."""
    ref = loader.handed.get(id(tensor))
    return ref is not None and ref() is tensor


def _in_hand(loader: Any) -> set[int]:
    """The ids of the tensors of the batch ``loader`` handed out last (which it holds, so no other has them)."""
    return {id(t) for t in _tensors_in(loader.whole_batch)}


def _handed_before(loader: Any, values: Any) -> bool:
    """Whether ``values`` hold a tensor of a batch ``loader`` handed out in its pass before the one in hand."""
    in_hand = _in_hand(loader)
    return any(_handed(loader, t) and id(t) not in in_hand for t in _tensors_in(values))


def _refuse_kept_batch(run: RunState, call: str, batch: tuple[Any, ...] | None = None) -> None:
    """Refuse training on a batch that is not the one the loader handed out last, which the weighing, the
    micro-shards and a saved position stand for: ``rt.shards`` given an earlier batch of the pass, or a
    backward whose forward took a tensor of the pass after it ran out. A backward after the loop of a loss
    its forwards made during the pass goes on, and so does training on batches of the script's own."""
    last = run.latest
    if last is None:
        return
    if batch is not None:
        if not _handed_before(last, batch):
            if not last.live and not _in_hand(last).isdisjoint(map(id, _tensors_in(batch))):
                last.reread = True  # the pass's batch cut after the pass (a probe: next(iter(loader)))
            return
    elif run.active is not last or last.live or not (last.ran_out and last.reread):
        return  # (another loader's batch in hand: a validation pass ran out at the top of a batch's body)
    head = (
        f"this batch is one loader {last.name!r} handed out before the batch in hand"
        if batch is not None
        else f"this backward's forward ran after loader {last.name!r} ran out, on a batch kept from its pass"
    )
    raise UsageError(
        f"{call}: {head}: a loop that reads ahead (a prefetcher such as timm's "
        "PrefetchLoader) weighs each batch by the next one's samples per rank and saves a position past the "
        "batch it trains, and itertools.cycle(loader) or list(loader) replays a pass, never shuffled anew, in "
        "which a resumed run cannot find its place; iterate the loader itself each pass (`for batch in loader:`, "
        "inside `while True:` for an endless loop), which already moves batches to the device"
    )


def _mark_fed(run: RunState) -> None:
    """The loaders that fed this step are training's (their positions are saved, their next pass moves
    on): the one whose batch is in hand, and any other whose pass handed out a batch since the last step
    and is not over (``zip(labeled, unlabeled)``; a validation pass left by ``break`` is over)."""
    for loader in [loader for loader in run.fed if loader.live and loader is not run.active]:
        loader.mark_trained()
    if run.active is not None:
        run.active.mark_trained()


def backward(run: RunState, loss: torch.Tensor, count: Any = None) -> None:
    """Backward of the mean loss of this rank's batch, weighted by its true sample count (``count``:
    by its units, which the step divides by every rank's: :mod:`ddpkit.loop.counted`)."""
    beat("backward")
    weight: Any = 1.0
    _refuse_kept_batch(run, "rt.backward")
    active = run.active
    _mark_fed(run)
    run.loop.check_pending()
    if not run.backward_since_step:
        _begin_step(run)
    gradients.refuse_after_finish(run)
    gradients.check(run, "rt.backward")
    run.counted.check(count is not None)
    if count is not None:
        for mode in run.modes:
            mode.refuse(counted.CALL)
        loss, weight = counted.weigh(run.counted, loss, count, run.modes)
    else:
        if active is not None and active.missing:
            raise UsageError(
                f"rt.backward: {active.missing} of this rank's {active.local_count} samples came as None and the "
                f"collate_fn left them out, so weighing its mean loss as {active.local_count} of the batch's "
                f"{active.global_count} samples would count samples it does not hold, and 1 and 2 processes would "
                "train apart; weigh it by the samples it holds: rt.backward(loss, count=len(y))"
            )
        if active is not None and active.global_count:
            weight = active.batch_weight()
            if run.accumulation is not None:  # a share of the group's samples, not the batch's
                weight *= active.global_count / active.sampler.global_batch_size
            if active.local_count == 0:
                loss = torch.nan_to_num(loss, nan=0.0)  # mean of nothing; contributes zero
        if run.accumulation is not None:
            weight /= run.accumulation[0]
    for mode in run.modes:
        weight = mode.loss_weight(weight, counted=count is not None)
    run.backward_since_step = run.uses_backward = True
    plain = isinstance(weight, float) and weight == 1.0
    run.precision.backward(loss if plain else loss * weight)
    for mode in run.modes:
        mode.after_backward()
    gradients.hold(run)


def step(run: RunState, optimizers: tuple[torch.optim.Optimizer, ...]) -> bool:
    """Step each optimizer (through the fp16 scaler) and zero its gradients; True when all updated."""
    if not optimizers:
        raise UsageError("rt.step needs the optimizer(s) to step")
    for optimizer in optimizers:
        if not (hasattr(optimizer, "step") and hasattr(optimizer, "param_groups")):  # (a wrapper that steps is one)
            closure = (
                " (an optimizer that takes a closure, such as LBFGS, steps as optimizer.step(closure) with rt.backward inside the closure)"
                if callable(optimizer)
                else ""
            )
            raise UsageError(f"rt.step takes optimizers only, got {type(optimizer).__name__}{closure}")
    if run.accumulation is not None and not run.accumulation[1]:
        return False
    beat("optimizer")
    _rebind(run, optimizers)
    for optimizer in optimizers:
        _refuse_unexchanged(run, optimizer, "rt.step")
    gradients.check(run, "rt.step", optimizers)
    params = _before_optimizers(run, optimizers)
    if not all(mode.commit(params, run.active) for mode in run.modes):
        for mode in run.modes:
            mode.step_dropped()
        run.backward_since_step = False
        return False
    stepped = True
    run.stepping = True  # the optimizers' own steps below are this one (watch_direct_steps)
    try:
        for optimizer in optimizers:
            if optimizer not in run.optimizers:
                run.optimizers.append(optimizer)
            run.stepped.add(optimizer)
            stepped = run.precision.step(optimizer) and stepped
    finally:
        run.stepping = False
    _after_optimizers(run)
    return stepped


def _before_optimizers(run: RunState, optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """What a step does before its optimizers step: the weights checked equal at the first, a save's copy
    of them waited for, the gradients made whole and divided by the step's units; the trained parameters."""
    if not run.checked_weights:
        run.checked_weights = True
        _same_weights(run)
    background.WRITER.copied()  # the modes below may change weights before the optimizers' own wait
    params = gradients.trained(run, optimizers)
    for mode in run.modes:
        mode.complete(params, stepping=True)
    counted.scale(run.counted, params)
    if not run.backward_since_step and run.active is not None and not run.warned_plain_backward:
        _plain_backward(run)  # (before the optimizers, which zero the gradients it looks at)
    return params


def _after_optimizers(run: RunState, *, direct: bool = False) -> None:
    """What a step does once its optimizers stepped: the loaders that fed it marked as training's (their
    positions are saved), the step counted, the modes told, a preemption agreed on.

    ``direct``: the script's own ``optimizer.step()``, counted after ``rt.backward`` or, in a loop of
    plain backwards, after a forward of a set-up model: two optimizers stepped after one backward (a
    GAN's after each its own) are one step (two), as ``rt.step(a, b)`` is."""
    _mark_fed(run)  # also through a plain loss.backward()
    run.fed.clear()
    plain = not run.uses_backward and (run.forward_since_step or not direct)
    if run.backward_since_step or plain:
        run.loop.step += 1
        run.backward_since_step = run.forward_since_step = False
        for mode in run.modes:  # an infrequent sync counts the step, and meets every H
            mode.after_step()
        _agree_on_preemption(run)
    if not run.uses_backward:
        run.precision.flush()  # no rt.backward will come to apply the scaler update


def watch_direct_steps(run: RunState) -> None:
    """Make an ``optimizer.step()`` the script calls itself (``scaler.step(optimizer)`` of a hand-kept
    GradScaler too) a step of the run, where it steps a set-up model's parameters outside ``rt.step``.

    Without it such a loop trained, but its steps were not counted (``rt.global_step`` stayed 0, every
    checkpoint took the name of step 0) and no loader was marked as training's, so a checkpoint kept
    no position and a resumed run read its epoch again from the start, silently. Now the step does what
    ``rt.step`` does around the optimizer's own; where that cannot hold (fp16's scaler, inside
    ``rt.accumulate``, a fault-tolerant replica's commit) it is refused in one line. Hooks on every
    optimizer of the process (torch's global ones), from the first ``rt.setup`` until ``rt.close``.
    """
    if run.step_hooks:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    run.step_hooks = [
        register_optimizer_step_pre_hook(functools.partial(_direct_before, run)),
        register_optimizer_step_post_hook(functools.partial(_direct_after, run)),
    ]


def watch_forwards(run: RunState, model: torch.nn.Module) -> None:
    """Note each forward of the set-up ``model`` (:attr:`RunState.forward_since_step`), until ``rt.close``."""

    def forward(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        run.forward_since_step = True
        last = run.latest
        if last is None or not torch.is_grad_enabled():  # (a look under no_grad feeds nothing)
            return
        if last.live:
            last.forwarded = True
        else:  # after the pass: a batch kept from it (list(loader)), or the last one, looked at again
            last.forward_after = True
            if any(_handed(last, t) for t in _tensors_in((args, kwargs), 3)):
                last.reread = True

    run.forward_hooks.append(model.register_forward_pre_hook(forward, with_kwargs=True))


def _direct(run: RunState, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps outside ``rt.step`` and holds a parameter of a set-up model."""
    if run.stepping is optimizer:  # its last step raised before it ended (a closure that raised): over
        run.stepping = False
    if run.stepping:
        return False
    _rebind(run, [optimizer])
    mine = _model_parameter_ids(run)
    if not any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
        return False
    _refuse_unexchanged(run, optimizer, "optimizer.step()")
    return True


def rebind_state(run: RunState, state: Any) -> None:
    """Point the optimizers of a mapping being saved or loaded at what a mode replaced at ``rt.setup``
    (fsdp's sharded parameters, :meth:`~ddpkit.parallel.modes.Sharded.rebind`): one not given to
    ``rt.setup`` is rebound at its first step, so a resumed run, before it, would load it into the
    parameters the model no longer holds (its state lost, silently)."""
    if isinstance(state, Mapping):
        _rebind(run, [value for value in state.values() if isinstance(value, torch.optim.Optimizer)])


def _rebind(run: RunState, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Let every mode point ``optimizers`` at the parameters it replaced (:meth:`Mode.rebind`)."""
    for optimizer in optimizers:
        for mode in run.modes:
            mode.rebind(optimizer)


def _model_parameter_ids(run: RunState) -> set[int]:
    """The ids of the set-up models' parameters (made again only when another model was set up)."""
    if run.parameter_ids[0] != len(run.entries):  # a model set up since: its parameters join (once, not a step)
        run.parameter_ids = (len(run.entries), {id(p) for model in run.models for p in model.parameters()})
    return run.parameter_ids[1]


def _refuse_unexchanged(run: RunState, optimizer: torch.optim.Optimizer, call: str) -> None:
    """Refuse, on any number of processes, a step of an optimizer not given to ``rt.setup`` that holds a
    parameter outside the set-up models and their optimizers (a learned temperature in an optimizer of its
    own): no mode exchanges its gradient, so each rank stepped on its own and the ranks parted, silently
    (and micro-shards' bits with them). Checked once an optimizer, again when it gains a parameter.

    Raises:
        UsageError: naming the parameters' shapes and the fix.
    """
    if not run.entries or optimizer in run.given or any(mode.exchanges_every_stepped() for mode in run.modes):
        return
    sizes = tuple(len(group["params"]) for group in optimizer.param_groups)
    if run.checked_optimizers.get(optimizer) == sizes:
        return
    known = _model_parameter_ids(run) | {id(p) for o in run.given for group in o.param_groups for p in group["params"]}
    outside = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad and id(p) not in known]
    if outside:
        shapes = ", ".join(str(list(p.shape)) for p in outside[:3]) + (", ..." if len(outside) > 3 else "")
        raise UsageError(
            f"{call}: an optimizer not given to rt.setup holds {len(outside)} parameter(s) outside the set-up "
            f"models (of shapes {shapes}), whose gradients no process exchanges, so each rank would step on its "
            "own and the ranks would part; give it to rt.setup with the model: rt.setup(model, optimizer, "
            "this_optimizer)"
        )
    run.checked_optimizers[optimizer] = sizes


def _direct_before(run: RunState, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _direct(run, optimizer):
        return
    instead = "call rt.step(optimizer) instead of optimizer.step()"
    if run.accumulation is not None:
        raise UsageError(
            f"optimizer.step() inside rt.accumulate: the group steps at its last micro-step only; {instead}"
        )
    if run.precision.scaler is not None:
        raise UsageError(
            "optimizer.step() under precision='fp16' steps on gradients that ddpkit's GradScaler scaled, "
            f"skipping its unscaling and its check for inf; {instead}"
        )
    for mode in run.modes:
        mode.refuse("optimizer.step()")
    beat("optimizer")
    _before_optimizers(run, [optimizer])
    if optimizer not in run.optimizers:
        run.optimizers.append(optimizer)
    run.stepped.add(optimizer)
    run.stepping = optimizer  # an optimizer it steps inside (ZeroRedundancyOptimizer's local one) is this step


def _direct_after(run: RunState, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if run.stepping is optimizer:
        run.stepping = False
        _after_optimizers(run, direct=True)


def unwatch_direct_steps(run: RunState) -> None:
    """Remove :func:`watch_direct_steps`' and :func:`watch_forwards`' hooks (``rt.close``)."""
    for handle in run.step_hooks + run.forward_hooks:
        handle.remove()
    run.step_hooks, run.forward_hooks = [], []


def _same_weights(run: RunState) -> None:
    """Refuse, on every rank, a first step whose set-up models' weights differ between ranks (a
    checkpoint loaded on rank 0 alone after ``rt.setup``): each rank would train its own from here on."""
    if not run.world.same_weights:
        return
    for entry in run.entries:
        if not entry.mode.same_weights:
            continue
        where = same_model.differs(entry.model, buffers=False)  # BatchNorm statistics are each rank's
        if where is not None:
            raise UsageError(
                f"rt.step: the model's weights differ between ranks at the first step ({where}), so each rank "
                "would train its own from here on: load weights before rt.setup (which starts every rank from "
                "rank 0's) or on every rank (rt.resume does), not on rank 0 alone"
            )


def _plain_backward(run: RunState) -> None:
    """Warn once (rank 0) when this step's gradients came from ``loss.backward()`` on a batch that
    ``rt.backward`` would have weighted: an uneven split of the global batch (its last, say)."""
    active = run.active
    if not getattr(active, "global_count", 0) or collectives.rank() != 0:
        return
    weight = active.batch_weight()
    if weight == 1.0 or not any(p.grad is not None for model in run.models for p in model.parameters()):
        return
    run.warned_plain_backward = True
    warn(
        f"rt.step: this step's gradients came from loss.backward(), not rt.backward(loss); this rank holds "
        f"{active.local_count} of the batch's {active.global_count} samples, so its mean loss counts {weight:.3g} "
        "times its share and the result depends on the number of processes: call rt.backward(loss)"
    )


PREEMPTION_CHECK_S = 1.0
"""About how often (seconds of training) the ranks ask one another whether one got a preemption signal."""


def _agree_on_preemption(run: RunState) -> None:
    """At a step boundary about once a second, every rank learns whether any rank got a preemption signal.

    One small all-reduce at the step boundaries that rank 0 schedules: the answer carries when to
    ask next (about :data:`PREEMPTION_CHECK_S` of rank 0's steps later), so every rank asks at the
    same steps and gets the same answer, and a fast step never pays for the question.
    """
    watch = run.preemption
    if watch is None or watch.agreed:
        return
    watch.armed = True  # from the first step on, a signal waits for a step boundary
    if collectives.world_size() == 1:  # nobody to ask: the next step boundary
        watch.agreed = watch.received is not None
        return
    step = run.loop.step
    if step < watch.next_check:
        return
    now = time.monotonic()
    every = 1
    if watch.checked_at is not None and step > watch.checked_step:
        seconds_a_step = max(1e-6, (now - watch.checked_at) / (step - watch.checked_step))
        every = max(1, min(1000, int(PREEMPTION_CHECK_S / seconds_a_step)))
    agreed, every = collectives.any_rank(watch.received is not None, every)
    watch.checked_at, watch.checked_step, watch.next_check = now, step, step + max(1, every)
    if agreed:
        watch.agreed = True
        if watch.received is None:
            watch.received = -1  # another rank's signal


def clip_grad_norm_(
    run: RunState, model: torch.nn.Module, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor | None:
    """Clip ``model``'s gradients (unscaled first under fp16); None on a micro-step that does not sync.

    Args:
        run: the run's state (its precision, optimizers and accumulation group).
        model: the model whose gradients are clipped; under fp16 its optimizer must be known to ``run``.
        max_norm: the largest total norm the gradients keep.
        norm_type: the order of the norm (``float("inf")``: the largest absolute value).

    Returns:
        The total norm of the gradients before clipping, as ``torch.nn.utils.clip_grad_norm_``.
    """
    if run.accumulation is not None and not run.accumulation[1]:
        return None
    owners: list[torch.optim.Optimizer] = []
    if run.precision.scaler is not None:  # unscale the clipped model's optimizers (not another model's)
        mine = {id(p) for p in model.parameters() if p.requires_grad}
        owners = [
            opt for opt in run.optimizers if any(id(p) in mine for group in opt.param_groups for p in group["params"])
        ]
        if not owners:
            raise UsageError(
                "rt.clip_grad_norm_ under fp16 must unscale the gradients first: "
                "pass the optimizer to rt.setup(model, optimizer)"
            )
    gradients.finish(run, "rt.clip_grad_norm_", owners)  # the shards' sum, the units, fp16's unscaling
    params = [p for p in model.parameters() if p.grad is not None]
    if any(p.grad is not None and p.grad.is_sparse for p in params):
        return _clip_with_sparse(params, max_norm, norm_type)
    if params and float(norm_type) > 0 and all(_sharded_on_dim_0(p.grad) for p in params):
        return _clip_sharded(params, max_norm, float(norm_type))
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)


def _sharded_on_dim_0(grad: Any) -> bool:
    """Whether ``grad`` is fsdp's: a DTensor sharded along its first dimension over the whole world."""
    if type(grad) is torch.Tensor:  # (DDP's, one process's: torch.distributed.tensor not imported)
        return False
    from torch.distributed.tensor import DTensor, Shard

    return (
        isinstance(grad, DTensor)
        and grad.device_mesh.ndim == 1
        and grad.device_mesh.size() == collectives.world_size()
        and list(grad.placements) == [Shard(0)]
    )


@torch.no_grad()
def _clip_sharded(params: Sequence[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
    """``clip_grad_norm_`` for fsdp's gradient shards: each rank's sum of powers (its maximum, for the inf
    norm) reduced through :func:`ddpkit.distributed.collectives.all_reduce`.

    torch's own reduces the DTensors' partial norms over their mesh's group: under ``cpu_offload`` the
    shards lie on the host while the mesh is CUDA's, and NCCL refuses host tensors ("No backend type
    associated with device type cpu", pytorch#148532); ddpkit's collective sends them through the GPU.
    The total comes back as a plain tensor, the same on every rank (torch's is a replicated DTensor).
    """
    local = [cast(Any, p.grad).to_local() for p in params if p.grad is not None]  # (DTensors: the shards themselves)
    where = local[0].device
    if norm_type == float("inf"):
        mine = torch.stack([g.abs().max() if g.numel() else g.new_zeros(()) for g in local]).max()
        total = collectives.all_reduce(mine.to(where, torch.float64), "max")
    else:
        powers = torch.stack([torch.linalg.vector_norm(g, norm_type).double() ** norm_type for g in local]).sum()
        total = collectives.all_reduce(powers.to(where), "sum") ** (1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in local:  # in float32, as torch's: a small coefficient would round to 0 in fp16
        grad.mul_(coefficient.to(grad.device, torch.float32))
    return total.to(functools.reduce(torch.promote_types, [g.dtype for g in local]))


def _clip_with_sparse(params: Sequence[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` where some gradients are sparse (``nn.Embedding(sparse=True)``),
    which torch's own does not take: a sparse gradient's norm is its coalesced values' (repeated rows summed)."""
    grads = []
    for p in params:
        grad = p.grad
        assert grad is not None
        if grad.is_sparse:
            grad = p.grad = grad.coalesce()
        grads.append(grad)
    norms = [torch.linalg.vector_norm(g.values() if g.is_sparse else g, norm_type) for g in grads]
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.device))
    return total


def unscale_gradients(run: RunState, optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
    """Make the step's gradients final for the script's own code (:func:`ddpkit.loop.gradients.finish`);
    nothing on a micro-step of ``rt.accumulate`` that does not sync."""
    if run.accumulation is not None and not run.accumulation[1]:
        return
    if run.precision.scaler is not None and not optimizers and not run.optimizers:
        raise UsageError(
            "rt.unscale_gradients() under fp16 unscales the optimizers' gradients: pass the optimizer to "
            "rt.setup(model, optimizer), or to rt.unscale_gradients(optimizer)"
        )
    _rebind(run, optimizers)  # (fsdp: one not given to rt.setup, before its first step)
    gradients.finish(run, "rt.unscale_gradients", optimizers)


def should_stop(flag: bool, world_size: int) -> bool:
    """True on every rank when any rank passes True (one small all-reduce; every rank must call it)."""
    if world_size == 1:
        return bool(flag)
    return bool(collectives.all_reduce(1.0 if flag else 0.0, "max") > 0)


@contextlib.contextmanager
def accumulate(run: RunState, model: torch.nn.Module, steps: int) -> Iterator[bool]:
    """One micro-step of a group of ``steps``: gradients sync only on the last, which it yields True."""
    if steps < 1:
        raise UsageError(f"accumulate needs steps >= 1, got {steps}")
    for mode in run.modes:
        mode.refuse("rt.accumulate")
    loop = run.loop
    if loop.micro_step == 0:
        loop.group = group_weight(run.active, steps)
    loop.micro_step += 1
    group_batches, divisor = loop.group
    last = loop.micro_step >= group_batches
    if last:
        loop.micro_step = 0
    run.accumulation = (divisor, last)
    mode = next((entry.mode for entry in run.entries if entry.model is model), Mode())
    sampler = getattr(run.active, "sampler", None)
    samples = round(divisor * sampler.global_batch_size) if sampler is not None else None
    for each in run.modes:  # micro-shards weigh each shard by the group's samples
        each.accumulating(None if samples is None else (samples, last))
    sync_off = mode.no_sync(model) if not last else contextlib.nullcontext()
    try:
        with sync_off:
            yield last
    finally:
        run.accumulation = None
        for each in run.modes:
            each.accumulating(None)


def group_weight(loader: Any, steps: int) -> tuple[int, float]:
    """(batches, divisor) of the accumulation group starting with ``loader``'s batch in hand.

    A group never runs past the end of a pass over the data: a pass of 10 batches with
    ``steps=4`` steps after 4, 8 and 10. The divisor counts full global batches, so a short
    group (or one ending in a short batch) is the exact mean over the samples it saw.
    """
    if loader is not None and not getattr(loader, "length_known", True):
        raise UsageError(
            "rt.accumulate over a plain stream: its length is unknown, so the last "
            "group's size cannot be known; use ddpkit.Shards (lengths known) or step every batch"
        )
    if loader is None or not len(loader):
        return steps, float(steps)
    first = loader.position - 1  # index of the batch just handed out
    batches = max(1, min(steps, len(loader) - first))
    full = loader.sampler.global_batch_size
    seen = sum(loader.sampler.global_count(first + i) for i in range(batches))
    return batches, seen / full if seen else float(batches)
