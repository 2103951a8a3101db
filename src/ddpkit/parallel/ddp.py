"""How the model is replicated: device, SyncBatchNorm, DDP with a settled bucket layout, compile.

:func:`replicate` is what ``rt.setup`` does to a model; it returns what the loop must know
about the result (why a resume would not be bitwise, if it would not).
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch


def _buffer_sync_arg() -> str:
    """DDP's name for per-forward buffer broadcasting (renamed in recent torch)."""
    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"


_BUFFER_SYNC_ARG = _buffer_sync_arg()


@dataclass
class Replica:
    """The wrapped model and what the loop needs to know about it."""

    model: Any
    not_bitwise: str | None = None   # why a resumed run would not be bitwise, if it would not
    compressor: Any = None           # the gradient compression hook's state (ddpkit.parallel.compression)
    buffers: Any = None              # lazily averaged BatchNorm statistics (ddpkit.parallel.lazy_buffers)


def replicate(model: torch.nn.Module, *, device: torch.device, world_size: int, is_main: bool,
              sync_batchnorm: bool = False, compile: bool | dict[str, Any] = False,
              grad_compression: str | None = None, powersgd_rank: int = 2, powersgd_start: int | None = None,
              timeout_s: float | None = None, **ddp_kwargs: Any) -> Replica:
    """Move ``model`` to ``device``, convert BatchNorm if asked, wrap it in DDP when world > 1, compile.

    ``grad_compression`` (checked by :func:`ddpkit.parallel.compression.check`) registers its hook on the
    DDP model; with one process nothing is sent, and it is left out with a warning.
    """
    model = model.to(device)
    replica = Replica(model)
    if sync_batchnorm and world_size > 1:
        from ddpkit.parallel.sync_batchnorm import convert_sync_batchnorm

        model = convert_sync_batchnorm(model, device)
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        from ddpkit.parallel import lazy_buffers

        # Gradients as views into DDP's buckets save a gradient-sized copy of memory, which a GPU
        # wants; on a CPU they cost backward time (ResNet-18: 8 ms a step, BENCHMARKS.md), and
        # memory is rarely what runs out there. Bitwise the same either way.
        ddp_kwargs.setdefault("gradient_as_bucket_view", device.type == "cuda")
        lazy = None
        compiled = compile or hasattr(model, "_orig_mod")      # compiled before setup counts too
        if not ddp_kwargs.keys() & {"broadcast_buffers", "forward_sync_buffers"}:
            if sync_batchnorm:
                # Synced statistics are already equal on every rank; no need to broadcast them.
                ddp_kwargs[_BUFFER_SYNC_ARG] = False
            elif not compiled:
                lazy = lazy_buffers.candidates(model)       # only BatchNorm statistics: average them lazily
                if lazy is not None:
                    ddp_kwargs[_BUFFER_SYNC_ARG] = False
        device_ids = [device.index] if device.type == "cuda" else None
        # DDP re-buckets after the first backward unless it looks for unused parameters (then its
        # first layout, last layers first, stays); ddpkit settles that layout at once instead.
        settle = not ddp_kwargs.get("find_unused_parameters") or ddp_kwargs.get("static_graph")
        if settle:
            from ddpkit._torch import ready_order_ddp

            model = ready_order_ddp(model, device_ids=device_ids, **ddp_kwargs)
        else:
            model = DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)
        if ddp_kwargs.get(_BUFFER_SYNC_ARG) is False and _BUFFER_SYNC_ARG == "broadcast_buffers":
            # there, broadcast_buffers=False also skips the buffers' copy from rank 0 at construction
            lazy_buffers.broadcast_from_rank0(model.module)
        if lazy is not None:
            replica.buffers = lazy_buffers.install(model, lazy)
        if settle:
            replica.not_bitwise = settle_buckets(model, is_main=is_main)
        if grad_compression is not None:
            from ddpkit.parallel.compression import attach

            replica.compressor = attach(model, grad_compression, rank=powersgd_rank, start=powersgd_start,
                                        device=device, buckets_settled=replica.not_bitwise is None,
                                        timeout_s=timeout_s)
    elif grad_compression is not None and is_main:
        warnings.warn(f"grad_compression={grad_compression!r} has no effect with one process: no gradients "
                      "are sent", stacklevel=4)
    if compile:
        model = torch.compile(model, **(compile if isinstance(compile, dict) else {}))
    replica.model = model
    return replica


def settle_buckets(model: Any, *, is_main: bool) -> str | None:
    """Settle DDP's gradient buckets now, so every step of every attempt uses the same layout.

    DDP starts with one bucket and, after the first backward, re-buckets in the order gradients
    became ready. A run resumed from a checkpoint would take its first step with the starting
    layout where the uninterrupted run used the re-bucketed one; with three or more processes a
    ring allreduce sums each element in an order that depends on where it sits in the bucket, so
    the two runs part by a rounding error. ddpkit re-buckets at once, with DDP's own size caps
    (a small first bucket), in reverse registration order (:func:`ddpkit._torch.ready_order_ddp`):
    the order backward makes gradients ready, so the first bucket (the last layers) is reduced
    while backward computes the rest, as DDP's ready order would. Same layout on every step of
    every attempt: resume is bitwise exact and communication still overlaps. CPU and GPU alike.

    Returns:
        None, or why resume is not bitwise: without the private APIs (another torch) DDP's
        default stays, with a warning (rank 0, once), and checkpoints record it.
    """
    from ddpkit import _torch

    try:
        _torch.settle_ddp_buckets(model)     # a collective: every rank calls setup
    except _torch.PrivateApiChanged as exc:
        if is_main:
            warnings.warn(f"{exc}: with 3 or more processes a resumed run may differ from an "
                          "uninterrupted one by rounding", stacklevel=4)
        return f"DDP buckets could not be settled at setup ({exc})"
    return None
