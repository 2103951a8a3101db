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

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ddpkit.errors import UsageError

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group, differentiable: the gradient of a sum is the sum of gradients.

    Each rank's loss depends on the global sum, so the gradient reaching a rank's local
    contribution is the sum of every rank's gradient w.r.t. that global sum.
    (``torch.distributed.nn.functional.all_reduce`` does the same but warns on every call
    since torch 2.10; this keeps training logs clean and works on torch >= 2.4.)
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllReduceSum.apply(grad.contiguous(), ctx.group), None


def _all_reduce_sum(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    return _AllReduceSum.apply(tensor, group)


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over ``[N, C, *]`` inputs with statistics of the batch of all ranks.

    In training mode with a process group of more than one rank, the mean and the biased
    variance are computed over the samples of every rank (two passes: the variance is
    the mean of squared deviations from the global mean, which stays accurate where
    ``E[x^2] - E[x]^2`` would cancel). A rank whose batch is empty contributes nothing
    but still joins the reductions, so nobody waits forever. Otherwise (eval mode, or a
    world of one) it is exactly ``nn.BatchNorm``.

    Args:
        num_features: channels ``C``.
        eps: added to the variance for stability.
        momentum: running-stat update factor; ``None`` for a cumulative average.
        affine: learn a per-channel scale and shift.
        track_running_stats: keep running mean/variance for eval mode.
        process_group: the group to synchronise over; the default group when ``None``.
    """

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

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise UsageError(f"SyncBatchNorm expects input of shape [N, C, *], got {input.dim()}-D input")
        if input.shape[1] != self.num_features:
            raise UsageError(
                f"SyncBatchNorm was built for {self.num_features} channels, got input with {input.shape[1]}"
            )

    def _group_size(self) -> int:
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
        """Global-batch statistics, normalisation, affine and running-stat update."""
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        local_count = x.numel() // self.num_features
        count = torch.full((1,), float(local_count), dtype=x.dtype, device=x.device)
        totals = _all_reduce_sum(torch.cat([x.sum(dims), count]), self.process_group)
        total_sum, n = totals[:-1], int(totals[-1].item())
        if n <= 1:
            raise UsageError(
                f"SyncBatchNorm needs more than 1 value per channel across all ranks when training, got {n}"
            )
        mean = total_sum / n
        centred = x - mean.view(shape)
        var = _all_reduce_sum(centred.square().sum(dims), self.process_group) / n
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape).to(x.dtype) + self.bias.view(shape).to(x.dtype)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            self._update_running(mean.detach(), var.detach() * (n / (n - 1)), factor)
        return out.to(input.dtype)

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, unbiased_var: torch.Tensor, factor: float) -> None:
        assert self.running_mean is not None and self.running_var is not None
        self.running_mean.mul_(1.0 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1.0 - factor).add_(unbiased_var.to(self.running_var.dtype), alpha=factor)


def convert_sync_batchnorm(module: nn.Module, device: torch.device) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` by one that synchronises across ranks.

    On CUDA this is ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``. Elsewhere each
    ``BatchNorm1d/2d/3d`` becomes a :class:`SyncBatchNorm` that takes over the same
    parameter and buffer tensors (values, ``requires_grad`` and any optimizer already
    holding them stay valid) and the same settings and train/eval mode.

    Returns:
        The converted module (a new object when ``module`` itself was a BatchNorm).
    """
    if torch.device(device).type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return _convert(module)


def _convert(module: nn.Module) -> nn.Module:
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        return _replacement(module)
    for name, child in list(module.named_children()):
        new_child = _convert(child)
        if new_child is not child:
            module.add_module(name, new_child)
    return module


def _replacement(bn: _BatchNorm) -> SyncBatchNorm:
    """A SyncBatchNorm sharing ``bn``'s parameters, buffers and settings."""
    if isinstance(bn.weight, nn.parameter.UninitializedParameter):
        raise UsageError(f"{type(bn).__name__} is not initialised; run one forward pass before converting")
    new = SyncBatchNorm(
        bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, device="meta"
    )
    for name in ("weight", "bias"):
        setattr(new, name, getattr(bn, name))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        new.register_buffer(name, getattr(bn, name))
    new.train(bn.training)
    if hasattr(bn, "qconfig"):
        new.qconfig = bn.qconfig
    return new
