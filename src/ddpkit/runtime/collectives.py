"""``ddpkit.all_reduce`` and the other collectives a script calls, the same as ``rt.all_reduce`` and
``rt.all_gather``: each mode of the running job may refuse them first (a fault-tolerant replica does:
its group is itself, so they would reduce over one replica), then :mod:`ddpkit.distributed.collectives`
runs them (identity in a world of one). Inside a step, a fault-tolerant replica's all-reduce goes
over the step's quorum (:func:`~ddpkit.parallel.modes.reduced_over`).
"""

from __future__ import annotations

from typing import Any

import torch

from ddpkit.distributed import collectives
from ddpkit.parallel.modes import reduced_over
from ddpkit.runtime import start


def refuse(call: str) -> None:
    """Let every mode of the running job refuse ``call`` in one line (nothing without a running job)."""
    runtime = start.current()
    if runtime is not None:
        for mode in runtime._run.modes:
            mode.refuse(call)


def all_reduce(value: Any, op: str = "sum") -> Any:
    """Reduce ``value`` over all ranks with ``op`` in ``"sum"``, ``"mean"``, ``"max"``, ``"min"``.

    Tensors come back as new tensors on their own device (the input is not modified); Python
    numbers come back as Python numbers.

    In a fault-tolerant replica (``ddpkit run --fault-tolerant``) call it inside a step, between a
    batch of ``rt.loader`` and ``rt.step``: it reduces over the step's quorum, whose replicas hold the
    step's global batch between them. Its value counts where the step commits (``rt.global_step``
    moves on); where a replica died during it, a floating result is NaN and the batch comes again.

    Example:
        >>> all_reduce(torch.tensor([1.0, 2.0]), op="mean")
        tensor([1., 2.])
    """
    refuse("ddpkit.all_reduce")
    runtime = start.current()
    return collectives.all_reduce(value, op, over=reduced_over(runtime._run.modes) if runtime is not None else None)


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of ``tensor`` concatenated in rank order; first dimensions may differ."""
    refuse("ddpkit.all_gather")
    return collectives.all_gather(tensor)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order: tensors, numbers, strings, None and containers of them
    (sent as ``torch.save`` bytes, read with ``weights_only=True``)."""
    refuse("ddpkit.all_gather_object")
    return collectives.all_gather_object(obj)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank; ``obj`` as for :func:`all_gather_object`."""
    refuse("ddpkit.broadcast_object")
    return collectives.broadcast_object(obj, src)


__all__ = ["all_gather", "all_gather_object", "all_reduce", "broadcast_object", "refuse"]
