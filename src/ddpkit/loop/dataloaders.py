"""``rt.loader(a_dataloader)``: a ``DataLoader`` a script already has, read as ``rt.loader`` reads its dataset.

Its ``batch_size`` is the global batch (what its one process reads at each step, on any world
size), and what its sampler chooses becomes ``rt.loader``'s options: a ``RandomSampler`` is
``shuffle=True``, a ``WeightedRandomSampler`` is ``weights=`` and ``num_samples=``. The order is keyed
by the run's seed and the epoch, not by the DataLoader's generator. A DataLoader whose samples or
batches ``rt.loader`` cannot choose alike (a batch sampler or a sampler of its own, a
``DistributedSampler``) is refused in one line that shows the call to write instead.

Example:
    >>> import torch
    >>> from torch.utils.data import DataLoader
    >>> data = list(range(10))
    >>> dataset, options = from_dataloader(DataLoader(data, batch_size=4, shuffle=True), {})
    >>> dataset is data, options
    (True, {'global_batch_size': 4, 'shuffle': True, 'drop_last': False})
"""

from __future__ import annotations

from typing import Any

from ddpkit.errors import UsageError

__all__ = ["from_dataloader", "reads"]


def reads(loader: Any) -> str:
    """What a ``DataLoader``'s sampler reads of its dataset, for ``rt.loader`` and ``ddpkit.evaluate``
    alike: ``"stream"`` (an ``IterableDataset``), ``"in order"`` (a ``SequentialSampler``),
    ``"shuffled"`` (a ``RandomSampler`` of every sample once), ``"split"`` (a ``DistributedSampler``: a
    rank's share), ``"drawn"`` (with replacement: a ``RandomSampler``'s or a ``WeightedRandomSampler``'s
    draws), else ``"picked"`` (a sampler of its own, or one drawing a part without replacement)."""
    from torch.utils.data import IterableDataset, RandomSampler, SequentialSampler, WeightedRandomSampler
    from torch.utils.data.distributed import DistributedSampler

    sampler = loader.sampler
    if isinstance(loader.dataset, IterableDataset):
        return "stream"
    if type(sampler) is SequentialSampler:
        return "in order"
    if isinstance(sampler, DistributedSampler):
        return "split"
    if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == len(loader.dataset):
        return "shuffled"
    if type(sampler) in (RandomSampler, WeightedRandomSampler) and sampler.replacement:
        return "drawn"
    return "picked"


def from_dataloader(loader: Any, given: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The dataset of ``loader`` and ``rt.loader``'s keyword arguments that read it as ``loader`` does.

    Args:
        loader: a ``torch.utils.data.DataLoader``.
        given: the keyword arguments the script gave ``rt.loader`` beside it; they win.

    Raises:
        UsageError: a DataLoader that does not batch, makes its batches with a batch sampler of its
            own, or picks its samples with a sampler ``rt.loader`` cannot draw alike.
    """
    from torch.utils.data import BatchSampler
    from torch.utils.data._utils.collate import default_collate

    size = loader.batch_size
    instead = f"rt.loader(loader.dataset, global_batch_size={size or 'N'}, ...)"
    if loader.batch_sampler is None:
        raise UsageError(f"rt.loader: this DataLoader does not batch (batch_size=None); pass {instead}")
    if type(loader.batch_sampler) is not BatchSampler:
        raise UsageError(
            f"rt.loader: this DataLoader makes its batches with its {type(loader.batch_sampler).__name__}, "
            f"and rt.loader cuts the global batches itself (the same on any world size); pass {instead}, "
            "with lengths=[one per sample] for batches of samples of similar length"
        )
    options: dict[str, Any] = {"global_batch_size": size}
    sampler, kind = loader.sampler, reads(loader)
    if kind in ("stream", "in order"):
        pass
    elif kind == "split":
        raise UsageError(
            f"rt.loader: this DataLoader's DistributedSampler splits the data over the ranks, and rt.loader "
            f"splits it itself (the same batches on any world size); pass the dataset: "
            f"rt.loader(loader.dataset, batch_size={size}, shuffle={sampler.shuffle}) for {size} a process, "
            f"or global_batch_size= for the same batches on any number of processes"
        )
    elif kind == "shuffled":
        options["shuffle"] = True
    elif kind == "drawn":
        weights = getattr(sampler, "weights", None)  # a RandomSampler's are uniform
        options["weights"] = [1.0] * len(loader.dataset) if weights is None else weights
        options["num_samples"] = sampler.num_samples
    else:
        picks = "draws without replacement" if getattr(sampler, "replacement", True) is False else "picks its samples"
        raise UsageError(
            f"rt.loader: this DataLoader's {type(sampler).__name__} {picks}, which rt.loader cannot draw alike "
            f"on every world size; pass {instead} with shuffle=True, or weights= (drawn with replacement)"
        )
    options["drop_last"] = loader.drop_last
    if loader.collate_fn is not default_collate:
        options["collate_fn"] = loader.collate_fn
    if loader.num_workers:
        options.update(num_workers=loader.num_workers, prefetch_factor=loader.prefetch_factor)
        if loader.persistent_workers:
            options["persistent_workers"] = True
    if loader.pin_memory:  # False is the DataLoader's default: rt.loader's own (on CUDA) stays
        options["pin_memory"] = True
    if loader.worker_init_fn is not None:
        options["worker_init_fn"] = loader.worker_init_fn
    if "batch_size" in given:
        del options["global_batch_size"]
    return loader.dataset, {**options, **given}  # (rt.loader drops workers' options where there are none)
