"""Sharding that does not depend on the number of processes, and per-sample randomness.

The data order of an epoch is a permutation keyed by ``seed + epoch`` (the same one
``DistributedSampler`` draws). It is cut into *global* batches, the same for any world
size; rank ``r`` of ``W`` takes positions ``r, r+W, ...`` of each global batch. When the
sizes divide, this is exactly what ``DistributedSampler`` + ``DataLoader`` give each rank;
when they do not, the last global batch is split unevenly (never padded with duplicates)
and :meth:`ShardedLoader.batch_weight` tells the loss how to weigh it.

Example:
    >>> sampler = GlobalBatchSampler(10, global_batch_size=4, rank=1, world_size=2)
    >>> [list(b) for b in sampler.batches(epoch=0)]
    [[1, 3], [5, 7], [9]]
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ddpkit.errors import UsageError


class GlobalBatchSampler:
    """Index lists of one rank's part of each global batch (pure: rank and world size are arguments)."""

    def __init__(self, length: int, *, global_batch_size: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False):
        if global_batch_size < 1:
            raise UsageError(f"batch size must be at least 1, got {global_batch_size}")
        self.length = length
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last

    def __len__(self) -> int:
        """Steps per epoch (the same on every rank)."""
        if self.drop_last:
            return self.length // self.global_batch_size
        return -(-self.length // self.global_batch_size)

    def order(self, epoch: int) -> list[int]:
        """The global order of dataset indices in ``epoch``."""
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.length, generator=generator).tolist()

    def global_batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        """Every global batch of ``epoch`` from step ``start`` on."""
        order = self.order(epoch)
        size = self.global_batch_size
        for step in range(start, len(self)):
            yield order[step * size:(step + 1) * size]

    def global_count(self, index: int) -> int:
        """Samples in global batch ``index`` of a pass (the last one may be short; 0 past the end)."""
        if not 0 <= index < len(self):
            return 0
        return min(self.global_batch_size, self.length - index * self.global_batch_size)

    def local_part(self, global_batch: list[int]) -> list[int]:
        """This rank's strided part of one global batch (possibly empty in a short last batch)."""
        return global_batch[self.rank::self.world_size]

    def batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        """This rank's part of each global batch."""
        for batch in self.global_batches(epoch, start):
            yield self.local_part(batch)


# -- per-sample randomness ------------------------------------------------------------

@dataclass(frozen=True)
class SampleKey:
    """Which sample is being read: the run's seed, the epoch and the dataset index."""

    seed: int
    epoch: int
    index: int


_current_key: SampleKey | None = None


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample in one epoch, independent of rank, worker and world size."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def sample_rng(device: str | torch.device = "cpu") -> torch.Generator:
    """A generator for augmentations of the sample being read, keyed by (seed, epoch, index).

    Call it inside ``Dataset.__getitem__`` (or a transform) of a dataset read through a ddpkit
    loader. Augmentations then differ across samples and epochs but never change with the
    number of processes or workers.

    Example:
        >>> class Noisy(torch.utils.data.Dataset):
        ...     def __len__(self): return 4
        ...     def __getitem__(self, i):
        ...         return torch.randn(2, generator=ddpkit.sample_rng())   # doctest: +SKIP
    """
    if _current_key is None:
        raise RuntimeError("sample_rng() is only available while a ddpkit loader reads a sample")
    key = _current_key
    return torch.Generator(device=device).manual_seed(sample_seed(key.seed, key.epoch, key.index))


def current_sample() -> SampleKey | None:
    """The (seed, epoch, index) of the sample being read, or None outside a ddpkit loader."""
    return _current_key


class _KeyedDataset(Dataset):
    """Reads ``dataset[index]`` with the sample's key set, so :func:`sample_rng` can see it."""

    def __init__(self, dataset: Any, seed: int):
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        global _current_key
        epoch, index = key
        _current_key = SampleKey(self.seed, epoch, index)
        try:
            return self.dataset[index]
        finally:
            _current_key = None


class _EpochBatches:
    """The batch sampler handed to DataLoader: the loader's plan for the pass it is starting."""

    def __init__(self, loader: "ShardedLoader"):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader.sampler)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.loader.epoch
        for local, _ in self.loader._plan:
            # An empty part still reads one sample so collate sees a batch; it is cut away later.
            yield [(epoch, index) for index in (local or [0])]


class ShardedLoader:
    """An iterable of batches already on the device, sharded by :class:`GlobalBatchSampler`.

    Knows its epoch and its position inside the epoch, so a checkpoint can resume mid-epoch,
    and the true sample counts of the current batch, so the loss can weigh an uneven last batch.
    """

    def __init__(self, dataset: Any, sampler: GlobalBatchSampler, *, device: torch.device,
                 num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None,
                 seed: int = 0, on_batch: Callable[["ShardedLoader"], None] | None = None):
        self.dataset = dataset
        self.sampler = sampler
        self.device = device
        self.epoch = 0
        self.position = 0          # batches handed out in the current epoch
        self.local_count = 0       # samples of this rank in the current batch
        self.global_count = 0      # samples of all ranks in the current batch
        self._plan: list[tuple[list[int], int]] = []   # (local part, global size) of each batch left
        self._on_batch = on_batch
        pin = device.type == "cuda"
        self._loader = DataLoader(
            _KeyedDataset(dataset, seed), batch_sampler=_EpochBatches(self),
            num_workers=num_workers, collate_fn=collate_fn or default_collate, pin_memory=pin,
            persistent_workers=num_workers > 0, prefetch_factor=2 if num_workers > 0 else None,
            generator=private_generator(seed),
        )

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch (ddpkit's ``epochs()`` calls this for you)."""
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def __iter__(self) -> Iterator[Any]:
        if self.position >= len(self.sampler):
            self.position = 0      # a finished epoch iterated again starts from its beginning
        # One permutation per pass: the DataLoader's batch sampler reads this plan too.
        self._plan = [(self.sampler.local_part(batch), len(batch))
                      for batch in self.sampler.global_batches(self.epoch, self.position)]
        for batch, (local, total) in zip(self._loader, self._plan):
            if not local:
                batch = _take_rows(batch, 0)
            self.position += 1
            self.local_count, self.global_count = len(local), total
            if self._on_batch is not None:
                self._on_batch(self)
            yield to_device(batch, self.device)
        # The position stays at the end: a checkpoint taken now says "this epoch is done".

    def batch_weight(self) -> float:
        """Factor that turns this rank's mean loss into its share of the global-batch mean.

        DDP averages gradients over ``W`` ranks, so rank ``r`` must contribute
        ``sum_r / n_global * W`` = ``mean_r * n_r * W / n_global``.
        """
        if self.global_count == 0:
            return 1.0
        return self.local_count * self.sampler.world_size / self.global_count

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def private_generator(seed: int = 0) -> torch.Generator:
    """A generator for a DataLoader's worker base seed.

    Without one, every ``iter(DataLoader)`` draws from the global torch RNG, so a run resumed
    mid-epoch (one more iterator) would see other dropout masks than an uninterrupted run.
    """
    return torch.Generator().manual_seed(seed)


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any, *, strict: bool = False) -> Any:
    """Apply ``fn`` to every tensor of a (nested) batch: tensors, dicts, lists, tuples, namedtuples.

    Other leaves come back unchanged, or raise ``TypeError`` with ``strict=True``.
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {key: map_tensors(fn, value, strict=strict) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        mapped = [map_tensors(fn, value, strict=strict) for value in batch]
        return type(batch)(*mapped) if hasattr(batch, "_fields") else type(batch)(mapped)
    if strict:
        raise TypeError(type(batch).__name__)
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``; non-blocking from pinned memory."""
    return map_tensors(lambda t: t.to(device, non_blocking=device.type == "cuda"), batch)


def _take_rows(batch: Any, count: int) -> Any:
    return map_tensors(lambda t: t[:count], batch)


def check_batch_sizes(world_size: int, batch_size: int | None, global_batch_size: int | None) -> int:
    """The global batch size from exactly one of the two sizes.

    Raises:
        UsageError: both or neither given, or a global size that the world size does not divide.
    """
    if (batch_size is None) == (global_batch_size is None):
        raise UsageError("give exactly one of batch_size (per process) or global_batch_size")
    if batch_size is not None:
        if batch_size < 1:
            raise UsageError(f"batch_size must be at least 1, got {batch_size}")
        return batch_size * world_size
    if global_batch_size < 1:
        raise UsageError(f"global_batch_size must be at least 1, got {global_batch_size}")
    if global_batch_size % world_size:
        raise UsageError(
            f"global batch size {global_batch_size} does not divide by the world size {world_size}; "
            f"use a multiple of {world_size} (e.g. {global_batch_size - global_batch_size % world_size or world_size})"
        )
    return global_batch_size


def shard_range(length: int, rank: int, world_size: int) -> range:
    """A contiguous, disjoint shard of ``range(length)`` for evaluation; sizes differ by at most one."""
    base, extra = divmod(length, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def rows_per_rank(length: int, world_size: int) -> Sequence[int]:
    """Sizes of :func:`shard_range` for every rank."""
    return [len(shard_range(length, r, world_size)) for r in range(world_size)]
