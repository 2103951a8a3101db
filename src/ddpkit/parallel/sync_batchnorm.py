"""Batch normalisation whose statistics span every rank, on CPU (gloo) as well as CUDA.

``torch.nn.SyncBatchNorm`` only runs on CUDA. With small per-rank batches the local mean
and variance are noisy, and they differ between ranks, so the model each rank trains is
not the model a single process would train on the whole batch. :class:`SyncBatchNorm`
reduces the per-channel sums across the process group so that every rank normalises with
the statistics of the global batch, and gradients flow back through the reductions.

Example:
    >>> import torch, ddpkit
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    >>> net = convert_sync_batchnorm(net, torch.device("cpu"))
    >>> type(net[1]).__name__
    'SyncBatchNorm'
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ddpkit.errors import UsageError

__all__ = ["SyncBatchNorm", "convert_over", "convert_sync_batchnorm"]


def _global_stats(
    x: torch.Tensor, dims: list[int], group: Any, place: int = 0
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Mean and biased variance per channel over the samples of every rank, in one collective.

    Each rank sends its count, mean and sum of squared deviations from its own mean; every rank
    combines them (Chan et al.'s parallel variance, in float64), which stays accurate where
    ``E[x^2] - E[x]^2`` would cancel. An empty rank sends zeros and weighs nothing.
    """
    count = x.numel() // x.shape[1]
    if count:
        mean = x.mean(dims)
        m2 = (x - mean.view(1, -1, *[1] * (x.dim() - 2))).square().sum(dims)
    else:
        mean = m2 = torch.zeros(x.shape[1], dtype=x.dtype, device=x.device)
    local = torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=x.device), mean.double(), m2.double()])
    if hasattr(group, "all_gather_rows"):  # a fault-tolerant job's replicas (ddpkit.distributed.ft)
        table = group.all_gather_rows(local, call="SyncBatchNorm forward", run=place)  # checked once a model call
    else:
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        table = torch.stack(gathered)
    counts, means, m2s = table[:, :1], table[:, 1 : 1 + x.shape[1]], table[:, 1 + x.shape[1] :]
    total = int(counts.sum().item())
    if total <= 1:
        raise UsageError(
            f"SyncBatchNorm needs more than 1 value per channel across all ranks when training, got {total}"
        )
    global_mean = (counts * means).sum(0) / total
    global_m2 = (m2s + counts * (means - global_mean).square()).sum(0)
    return global_mean.to(x.dtype), (global_m2 / total).to(x.dtype), total


class _SyncNormalize(torch.autograd.Function):
    """``(x - mean) * invstd * weight + bias`` with the statistics of every rank's batch.

    The statistics come in as constants; backward adds their dependence on ``x`` analytically
    (the usual BatchNorm gradient), which needs two per-channel sums over every rank's batch:
    one allreduce of both. The parameters' gradients stay this rank's own sums, as every other
    parameter's do before DDP averages them.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        weight: Any,
        bias: Any,
        total: int,
        group: Any,
        place: int = 0,
    ) -> torch.Tensor:
        shape = [1, -1] + [1] * (x.dim() - 2)
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(x, mean, invstd, weight)
        ctx.total, ctx.group, ctx.affine, ctx.place = total, group, weight is not None, place
        if weight is None:
            return xhat
        return xhat * weight.view(shape).to(x.dtype) + bias.view(shape).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, mean, invstd, weight = ctx.saved_tensors
        shape = [1, -1] + [1] * (x.dim() - 2)
        dims = [0, *range(2, x.dim())]
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        sum_dy, sum_dy_xhat = grad.sum(dims), (grad * xhat).sum(dims)
        sums = torch.cat([sum_dy, sum_dy_xhat]).double()
        started = time.perf_counter()
        if hasattr(ctx.group, "all_reduce_sum"):
            ctx.group.all_reduce_sum(sums, call="SyncBatchNorm backward", run=-ctx.place)  # once a backward pass
        else:
            dist.all_reduce(sums, group=ctx.group)
        SyncBatchNorm.collective_seconds += time.perf_counter() - started
        channels = x.shape[1]
        mean_dy = (sums[:channels] / ctx.total).to(x.dtype)
        mean_dy_xhat = (sums[channels:] / ctx.total).to(x.dtype)
        scale = invstd if weight is None else invstd * weight.to(x.dtype)
        grad_x = (grad - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
        if not ctx.affine:
            return grad_x, None, None, None, None, None, None, None
        return grad_x, None, None, sum_dy_xhat.to(weight.dtype), sum_dy.to(weight.dtype), None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over ``[N, C, *]`` inputs with statistics of the batch of all ranks.

    In training mode with a process group of more than one rank, the mean and the biased
    variance are computed over the samples of every rank: one all-gather of each rank's count,
    mean and squared deviations in the forward pass, one allreduce of two per-channel sums in the
    backward pass (two collectives a layer per step, as torch's CUDA SyncBatchNorm makes). A rank
    whose batch is empty contributes nothing but still joins the collectives, so nobody waits
    forever. Otherwise (eval mode, or a world of one) it is exactly ``nn.BatchNorm``.

    Args:
        num_features: channels ``C``.
        eps: added to the variance for stability.
        momentum: running-stat update factor; ``None`` for a cumulative average.
        affine: learn a per-channel scale and shift.
        track_running_stats: keep running mean/variance for eval mode.
        process_group: the group to synchronise over; the default group when ``None``.
    """

    collective_seconds: float = 0.0
    """Seconds every SyncBatchNorm of this process spent in its statistics' collectives (their
    waiting for the other ranks included) since the process began: ``ddpkit bench`` reads it."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group
        self.place = 0
        """This layer's place among the model's (:func:`convert_over`): a fault-tolerant replica checks
        the layers' collectives once a run, a model call's or a backward pass's."""

    def __deepcopy__(self, memo: dict[int, Any]) -> SyncBatchNorm:
        """A copy (``copy.deepcopy``, ``AveragedModel``'s, an EMA's) that shares the process group:
        a group cannot be copied, and the copy's statistics travel between the same ranks."""
        if self.process_group is not None:
            memo.setdefault(id(self.process_group), self.process_group)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__dict__, memo))
        return copied

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise UsageError(f"SyncBatchNorm expects input of shape [N, C, *], got {input.dim()}-D input")
        if input.shape[1] != self.num_features:
            raise UsageError(
                f"SyncBatchNorm was built for {self.num_features} channels, got input with {input.shape[1]}"
            )

    def _group_size(self) -> int:
        if hasattr(self.process_group, "all_gather_rows"):
            return int(self.process_group.size())
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def _update_factor(self) -> float:
        """Count the batch like nn.BatchNorm and return its running-average factor."""
        if not (self.training and self.track_running_stats):
            return 0.0 if self.momentum is None else self.momentum
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input``; synchronised across ranks only when training in a group."""
        self._check_input_dim(input)
        factor = self._update_factor()
        if self.training and self._group_size() > 1:
            return self._sync_forward(input, factor)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        keep_stats = not self.training or self.track_running_stats
        return F.batch_norm(
            input,
            self.running_mean if keep_stats else None,
            self.running_var if keep_stats else None,
            self.weight,
            self.bias,
            use_batch_stats,
            factor,
            self.eps,
        )

    def _sync_forward(self, input: torch.Tensor, factor: float) -> torch.Tensor:
        """Global-batch statistics (one collective), normalisation, affine, running-stat update."""
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        dims = [0, *range(2, x.dim())]
        with torch.no_grad():
            started = time.perf_counter()
            mean, var, n = _global_stats(x.detach(), dims, self.process_group, self.place)
            SyncBatchNorm.collective_seconds += time.perf_counter() - started
            invstd = torch.rsqrt(var + self.eps)
        out = _SyncNormalize.apply(x, mean, invstd, self.weight, self.bias, n, self.process_group, self.place)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            self._update_running(mean, var * (n / (n - 1)), factor)
        return out.to(input.dtype)

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, unbiased_var: torch.Tensor, factor: float) -> None:
        assert self.running_mean is not None and self.running_var is not None
        self.running_mean.mul_(1.0 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1.0 - factor).add_(unbiased_var.to(self.running_var.dtype), alpha=factor)


def convert_sync_batchnorm(module: nn.Module, device: torch.device, process_group: Any = None) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` by one that synchronises across ranks.

    On CUDA this is ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``. Elsewhere each
    ``BatchNorm1d/2d/3d`` becomes a :class:`SyncBatchNorm` that takes over the same
    parameter and buffer tensors (values, ``requires_grad`` and any optimizer already
    holding them stay valid) and the same settings and train/eval mode.

    Args:
        module: the model (or one BatchNorm layer).
        device: where it runs: CUDA takes torch's own SyncBatchNorm.
        process_group: the group the statistics travel on (default: the default group).
            ``rt.setup`` gives them a group of their own on CPU, so that a layer's backward
            collective does not queue behind DDP's gradient buckets on gloo.

    Returns:
        The converted module (a new object when ``module`` itself was a BatchNorm).
    """
    if torch.device(device).type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    return _convert(module, process_group)


def convert_over(module: nn.Module, group: Any) -> nn.Module:
    """Replace every BatchNorm layer by ddpkit's :class:`SyncBatchNorm` over ``group``, on any device:
    a fault-tolerant job's replicas (:class:`ddpkit.distributed.ft.Replica`), whose members change from step to step.

    Each layer gets its place in the model: the replicas check which collective each calls once a run
    of the layers' calls (:meth:`~ddpkit.distributed.ft.Replica.announce`), a model call's or a backward pass's.
    """
    converted = _convert(module, group)
    for place, layer in enumerate(m for m in converted.modules() if isinstance(m, SyncBatchNorm)):
        layer.place = place
    return converted


def _convert(module: nn.Module, process_group: Any = None) -> nn.Module:
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        return _replacement(module, process_group)
    for name, child in list(module.named_children()):
        new_child = _convert(child, process_group)
        if new_child is not child:
            module.add_module(name, new_child)
    return module


def _replacement(bn: _BatchNorm, process_group: Any = None) -> SyncBatchNorm:
    """A SyncBatchNorm sharing ``bn``'s parameters, buffers and settings."""
    if isinstance(bn.weight, nn.parameter.UninitializedParameter):
        raise UsageError(f"{type(bn).__name__} is not initialised; run one forward pass before converting")
    new = SyncBatchNorm(
        bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, process_group, device="meta"
    )
    for name in ("weight", "bias"):
        setattr(new, name, getattr(bn, name))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        new.register_buffer(name, getattr(bn, name))
    new.train(bn.training)
    if hasattr(bn, "qconfig"):
        new.qconfig = bn.qconfig
    return new
