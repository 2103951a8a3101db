"""``rt.backward(loss, count=n)``: a loss averaged over units of its own (tokens), averaged over every unit of the step.

A language model's loss is the mean over the batch's tokens that count (``ignore_index`` left
out), and the number of those differs from batch to batch and from rank to rank. Weighting each
rank's mean by its samples, as ``rt.backward(loss)`` does, is then not the mean over the step's
tokens: 1 and 2 processes, or 1 and 4 accumulated batches, train apart (the gradient-accumulation
bug fixed in Hugging Face transformers in 2024). With ``count=n`` each backward is weighted by its
``n`` units, and the step divides the sum by every rank's units, once they are all known:

- **At each backward**, the loss is multiplied by ``D * n / c``: ``D`` undoes the exchange's average
  (the world size under DDP and FSDP; 1 where the shards' tree sums, or with one process), and
  ``c`` is a power of two common to every rank (chosen at the run's first counted backward, from
  the largest ``n`` then: one small all-reduce), which keeps the gradients the size of a mean
  loss's. A power of two scales every float exactly, so ``c`` changes no bit of the result.
- **At the step** (:func:`scale`, before clipping, fp16's unscaling and the optimizer), the
  exchanged gradients are the sum of ``n`` times each backward's mean-loss gradient, over ``c``;
  they are multiplied by ``c / N``, where ``N`` is the step's units over every rank and micro-step
  (one small all-reduce). A step with no unit at all keeps zero gradients.

It combines with ``rt.accumulate`` (the units of the whole group), ``micro_shards`` (a shard's
count weighs it; the same bits on any world size), fsdp, compression and fp16. A fault-tolerant
replica and an infrequent sync refuse it in one line (:meth:`~ddpkit.parallel.modes.Mode.refuse`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ddpkit.distributed import collectives
from ddpkit.errors import UsageError
from ddpkit.state.counted import Counted

CALL = "rt.backward(count=...)"
"""How a mode that cannot take counts is asked (:meth:`~ddpkit.parallel.modes.Mode.refuse`)."""


def _units(count: Any) -> torch.Tensor:
    """``count`` as a float64 scalar tensor (on its own device), checked."""
    if isinstance(count, bool) or not isinstance(count, (numbers.Real, torch.Tensor)):
        raise UsageError(
            f"rt.backward(count=...) takes the number of units the loss averages (tokens, say), "
            f"a number or a one-element tensor; got {type(count).__name__}"
        )
    units = count.detach() if isinstance(count, torch.Tensor) else torch.tensor(float(count))
    if units.numel() != 1:
        raise UsageError(
            f"rt.backward(count=...) takes one number, the units of this backward's loss; got a tensor of "
            f"shape {tuple(units.shape)} (sum it: (labels != -100).sum())"
        )
    units = units.reshape(()).to(torch.float64)
    if units.device.type == "cpu" and not (math.isfinite(float(units)) and float(units) >= 0):
        raise UsageError(f"rt.backward(count=...) must be a finite number >= 0; got {float(units)}")
    return units


def weigh(counted: Counted, loss: torch.Tensor, count: Any, modes: Sequence[Any]) -> tuple[torch.Tensor, Any]:
    """The loss to back-propagate and its weight, ``D * n / c``, for a backward of ``count`` units.

    Args:
        counted: the run's counts (the step's total grows by ``count``).
        loss: the mean loss over this backward's ``count`` units.
        count: its units; 0 (a rank whose tokens are all ignored) contributes nothing, NaN loss included.
        modes: the run's modes (a mode that sums the shards along a tree does not average).

    Returns:
        (the loss, NaN made 0 where it averaged no unit; its weight: a float, or a tensor where
        ``count`` is one on a GPU, so that no step waits for the device).
    """
    units = _units(count)
    if counted.scale is None:  # once a run: the same power of two on every rank
        with collectives.ddpkits_own():  # inside a micro-shard, not the script's
            largest = float(collectives.all_reduce(units.to("cpu"), "max"))
        counted.scale = 2.0 ** math.floor(math.log2(largest)) if largest >= 1 else 1.0
    counted.total = units if counted.total is None else counted.total + units.to(counted.total.device)
    averaged = 1 if any(mode.sums_gradients() for mode in modes) else collectives.world_size()
    if units.device.type == "cpu":
        n = float(units)
        if n == 0:
            loss = torch.nan_to_num(loss, nan=0.0)  # the mean of no token: NaN, weighted by 0
        return loss, averaged * n / counted.scale
    some = units > 0
    loss = torch.where(some, loss, torch.nan_to_num(loss, nan=0.0))
    return loss, (units * (averaged / counted.scale)).to(loss.dtype)


def scale(counted: Counted, params: Iterable[torch.Tensor], reduce_over: Any = None) -> None:
    """Divide the step's gradients (exchanged, not yet clipped or unscaled) by its units over every rank.

    Each parameter once a step, whether :func:`rt.clip_grad_norm_` or ``rt.step`` comes first; the
    units are all-reduced at the first call of the step (every rank makes it, a rank that ran no
    backward in the step too, once the run has counted: the step's units are its peers').

    Args:
        counted: the run's counts.
        params: the parameters whose gradients the step uses.
        reduce_over: a group of ddpkit's own for the units' sum (None: the process group).
    """
    if counted.counting is False or (counted.counting is None and counted.scale is None):
        return  # a step of plain backwards, or a run that never counted
    if counted.factor is None:  # the step's first call: every rank's units
        assert counted.scale is not None  # chosen at the run's first counted backward
        # a rank without a backward this step (micro-shards of a short last batch, all empty) still sums
        mine = counted.total if counted.total is not None else torch.zeros((), dtype=torch.float64)
        total = collectives.all_reduce(mine, "sum", over=reduce_over)
        counted.factor = torch.where(total > 0, counted.scale / total.clamp(min=1e-300), torch.zeros_like(total))
    factors: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    for p in params:
        grad = p.grad
        if grad is None or id(p) in counted.scaled:
            continue
        key = (grad.device, grad.dtype)
        if key not in factors:
            factors[key] = counted.factor.to(device=grad.device, dtype=grad.dtype)
        grad.mul_(factors[key])
        counted.scaled.add(id(p))


__all__ = ["CALL", "scale", "weigh"]
