"""Exact evaluation and order-preserving prediction over a whole dataset, on any world size.

Each rank reads one contiguous shard of the dataset in whole batches laid from its first sample
(batch counts differ by at most one, a rank may hold none, nothing is padded or read twice), so each
batch, and each forward's bits, is the same on any world size. No collective runs inside the per-batch
loop, so uneven shards cannot hang; counts are reduced once at the end as integers, and the loss as the
exactly rounded sum of the batches' sums (``math.fsum``), so both equal a single-process run's bits.

Example:
    >>> metrics = evaluate(model, test_set, num_classes=10)          # doctest: +SKIP
    >>> metrics["count"] == len(test_set)                             # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, default_collate

from ddpkit._tensors import position_rows, remapped
from ddpkit._torch import unwrap
from ddpkit.distributed import collectives
from ddpkit.errors import DdpkitError, UsageError
from ddpkit.loop import same_data
from ddpkit.loop.batch import concat_batches, map_tensors, to_device, zero_rows
from ddpkit.loop.loader import _KeyedDataset
from ddpkit.loop.sampler import batch_shard
from ddpkit.loop.streams.evaluation import StreamShard, first_sample
from ddpkit.observe import heartbeats
from ddpkit.parallel import lazy_buffers, periodic, same_model
from ddpkit.parallel.fsdp import is_sharded
from ddpkit.rng import private_generator


def _shard_batches(
    dataset: Any,
    batch_size: int,
    num_workers: int = 0,
    stream: Any = None,
    positions: list[list[int]] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> Iterator[Any]:
    """This rank's shard in batches; each batch counts as progress for the hang watchdog.

    For a stream pass its :class:`ddpkit.loop.streams.evaluation.StreamShard`; ``positions`` then
    receives the stream indices of each batch.
    """
    if stream is not None:
        batches = stream.batches()
    else:
        indices = batch_shard(len(dataset), batch_size, collectives.rank(), collectives.world_size())
        # each read keyed as rt.loader keys one, by an evaluation's own (seed 0, epoch -1) and the index: a
        # test set that draws (test-time augmentation) drew from each process's stream, 0.270 and 0.243 scored
        # on 1 and 2 processes; now the same on any world size, with any workers, at every evaluation
        keys = [(-1, index) for index in indices]
        batches = (
            (None, b)
            for b in DataLoader(
                _KeyedDataset(dataset, 0, collectives.rank()),
                batch_sampler=[keys[s : s + batch_size] for s in range(0, len(keys), batch_size)],
                num_workers=num_workers,
                collate_fn=collate_fn or default_collate,
                generator=private_generator(),
            )
        )
    for where, batch in batches:
        if positions is not None and where is not None:
            positions.append(where)
        heartbeats.beat("eval")
        yield batch


def _lockstep(
    batches: Iterator[Any],
    module: torch.nn.Module,
    dataset: Any,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> Iterator[Any]:
    """Where every forward runs a collective (``strategy="fsdp"`` all-gathers parameters, a DDP model
    held inside a copy such as ``AveragedModel(model)`` broadcasts its buffers), ranks agree before each
    batch whether any still has one, and a rank that ran out forwards zero rows (each rank holds whole
    batches: their counts differ by one)."""
    forward_meets = is_sharded(module) or any(
        isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in module.modules()
    )
    if not forward_meets or collectives.world_size() == 1:
        yield from batches
        return
    empty = None
    while True:
        batch = next(batches, _END)
        if not collectives.all_reduce(torch.tensor(0 if batch is _END else 1), "max"):
            return
        if batch is _END:
            if empty is None:
                empty = zero_rows((collate_fn or default_collate)([_first_sample(dataset)]))
            yield empty
        else:
            empty = zero_rows(batch)
            yield batch


_END = object()


def _first_sample(dataset: Any) -> Any:
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return first_sample(dataset)
    return dataset[0]


def _stream_shard(
    dataset: Any, batch_size: int, num_workers: int, collate_fn: Callable[[list[Any]], Any] | None = None
) -> Any:
    """A :class:`~ddpkit.loop.streams.evaluation.StreamShard` for an ``IterableDataset``, else None."""
    from torch.utils.data import IterableDataset

    if not isinstance(dataset, IterableDataset):
        return None

    return StreamShard(dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_fn)


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module, check: str | None = None, given: Any = None) -> Iterator[None]:
    """``module`` in eval mode with gradients off (and the synced weights in place where it syncs
    infrequently) for the block, then back in the mode it was in; ``check``: the call that first
    makes sure every rank holds this model (:mod:`ddpkit.parallel.same_model`, a collective), ``given``
    as the script passed it."""
    was_training = module.training
    module.eval()
    try:
        # never one rank's local weights; statistics averaged once before, not at each forward
        with torch.no_grad(), periodic.synced_weights(module), lazy_buffers.quiet(module):
            if check is not None and not is_sharded(module):  # fsdp's ranks hold their own shards
                same_model.check(module, check, given)
            yield
    finally:
        module.train(was_training)


def _device_of(model: torch.nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


DEFAULT_BATCH = 256
"""Samples per forward on each rank where neither the call nor a loader it was given says."""


def unloaded(
    data: Any, what: str, batch_size: int | None, num_workers: int, collate_fn: Callable[[list[Any]], Any] | None
) -> tuple[Any, int, int, Callable[[list[Any]], Any] | None]:
    """``(dataset, batch_size, num_workers, collate_fn)`` for ``data``: a dataset as it is, or a loader
    (``rt.loader``'s, or a torch ``DataLoader``) read for its dataset, its batch a rank, its workers and
    its collate (where the call gives none). Evaluation takes every sample of the dataset exactly once,
    whatever order or padding the loader has; a loader that reads a part of its dataset is refused.

    Args:
        data: a dataset, or a loader of one.
        what: the call, for the message (``"ddpkit.evaluate"``).
        batch_size, num_workers, collate_fn: as the call was given them (None, 0, None: not given).

    Raises:
        UsageError: a loader that draws by weight, reads a subset (a sampler of its own), or does not batch;
            a ``batch_size`` that is not a positive integer.
    """
    from torch.utils.data import BatchSampler

    from ddpkit.loop.dataloaders import reads
    from ddpkit.loop.loader import LoaderPosition

    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise UsageError(f"{what}(batch_size={batch_size!r}): give the samples of each forward, a positive integer")
    fix = f"pass {what} the dataset itself ({what}(model, Subset(data, indices)) for a part)"
    if isinstance(data, LoaderPosition):  # rt.loader's
        sampler = getattr(data, "sampler", None)
        if getattr(sampler, "weights", None) is not None:
            raise UsageError(f"{what}: this rt.loader draws samples by weight (weights=); {fix}")
        full, world = getattr(sampler, "global_batch_size", 0), max(1, getattr(sampler, "world_size", 1))
        local = data.local_shards() if data.local_shards is not None else 0
        shares = local * world or world  # micro-shards: a shard's samples, the same on any world size
        per_rank = -(-full // shares) or DEFAULT_BATCH  # else its batch a rank (the larger share)
        given = batch_size if batch_size is not None else per_rank
        return data.dataset, given, num_workers or data.num_workers, collate_fn or data.collate_fn
    if isinstance(data, DataLoader):
        whole = reads(data) in ("stream", "in order", "shuffled", "split")  # (a rank's share: the dataset is whole)
        batches = type(data.batch_sampler)
        if data.batch_sampler is None or not whole or batches is not BatchSampler:
            problem = (
                "does not batch (batch_size=None)"
                if data.batch_sampler is None
                else f"reads the batches its {batches.__name__} makes, which may leave samples out"
                if whole
                else f"reads the samples its {type(data.sampler).__name__} picks, not every sample once"
            )
            raise UsageError(f"{what}: this DataLoader {problem}; {fix}")
        own = None if data.collate_fn is default_collate else data.collate_fn
        given = batch_size if batch_size is not None else data.batch_size or DEFAULT_BATCH
        return data.dataset, given, num_workers or data.num_workers, collate_fn or own
    return data, batch_size if batch_size is not None else DEFAULT_BATCH, num_workers, collate_fn


_TARGET_KEYS = ("labels", "label")  # Hugging Face's: its collators rename "label" to "labels"


def _target_key(batch: Mapping[Any, Any], target_key: str | None) -> Any:
    """The key of a mapping batch's targets: ``target_key``, else ``"labels"`` or ``"label"``; None: not there."""
    if target_key is not None:
        return target_key if target_key in batch else None
    return next((key for key in _TARGET_KEYS if key in batch), None)


def _inputs(batch: Any, target_key: str | None) -> Any:
    """A batch's inputs: a tuple's or list's first item, a mapping without its targets, else the batch."""
    if isinstance(batch, (list, tuple)):
        return batch[0]
    if isinstance(batch, Mapping):
        key = _target_key(batch, target_key)
        return remapped(batch, {k: v for k, v in batch.items() if k != key})
    return batch


def _inputs_and_targets(batch: Any, target_key: str | None) -> tuple[Any, Any]:
    """(inputs, targets) of an ``(input, target)`` batch or of a mapping's (its targets under a key)."""
    if isinstance(batch, Mapping):
        key = _target_key(batch, target_key)
        if key is None:
            wanted = repr(target_key) if target_key is not None else "'labels' or 'label'"
            raise UsageError(
                f"evaluate: the samples are dicts with keys {sorted(map(str, batch))} and none is {wanted}, "
                "the targets; pass target_key= the key of the targets"
            )
        return _inputs(batch, key), batch[key]
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    shape = f"a {type(batch).__name__} of {len(batch)} items" if isinstance(batch, (list, tuple)) else "not a pair"
    raise UsageError(
        f"evaluate: a batch is {shape}; evaluate takes (input, target) samples, or dicts whose targets "
        "are under 'labels' (or target_key=)"
    )


def _forward(module: torch.nn.Module, inputs: Any) -> Any:
    """The model on a batch's inputs: a mapping's items as keyword arguments where ``forward`` takes
    them all by name (Hugging Face's ``model(**batch)``), else the inputs as its one argument."""
    if isinstance(inputs, Mapping) and _takes_keywords(module, inputs):
        return module(**inputs)
    return module(inputs)


def _takes_keywords(module: torch.nn.Module, inputs: Mapping[Any, Any]) -> bool:
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): a mapping's items by name
        return True
    required = {
        p.name for p in parameters if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    if not required <= set(inputs):  # forward(self, batch): the dict is its one argument
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return True
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return all(isinstance(key, str) and key in named for key in inputs)


def _scores(outputs: Any) -> Any:
    """A model's scores: its output when a tensor, else the output's ``logits`` (Hugging Face's outputs,
    a dict or an object with that attribute) where it has them, else the output as it is."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else outputs


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    dataset: Any,
    *,
    num_classes: int | None = None,
    batch_size: int | None = None,
    loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
    num_workers: int = 0,
    autocast: Callable[[], Any] | None = None,
    extra_metrics: Mapping[str, Any] | None = None,
    ignore_index: int = -100,
    class_dim: int = 1,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    target_key: str | None = None,
) -> dict[str, Any]:
    """Loss, accuracy, confusion matrix and per-class precision/recall/F1 over all of ``dataset`` (the loss
    alone without ``num_classes``).

    Every rank must call it. Returns plain Python numbers and lists, identical on every rank.

    A target is one class per sample (outputs ``(B, C)``, targets ``(B,)``), or one per position
    of a sequence or an image (outputs ``(B, C, T, ...)``, targets ``(B, T, ...)``, as
    ``F.cross_entropy`` takes them): then every position counts once, except those whose target is
    ``ignore_index`` (padding), and ``count``, ``accuracy`` and ``loss`` are per token. A language
    model's logits ``(B, T, V)`` are taken with ``class_dim=-1``::

        metrics = ddpkit.evaluate(model, val_set, num_classes=vocab_size, class_dim=-1)
        metrics["loss"]          # cross-entropy per token, over every token of val_set once

    Without ``num_classes`` the targets are values (a regression's, or soft labels) and only the loss
    is scored: ``loss`` is ``loss_fn``'s mean over the whole dataset, as ``reduction="mean"`` would give
    it on one batch of every sample, and ``count`` the terms it averages (``F.mse_loss``: every target
    element)::

        metrics = ddpkit.evaluate(model, val_set, loss_fn=F.mse_loss)   # {"count", "loss"}

    Args:
        model: the model as ``rt.setup`` returned it, or a plain one; left in the mode it was in.
        dataset: ``(input, target)`` samples, or dicts (Hugging Face's) whose targets are under
            ``target_key``: a map-style dataset, or a stream (an ``IterableDataset``). A loader
            (``rt.loader``'s, or a ``DataLoader`` that reads every sample) is read for its dataset, with
            its batch a rank (a micro-shard's under ``micro_shards``), workers and ``collate_fn`` where
            the call gives none.
        num_classes: classes of the targets: the width of the outputs and of the confusion matrix. None:
            the targets are values, and ``count`` and ``loss`` (and ``extra_metrics``) are returned.
        batch_size: samples per forward on each rank (None: a given loader's, else 256).
        loss_fn: called as ``loss_fn(output, target, reduction="sum")`` on each batch (with
            ``ignore_index`` too when it is ``F.cross_entropy`` or ``F.nll_loss``); the batches' sums are
            added exactly (``math.fsum``, in any order), and the ``loss`` returned is that sum divided by
            the samples (or tokens) counted. Without ``num_classes``, called with ``reduction="none"``,
            and its terms are summed and counted.
        num_workers: DataLoader workers per rank (0: the main process reads).
        autocast: makes the context each forward runs in (e.g. ``rt.autocast``); None: none.
        extra_metrics: torchmetrics metrics by name: each is reset first (a metric reused every epoch
            would otherwise accumulate the earlier epochs' samples), updated with ``(outputs, targets)``
            on this rank's unpadded shard and computed (synced) once at the end, so nothing is counted
            twice; their values are returned under their names.
        ignore_index: a target value that is not counted (padding), as ``F.cross_entropy`` has it.
        class_dim: the outputs' dimension of the classes: 1 (torch's convention) or -1 (``(B, T, C)``).
        collate_fn: makes a batch of samples, as a DataLoader's does (one that pads each batch to its
            longest sequence, with ``ignore_index`` in the targets' padding); None: torch's default.
        target_key: in dict samples, the key of the targets; None: ``"labels"``, else ``"label"``. The
            other items are the inputs, passed as keyword arguments (``model(**inputs)``) where the
            model's ``forward`` takes them all by name, else as one dict; a model output that is not a
            tensor gives its ``logits`` (Hugging Face's outputs).
    """
    if class_dim not in (1, -1):
        raise UsageError(
            f"evaluate(class_dim={class_dim}): the classes are in dimension 1 (torch's convention, "
            "(B, C, T)) or -1 ((B, T, C)); give 1 or -1"
        )
    if num_classes is None and class_dim != 1:
        raise UsageError(
            "evaluate(class_dim=-1) without num_classes: the outputs are scored as loss_fn takes them; give "
            "num_classes for class scores, or a loss_fn that takes (B, T, C) outputs"
        )
    dataset, batch_size, num_workers, collate_fn = unloaded(
        dataset, "ddpkit.evaluate", batch_size, num_workers, collate_fn
    )
    same_data.check(dataset, "ddpkit.evaluate")
    lazy_buffers.sync_buffers(model)  # BatchNorm statistics trained apart are averaged first
    module = unwrap(model)  # DDP's forward may broadcast buffers: a collective per batch
    device = _device_of(module)
    loss_sums: list[torch.Tensor] = []  # each batch's, summed exactly once every rank's are in
    classes = 0 if num_classes is None else num_classes  # 0: values, no confusion matrix
    confusion = torch.zeros(classes * classes, dtype=torch.long, device=device)
    terms = 0  # without classes: the loss's terms, this rank's
    for metric in (extra_metrics or {}).values():
        metric.reset()
    stream = _stream_shard(dataset, batch_size, num_workers, collate_fn)
    batches = _shard_batches(dataset, batch_size, num_workers, stream, collate_fn=collate_fn)
    with _eval_mode(module, check="ddpkit.evaluate", given=model):
        for batch in _lockstep(batches, module, dataset, collate_fn):
            outputs, targets = _scored(module, batch, device, target_key, autocast, num_classes, class_dim)
            if outputs.device != device:
                # fsdp's cpu_offload: the shards (the first parameter) on the host, the forward on the GPU
                device = outputs.device
                confusion = confusion.to(device)
            if num_classes is None:
                values = _value_terms(loss_fn, outputs, targets)
                terms += values.numel()
                loss_sums.append(values.double().sum().reshape(()))
                for metric in (extra_metrics or {}).values():
                    metric.update(outputs, targets)
                continue
            counted = targets != ignore_index
            truth, predicted = targets[counted], outputs.argmax(dim=1)[counted]
            if truth.numel() and not 0 <= int(truth.min()) <= int(truth.max()) < num_classes:
                raise UsageError(
                    f"evaluate: a target is {int(truth.min()) if truth.min() < 0 else int(truth.max())}, "
                    f"outside 0 to num_classes - 1 ({num_classes - 1}) and not ignore_index "
                    f"({ignore_index})"
                )
            if loss_fn in (F.cross_entropy, F.nll_loss):  # per position as rows: a deterministic CUDA kernel
                loss = loss_fn(*position_rows(outputs, targets), reduction="sum", ignore_index=ignore_index)
            else:
                loss = loss_fn(outputs, targets, reduction="sum")
            loss_sums.append(loss.double().reshape(()))
            confusion += torch.bincount(truth * num_classes + predicted, minlength=num_classes**2)
            for metric in (extra_metrics or {}).values():
                metric.update(outputs, targets)
        if extra_metrics and collectives.world_size() > 1:
            probe = None if loss_sums else lambda: (collate_fn or default_collate)([_first_sample(dataset)])
            _fill_empty_lists(extra_metrics, probe, module, device, target_key, autocast, num_classes, class_dim)
    if stream is not None:
        stream.total()  # a plain stream read alike on every rank, or one clear error
    where = loss_sums[-1].device if loss_sums else device  # (one copy to the host, not one a batch)
    loss_total = _exact_sum(torch.stack([t.to(where) for t in loss_sums]).cpu().tolist() if loss_sums else [])
    if num_classes is None:
        count = int(collectives.all_reduce(torch.tensor([terms], dtype=torch.long)).item())
        result: dict[str, Any] = {"count": count, "loss": loss_total / count if count else 0.0}
    else:
        result = _metrics(collectives.all_reduce(confusion.cpu()).view(classes, classes), loss_total)
    for name, metric in (extra_metrics or {}).items():
        value = metric.compute()  # torchmetrics syncs its states across ranks here
        result[name] = value.tolist() if isinstance(value, torch.Tensor) else value
    return result


def _fill_empty_lists(metrics: Mapping[str, Any], probe: Callable[[], Any] | None, *scoring: Any) -> None:
    """Where this rank read no batch (``probe``: makes a batch of one sample, else None; whole batches:
    their counts differ by one), give each metric whose states are lists (AUROC's scores) zero rows of a
    batch's outputs and targets, on every rank deciding alike: a metric that cannot take zero rows is
    refused in one line on every rank, not left to hang the others in its sync. Metrics of tensor
    states (counts) sync as they are. A torchmetrics list state never updated syncs as an empty float32
    ``(0,)``, which the ranks that read batches cannot gather with their ``(N, C)`` scores.

    Args:
        metrics: the call's ``extra_metrics``.
        probe: makes a batch of one sample where this rank read no batch; None where it read one.
        scoring: :func:`_scored`'s arguments after the batch.
    """
    listed = {
        name: metric
        for name, metric in metrics.items()
        if any(isinstance(state, list) for state in getattr(metric, "metric_state", {}).values())
    }
    if not listed:
        return
    failed = None
    if probe is not None:
        try:
            outputs, targets = _scored(scoring[0], probe(), *scoring[1:])
            for metric in listed.values():
                metric.update(outputs[:0], targets[:0])
        except Exception as exc:  # the metric's own check: said on every rank below
            failed = f"{type(exc).__name__}: {exc}".splitlines()[0]
    said = [text for text in collectives.all_gather_object(failed) if text is not None]
    if said:
        raise UsageError(
            f"evaluate: a rank read no batch (each reads whole batches), and extra_metrics "
            f"{sorted(listed)}, whose states are lists, cannot take zero rows there ({said[0]}); pass a "
            "smaller batch_size, so that every rank reads a batch"
        )


def _scored(
    module: torch.nn.Module,
    batch: Any,
    device: torch.device,
    target_key: str | None,
    autocast: Callable[[], Any] | None,
    num_classes: int | None,
    class_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's scores (with ``num_classes``: classes in dimension 1), in float32 or float64 (half precision's in float32),
    and its targets on the scores' device (fsdp's ``cpu_offload`` forwards elsewhere than ``device``, where
    the model's first parameter lies).

    Args:
        module: the model, in eval mode.
        batch: a collated batch.
        device: where the model's first parameter lies: the inputs go there.
        target_key, autocast, num_classes, class_dim: as :func:`evaluate` was given them.
    """
    inputs, targets = _inputs_and_targets(batch, target_key)
    with autocast() if autocast is not None else contextlib.nullcontext():
        outputs = _scores(_forward(module, to_device(inputs, device)))
    targets = to_device(targets, outputs.device if isinstance(outputs, torch.Tensor) else device)
    if num_classes is None:  # values: scored as loss_fn takes them
        _tensors(outputs, targets, "targets")
    else:
        outputs = _classes_first(outputs, targets, num_classes, class_dim)
    if outputs.dtype not in (torch.float32, torch.float64):  # half precision: the loss in float32
        outputs = outputs.float()  # float64 outputs keep their precision
    return outputs, targets


def _exact_sum(values: list[float]) -> float:
    """The sum of every rank's ``values``, exactly rounded: the same bits whatever order they come in and
    however the ranks split them (a float sum of partial sums depends on both)."""
    if collectives.world_size() > 1:
        values = [value for part in collectives.all_gather_object(values) for value in part]
    try:
        return math.fsum(values)
    except (ValueError, OverflowError):  # +inf and -inf, or a sum past the largest float: as a plain sum
        return float(sum(values))


def _tensors(outputs: Any, targets: Any, kind: str) -> None:
    """Refuse, in one line, outputs or targets that are not tensors (``kind``: what the targets should hold)."""
    if not isinstance(outputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise UsageError(
            f"evaluate: the model returned a {type(outputs).__name__} and the targets are a "
            f"{type(targets).__name__}; evaluate takes a tensor of scores (or an output with a logits "
            f"tensor) and a tensor of {kind}"
        )


def _value_terms(loss_fn: Callable[..., torch.Tensor], outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``loss_fn``'s terms (``reduction="none"``) for targets that are values, with the two mistakes
    refused in one line each: class indices given no ``num_classes``, and shapes that broadcast both
    ways (``(N, 1)`` outputs against ``(N,)`` targets: ``F.mse_loss`` pairs every output with every
    target). A loss whose terms outnumber its inputs (a contrastive one's ``N x N``) is taken as it is."""
    if loss_fn in (F.cross_entropy, F.nll_loss) and not targets.is_floating_point():
        raise UsageError(
            f"evaluate: the targets are class indices (dtype {targets.dtype}) and num_classes "
            f"is not given: pass num_classes={outputs.shape[1] if outputs.dim() > 1 else 'C'} for "
            "accuracy and the confusion matrix, or a loss_fn of your own to score the loss alone"
        )
    if outputs.shape != targets.shape:
        try:
            both = torch.broadcast_shapes(outputs.shape, targets.shape)
        except RuntimeError:  # shapes a loss_fn of the script's may take as they are
            both = None
        if both is not None and both not in (outputs.shape, targets.shape):
            raise UsageError(
                f"evaluate: outputs of shape {tuple(outputs.shape)} and targets of shape "
                f"{tuple(targets.shape)} broadcast to {tuple(both)}, every output against every target; "
                "give the targets the outputs' shape (targets.view_as(outputs) in the dataset or collate_fn)"
            )
    return loss_fn(outputs, targets, reduction="none")


def _classes_first(outputs: Any, targets: Any, num_classes: int, class_dim: int) -> torch.Tensor:
    """The outputs with the classes in dimension 1, checked against the targets in one line each."""
    _tensors(outputs, targets, "class indices")
    if outputs.dim() < 2:
        raise UsageError(
            f"evaluate: outputs of shape {tuple(outputs.shape)} have no class dimension; return "
            "(B, C) scores, or (B, C, T, ...) for one class per position"
        )
    if class_dim == -1 and outputs.dim() > 2:
        outputs = outputs.movedim(-1, 1)
    wanted = (outputs.shape[0], *outputs.shape[2:])
    if targets.is_floating_point() or targets.is_complex() or tuple(targets.shape) != wanted:
        hint = (
            " (a language model's (B, T, V) logits: pass class_dim=-1)"
            if class_dim == 1
            and outputs.dim() == 3
            and outputs.shape[-1] == num_classes
            and outputs.shape[1] == targets.shape[-1]
            else ""
        )
        raise UsageError(
            f"evaluate: targets of shape {tuple(targets.shape)} and dtype {targets.dtype} do not "
            f"go with outputs of shape {tuple(outputs.shape)} (classes in dimension 1): give one "
            f"integer class per sample, shape {wanted}{hint}"
            + ("; values (a regression's): leave num_classes out" if targets.is_floating_point() else "")
        )
    if outputs.shape[1] != num_classes:
        raise UsageError(
            f"evaluate: outputs have {outputs.shape[1]} classes in dimension 1, num_classes is {num_classes}"
        )
    return outputs


def _metrics(confusion: torch.Tensor, loss_total: float) -> dict[str, Any]:
    count = int(confusion.sum())
    correct = int(confusion.diag().sum())
    true_positive = confusion.diag().double()
    predicted = confusion.sum(dim=0).double()
    actual = confusion.sum(dim=1).double()
    precision = torch.where(predicted > 0, true_positive / predicted.clamp(min=1), torch.zeros_like(predicted))
    recall = torch.where(actual > 0, true_positive / actual.clamp(min=1), torch.zeros_like(actual))
    f1 = torch.where(
        precision + recall > 0,
        2 * precision * recall / (precision + recall).clamp(min=1e-300),
        torch.zeros_like(precision),
    )
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


def _run_shard(
    module: torch.nn.Module,
    dataset: Any,
    batch_size: int,
    num_workers: int,
    autocast: Callable[[], Any] | None = None,
    stream: Any = None,
    positions: list[list[int]] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    *,
    what: str = "ddpkit.predict",
    given: Any = None,
    target_key: str | None = None,
) -> Iterator[Any]:
    """The model's outputs (on the CPU) for each batch of this rank's shard, in order (``what`` and
    ``given``: the call and the model as passed, for the check that every rank holds it)."""
    device = _device_of(module)
    batches = _shard_batches(dataset, batch_size, num_workers, stream, positions, collate_fn)
    with _eval_mode(module, check=what, given=given):
        for batch in _lockstep(batches, module, dataset, collate_fn):
            inputs = _inputs(batch, target_key)
            with autocast() if autocast is not None else contextlib.nullcontext():
                outputs = _forward(module, to_device(inputs, device))
            yield _map(lambda t: t.detach().cpu(), outputs)


def predict(
    model: torch.nn.Module,
    dataset: Any,
    *,
    batch_size: int | None = None,
    to: str = "main",
    num_workers: int = 0,
    autocast: Callable[[], Any] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    target_key: str | None = None,
) -> Any:
    """Outputs for every sample exactly once, in dataset order: first dimension ``len(dataset)``.

    Works for models returning a tensor, or a tuple/list/dict of tensors (the same
    structure comes back, each leaf gathered; a dataclass, such as a Hugging Face output, comes
    back as a dict of its tensor fields). Every rank must call it.

    Args:
        model: the model as ``rt.setup`` returned it, or a plain one; left in the mode it was in.
        dataset: a map-style dataset, or a stream (an ``IterableDataset``); a sample's first item
            is the input when it is a tuple or list; a dict's items but its targets are (Hugging Face's
            samples), passed as keyword arguments where ``forward`` takes them all by name, else as
            one dict; anything else is the input whole. A loader (``rt.loader``'s, or a ``DataLoader``
            that reads every sample) is read for its dataset, in dataset order, with its batch a rank,
            workers and ``collate_fn`` where the call gives none.
        batch_size: samples per forward on each rank (None: a given loader's, else 256).
        to: ``"main"`` returns the result on rank 0 and None elsewhere; ``"all"`` on every rank.
        num_workers: DataLoader workers per rank (0: the main process reads).
        autocast: makes the context each forward runs in (e.g. ``rt.autocast``), as in training.
        collate_fn: makes a batch of samples, as a DataLoader's does; None: torch's default. The
            outputs of every batch must agree beyond their first dimension (one row per sample, or
            padded to a fixed length), as they are joined.
        target_key: in dict samples, the key of the targets, which the model is not given; None:
            ``"labels"``, else ``"label"``.
    """
    if to not in ("main", "all"):
        raise UsageError(f"predict(to={to!r}): use 'main' or 'all'")
    dataset, batch_size, num_workers, collate_fn = unloaded(
        dataset, "ddpkit.predict", batch_size, num_workers, collate_fn
    )
    same_data.check(dataset, "ddpkit.predict")  # first: a rank whose dataset alone is empty is named there
    stream = _stream_shard(dataset, batch_size, num_workers, collate_fn)
    if stream is None and len(dataset) == 0 or stream is not None and stream.known_length == 0:
        raise UsageError("predict: the dataset is empty")
    lazy_buffers.sync_buffers(model)
    module = unwrap(model)
    positions: list[list[int]] = []
    outputs = list(
        _run_shard(
            module,
            dataset,
            batch_size,
            num_workers,
            autocast,
            stream,
            positions,
            collate_fn,
            given=model,
            target_key=target_key,
        )
    )
    if stream is not None and stream.total() == 0:
        raise UsageError("predict: the stream is empty")
    local = _joined(outputs, collate_fn)  # on every rank: each takes part in its check of the shapes
    if local is None:  # this rank read no batch
        local = _empty_output(module, dataset, collate_fn, target_key)
    if stream is None:
        read = len(batch_shard(len(dataset), batch_size, collectives.rank(), collectives.world_size()))
    else:
        read = sum(len(part) for part in positions)
    _one_row_per_sample(local, read)
    collect = collectives.all_gather if to == "all" else collectives.gather
    gathered = _map(collect, local)
    if stream is None:  # contiguous shards concatenated in rank order are the dataset order
        return gathered if to == "all" or collectives.rank() == 0 else None
    where = collect(torch.tensor([i for part in positions for i in part], dtype=torch.long))
    if to == "main" and collectives.rank() != 0:
        return None
    assert where is not None  # gathered on every rank with to="all", on rank 0 with to="main"
    order = torch.argsort(where)
    if not torch.equal(where[order], torch.arange(len(where))):
        raise DdpkitError(f"internal: predict read stream indices {where.tolist()[:20]}..., not each once")
    return _map(lambda t: t[order], gathered)


def _one_row_per_sample(local: Any, read: int) -> None:
    """Refuse, on every rank alike, outputs that are not one row per sample read: they cannot be put in
    dataset order (a collate_fn that leaves out samples read as None made 27 rows of 32, silently)."""
    rows: list[int] = []
    map_tensors(lambda t: rows.append(t.shape[0] if t.dim() else 1), local)
    counts = torch.tensor([min(rows, default=read), read, int(any(r != read for r in rows))], dtype=torch.long)
    totals = collectives.all_reduce(counts)
    if int(totals[2]):
        raise rows_refused("predict", int(totals[0]), int(totals[1]))


def rows_refused(what: str, rows: int, samples: int) -> UsageError:
    """The one line of ``predict`` and ``predict_to_file`` for outputs that are not one row per sample."""
    return UsageError(
        f"{what}: the outputs hold {rows} rows for the {samples} samples read, so they cannot be put in dataset "
        "order (a collate_fn that leaves out samples read as None makes fewer; a model whose outputs are not one "
        "row per sample, other counts); return one row per sample (a placeholder for a sample that failed to read)"
    )


def _map(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, (type, Mapping)):
        value = {
            f.name: getattr(value, f.name) for f in dataclasses.fields(value) if getattr(value, f.name) is not None
        }
    try:
        return map_tensors(fn, value, strict=True)
    except TypeError as exc:
        raise UsageError(
            f"predict: the model returned a {exc}; return tensors or tuples, lists or dicts of tensors"
        ) from None


def _empty_output(
    module: torch.nn.Module,
    dataset: Any,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    target_key: str | None = None,
) -> Any:
    """Zero rows with the right trailing shape, from one sample (a rank with an empty shard)."""
    sample = _first_sample(dataset)
    inputs = _inputs((collate_fn or default_collate)([sample]), target_key)
    with _eval_mode(module):
        out = _forward(module, to_device(inputs, _device_of(module)))
    return _map(lambda t: t.detach().cpu()[:0], out)


def _trailing(batch: Any) -> tuple[tuple[int, ...], ...]:
    """Each tensor's shape past the first dimension, in the batch's order."""
    leaves: list[tuple[int, ...]] = []

    def note(t: torch.Tensor) -> torch.Tensor:
        leaves.append(tuple(t.shape[1:]))
        return t

    map_tensors(note, batch)
    return tuple(leaves)


def _joined(outputs: list[Any], collate_fn: Callable[[list[Any]], Any] | None) -> Any:
    """This rank's outputs, one batch after another (None: it read none); with a ``collate_fn`` of the
    script's, every rank, one that read no batch too, first learns whether all batches of all ranks agree
    beyond their first dimension (a collate that pads each batch to its own longest makes them differ), so
    each refuses in the same line."""
    if collate_fn is None:
        return concat_batches(outputs) if outputs else None
    shapes = {_trailing(batch) for batch in outputs}
    if collectives.world_size() > 1:
        shapes = set().union(*collectives.all_gather_object(shapes))
    if len(shapes) > 1:
        shown = " and ".join(str(shape[0] if len(shape) == 1 else shape) for shape in sorted(shapes)[:2])
        raise UsageError(
            f"predict: the outputs of the batches differ beyond their first dimension ({shown}), as a "
            "collate_fn that pads each batch to its own longest makes them; pad to a fixed length, or "
            "return one row per sample"
        )
    return concat_batches(outputs) if outputs else None
