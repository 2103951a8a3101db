"""The step's gradients between ``rt.backward`` and ``rt.step``: made final for the script's own code,
and held against a change the script makes before they are.

After ``loss.backward()`` in a plain DDP step the gradients are the step's mean, and a script may
clip, read or change them before ``optimizer.step()``. Some of ddpkit's modes finish them later, at
``rt.step``: fp16 divides them by its loss scale, ``rt.backward(loss, count=n)`` by every rank's
units, and a fault-tolerant replica averages them over the step's quorum. A script that kept
``torch.nn.utils.clip_grad_norm_`` from its plain-PyTorch days would clip what is not the gradient
yet: 65536 times too large under fp16 (every step clipped), each replica's own under
``--fault-tolerant``. So:

- :func:`finish` (``rt.unscale_gradients``, and ``rt.clip_grad_norm_`` before it clips) makes them
  final now;
- :func:`hold`, after each backward, notes those that still owe something, with their version
  counters (nothing in a plain fp32 step, where none does);
- :func:`check`, at the next backward, ``rt.step``, ``rt.clip_grad_norm_`` and
  ``rt.unscale_gradients``, refuses in one line a change the script made to them meanwhile.

Micro-shards sum their shards' gradients at the end of the step's ``rt.shards`` loop
(:func:`ddpkit.loop.steps.shards`), so the script's code after it finds them whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ddpkit import _torch
from ddpkit.errors import UsageError
from ddpkit.loop import counted
from ddpkit.parallel import modes
from ddpkit.state.run import HeldGradients, RunState

UNSCALE = "rt.unscale_gradients()"
"""What a script calls to change the gradients itself before ``rt.step``."""

FP16 = "fp16's division by its loss scale"
"""What fp16 still does to the gradients at the step (the message adds the scale)."""


def trained(run: RunState, optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The step's trainable parameters, each once, in order: the models' and the optimizers'."""
    return modes.trainable(run.models, optimizers)


def _known(run: RunState, optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    return list({id(o): o for o in (*run.optimizers, *optimizers)}.values())


def _unscaled(run: RunState, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s fp16 gradients are unscaled this step (by ddpkit, or the script's
    ``rt.precision.unscale_``/``rt.precision.scaler.unscale_``)."""
    scaler = run.precision.scaler
    return id(optimizer) in run.unscaled or (scaler is not None and _torch.scaler_unscaled(scaler, optimizer))


def _owing(run: RunState, optimizers: Sequence[torch.optim.Optimizer]) -> HeldGradients | None:
    """The gradients that are not final yet, and what they owe; None where every one is."""
    scaler = run.precision.scaler
    counting = bool(run.counted.counting)
    modes = [why for mode in run.modes if (why := mode.finishes_at_step()) is not None]
    if scaler is None and not counting and not modes:
        return None  # a plain step: final after its backward
    known = _known(run, optimizers)
    owner = {id(p): opt for opt in known for group in opt.param_groups for p in group["params"]}
    unscaled = {id(opt) for opt in known if _unscaled(run, opt)} if scaler is not None else set()
    entries: list[tuple[torch.Tensor, torch.Tensor, int, torch.optim.Optimizer | None]] = []
    reasons: dict[str, None] = {}
    for p in trained(run, known):
        grad = p.grad
        if grad is None:
            continue
        owes = list(modes)
        if counting and id(p) not in run.counted.scaled:
            owes.append("the division by every rank's units (rt.backward(count=...))")
        only_fp16: torch.optim.Optimizer | None = None
        if scaler is not None:
            opt = owner.get(id(p))
            if opt is None or id(opt) not in unscaled:
                if not owes:
                    only_fp16 = opt
                owes.append(FP16)  # (its scale is read for a message only: on a GPU, a wait for the device)
        if owes:
            reasons.update(dict.fromkeys(owes))
            entries.append((p, grad, _torch.version_of(grad), only_fp16))
    return HeldGradients(entries, " and ".join(reasons)) if entries else None


def hold(run: RunState, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
    """After a backward (or :func:`finish`): note the gradients that still owe something, and their versions."""
    run.held = _owing(run, optimizers)


def check(run: RunState, where: str, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
    """Refuse, in one line, a change the script made to gradients that were not final yet.

    Args:
        run: the run's state (what :func:`hold` noted).
        where: the call that finds it (``"rt.step"``), for the message.
        optimizers: the optimizers that call was given (their unscaling by the script counts).

    Raises:
        UsageError: a noted gradient was changed in place or replaced (set to None is no change).
    """
    held, run.held = run.held, None
    if held is None:
        return
    for p, grad, version, only_fp16 in held.entries:
        now = p.grad
        if now is None or (now is grad and _torch.version_of(now) == version):
            continue
        if only_fp16 is not None and _unscaled(run, only_fp16):
            continue  # the script unscaled them itself (rt.precision.unscale_), then changed them
        why = held.why
        if FP16 in why and run.precision.scaler is not None:
            why = why.replace(FP16, f"{FP16} ({run.precision.scaler.get_scale():g})")
        raise UsageError(
            f"{where}: the script changed the gradients after rt.backward while they still awaited {why}, "
            "so torch.nn.utils.clip_grad_norm_ and its like acted on the wrong numbers; clip with "
            f"rt.clip_grad_norm_(model, max_norm), or call {UNSCALE} first and change them after it"
        )


def finish(run: RunState, where: str, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
    """Make the step's gradients final now (``rt.unscale_gradients``, ``rt.clip_grad_norm_``): every mode's
    exchange, the division by the step's units, fp16's unscaling of ``optimizers`` (every known one if none).

    Args:
        run: the run's state.
        where: the call, for messages (a backward after it is refused where it changed the gradients).
        optimizers: under fp16, the optimizers whose gradients are unscaled (none: every one the run knows).

    Raises:
        UsageError: under fp16, a gradient whose optimizer the run does not know (not given to
            ``rt.setup``), or one the script changed before they were final (:func:`check`).
    """
    check(run, where, optimizers)
    owed = _owing(run, optimizers)
    known = _known(run, optimizers)
    params = trained(run, known)
    for mode in run.modes:
        mode.complete(params)
    counted.scale(run.counted, params)  # every model's, not only a clipped one's
    scaler = run.precision.scaler
    if scaler is not None:
        for opt in optimizers or known:
            if not _unscaled(run, opt):
                run.precision.unscale_(opt)
            run.unscaled.add(id(opt))
    if owed is not None:
        run.finished = f"{where} ({owed.why})"
    hold(run, optimizers)  # under fp16, an optimizer not unscaled yet


def refuse_after_finish(run: RunState) -> None:
    """A backward after :func:`finish` changed the step's gradients: its own would be added to final ones."""
    if run.finished is not None:
        raise UsageError(
            f"rt.backward after {run.finished} in the same step: its gradients are final, and this backward's "
            "would be added to them unfinished; call it after the step's last rt.backward, before rt.step"
        )


__all__ = ["FP16", "UNSCALE", "check", "finish", "hold", "refuse_after_finish", "trained"]
