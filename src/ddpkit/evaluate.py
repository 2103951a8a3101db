"""Exact evaluation and order-preserving prediction over a whole dataset, on any world size.

Each rank reads one contiguous shard of the dataset (sizes differ by at most one, a rank
may hold none, nothing is padded or read twice). No collective runs inside the per-batch
loop, so uneven shards cannot hang; counts are reduced once at the end as integers, so they
equal a single-process run exactly.

Example:
    >>> metrics = evaluate(model, test_set, num_classes=10)          # doctest: +SKIP
    >>> metrics["count"] == len(test_set)                             # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

from ddpkit import collectives
from ddpkit.checkpoint import unwrap
from ddpkit.data import private_generator, shard_range, to_device


def _shard_loader(dataset: Any, batch_size: int, num_workers: int = 0) -> DataLoader:
    indices = shard_range(len(dataset), collectives.rank(), collectives.world_size())
    return DataLoader(Subset(dataset, list(indices)), batch_size=batch_size, shuffle=False,
                      num_workers=num_workers, generator=private_generator())


def _device_of(model: torch.nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: Any, *, num_classes: int, batch_size: int = 256,
             loss_fn: Callable[..., torch.Tensor] = F.cross_entropy, num_workers: int = 0,
             autocast: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Loss, accuracy, confusion matrix and per-class precision/recall/F1 over all of ``dataset``.

    Every rank must call it. ``loss_fn(output, target, reduction="sum")`` is summed in float64;
    ``autocast`` (e.g. ``rt.autocast``) makes the context each forward runs in.
    Returns plain Python numbers and lists, identical on every rank.
    """
    module = unwrap(model)   # DDP's forward may broadcast buffers: a collective per batch
    was_training = module.training
    module.eval()
    device = _device_of(module)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    confusion = torch.zeros(num_classes * num_classes, dtype=torch.long, device=device)
    try:
        for inputs, targets in _shard_loader(dataset, batch_size, num_workers):
            inputs, targets = to_device(inputs, device), to_device(targets, device)
            with autocast() if autocast is not None else contextlib.nullcontext():
                outputs = module(inputs)
            loss_sum += loss_fn(outputs.float(), targets, reduction="sum").double()
            predicted = outputs.argmax(dim=1)
            confusion += torch.bincount(targets * num_classes + predicted, minlength=num_classes**2)
    finally:
        module.train(was_training)
    confusion = collectives.all_reduce(confusion.cpu()).view(num_classes, num_classes)
    loss_total = float(collectives.all_reduce(loss_sum.cpu()))
    return _metrics(confusion, loss_total)


def _metrics(confusion: torch.Tensor, loss_total: float) -> dict[str, Any]:
    count = int(confusion.sum())
    correct = int(confusion.diag().sum())
    true_positive = confusion.diag().double()
    predicted = confusion.sum(dim=0).double()
    actual = confusion.sum(dim=1).double()
    precision = torch.where(predicted > 0, true_positive / predicted.clamp(min=1), torch.zeros_like(predicted))
    recall = torch.where(actual > 0, true_positive / actual.clamp(min=1), torch.zeros_like(actual))
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-300),
                     torch.zeros_like(precision))
    return {
        "count": count,
        "correct": correct,
        "accuracy": correct / count if count else 0.0,
        "loss": loss_total / count if count else 0.0,
        "confusion": confusion.tolist(),
        "precision": precision.tolist(),
        "recall": recall.tolist(),
        "f1": f1.tolist(),
    }


@torch.no_grad()
def predict(model: torch.nn.Module, dataset: Any, *, batch_size: int = 256, to: str = "main",
            num_workers: int = 0) -> torch.Tensor | None:
    """Outputs for every sample exactly once, in dataset order: first dimension ``len(dataset)``.

    Args:
        to: ``"main"`` returns the tensor on rank 0 and None elsewhere; ``"all"`` on every rank.
    """
    if to not in ("main", "all"):
        from ddpkit.errors import UsageError

        raise UsageError(f"predict(to={to!r}): use 'main' or 'all'")
    module = unwrap(model)
    was_training = module.training
    module.eval()
    device = _device_of(module)
    chunks = []
    try:
        for batch in _shard_loader(dataset, batch_size, num_workers):
            inputs = batch[0] if isinstance(batch, (list, tuple)) else batch
            chunks.append(module(to_device(inputs, device)).cpu())
    finally:
        module.train(was_training)
    local = torch.cat(chunks) if chunks else _empty_output(module, dataset, device)
    gathered = collectives.all_gather(local)   # contiguous shards in rank order = dataset order
    return gathered if to == "all" or collectives.rank() == 0 else None


def _empty_output(module: torch.nn.Module, dataset: Any, device: torch.device) -> torch.Tensor:
    """Zero rows with the right trailing shape, from one sample (a rank with an empty shard)."""
    sample = dataset[0]
    inputs = sample[0] if isinstance(sample, (list, tuple)) else sample
    return module(to_device(inputs, device).unsqueeze(0)).cpu()[:0]
