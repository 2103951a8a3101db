"""Sharding that does not depend on the number of processes: the global-batch sampler and shard ranges.

The data order of an epoch is a permutation keyed by ``seed + epoch`` (the same one
``DistributedSampler`` draws). It is cut into *global* batches, the same for any world
size; rank ``r`` of ``W`` takes positions ``r, r+W, ...`` of each global batch. When the
sizes divide, this is exactly what ``DistributedSampler`` + ``DataLoader`` give each rank;
when they do not, the last global batch is split unevenly (never padded with duplicates)
and :meth:`ddpkit.loop.loader.ShardedLoader.batch_weight` tells the loss how to weigh it.
With ``weights``, each epoch draws its order with replacement (like ``WeightedRandomSampler``),
keyed the same way, so weighted sampling does not depend on the world size either.

Example:
    >>> sampler = GlobalBatchSampler(10, global_batch_size=4, rank=1, world_size=2)
    >>> [list(b) for b in sampler.batches(epoch=0)]
    [[1, 3], [5, 7], [9]]
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ddpkit.errors import UsageError
from ddpkit.parallel.exact_tree import reversed_bits


class GlobalBatchSampler:
    """Index lists of one rank's part of each global batch (pure: rank and world size are arguments)."""

    def __init__(
        self,
        length: int,
        *,
        global_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        weights: Sequence[float] | torch.Tensor | None = None,
        num_samples: int | None = None,
        lengths: Sequence[int] | torch.Tensor | None = None,
    ):
        if global_batch_size < 1:
            raise UsageError(f"batch size must be at least 1, got {global_batch_size}")
        self.weights = None if weights is None else _check_weights(weights, length)
        if lengths is not None and self.weights is not None:
            raise UsageError(
                "lengths= groups the samples of an epoch's order and weights= draws them with replacement; give one"
            )
        self.lengths = None if lengths is None else _check_lengths(lengths, length)
        if num_samples is not None and (self.weights is None or num_samples < 1):
            raise UsageError("num_samples needs weights=... and must be at least 1")
        self.dataset_length = length
        if self.weights is not None:
            length = len(self.weights) if num_samples is None else num_samples
        self.length = length
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.reversed_slots = False
        """The rank reads the strided part of its rank's bits reversed (micro-shards over 4 or more ranks:
        neighbouring ranks, one node's, then hold the shards the fixed tree adds first; see :attr:`slot`)."""
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last

    loader: Callable[[], Any] | None = None
    """A weak reference to the loader that reads this sampler (set by the loader)."""

    def set_epoch(self, epoch: int) -> None:
        """torch's ``DistributedSampler.set_epoch``, as scripts call it on ``loader.sampler``: sets the
        epoch of the loader that reads this sampler (``rt.epochs`` does it for you)."""
        owner = self.loader() if self.loader is not None else None
        if owner is None:
            raise UsageError(
                "sampler.set_epoch: this sampler belongs to no ddpkit loader; call loader.set_epoch(epoch)"
            )
        owner.set_epoch(epoch)

    def __len__(self) -> int:
        """Steps per epoch (the same on every rank)."""
        if self.drop_last:
            return self.length // self.global_batch_size
        return -(-self.length // self.global_batch_size)

    def order(self, epoch: int) -> list[int]:
        """The global order of dataset indices in ``epoch``."""
        if self.weights is not None:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            return torch.multinomial(self.weights, self.length, replacement=True, generator=generator).tolist()
        if not self.shuffle:
            order = list(range(self.length))
        else:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.length, generator=generator).tolist()
        return order if self.lengths is None else self._grouped(order)

    GROUP = 50
    """At most this many global batches a group sorted by length (Hugging Face's ``LengthGroupedSampler``)."""

    def _grouped(self, order: list[int]) -> list[int]:
        """``order`` cut into groups of global batches, each sorted by length, longest first (ties in their
        order), then the longest sample of all moved to the front: a batch pads little, and a run too long for
        memory fails at its first step. A group holds ``min(samples // (4 x batch), 50)`` batches (at least one),
        as Hugging Face's ``get_length_grouped_indices``, so a small dataset still shuffles between epochs."""
        assert self.lengths is not None
        lengths = self.lengths
        size = max(1, min(len(order) // (4 * self.global_batch_size), self.GROUP)) * self.global_batch_size
        groups = [sorted(order[i : i + size], key=lambda index: -lengths[index]) for i in range(0, len(order), size)]
        longest = max(range(len(groups)), key=lambda g: lengths[groups[g][0]], default=0)
        if longest:
            groups[0][0], groups[longest][0] = groups[longest][0], groups[0][0]
        return [index for group in groups for index in group]

    def signature(self) -> dict[str, Any]:
        """What must match for a saved position to name the same batches again (plain data)."""
        grouped = {} if self.lengths is None else {"by_length": _digest(self.lengths)}  # (absent: as before lengths=)
        return {
            **grouped,
            "length": self.dataset_length,
            "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "weighted": self.weights is not None,
            "samples": self.length,
        }

    def global_batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        """Every global batch of ``epoch`` from step ``start`` on."""
        order = self.order(epoch)
        size = self.global_batch_size
        for step in range(start, len(self)):
            yield order[step * size : (step + 1) * size]

    def global_count(self, index: int) -> int:
        """Samples in global batch ``index`` of a pass (the last one may be short; 0 past the end)."""
        if not 0 <= index < len(self):
            return 0
        return min(self.global_batch_size, self.length - index * self.global_batch_size)

    @property
    def slot(self) -> int:
        """Which strided part of each global batch this rank reads: its rank, or its rank's
        ``log2(world_size)`` bits reversed (:attr:`reversed_slots`; 2 and 1 of 4 ranks trade)."""
        return reversed_bits(self.rank, self.world_size) if self.reversed_slots else self.rank

    def local_part(self, global_batch: list[int]) -> list[int]:
        """This rank's strided part of one global batch (possibly empty in a short last batch)."""
        return global_batch[self.slot :: self.world_size]

    def batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        """This rank's part of each global batch."""
        for batch in self.global_batches(epoch, start):
            yield self.local_part(batch)


def _check_weights(weights: Sequence[float] | torch.Tensor, length: int) -> torch.Tensor:
    tensor = torch.as_tensor(weights, dtype=torch.float64).flatten()
    if len(tensor) != length:
        raise UsageError(f"weights has {len(tensor)} entries for a dataset of {length}; give one per sample")
    if bool((tensor < 0).any()) or not bool(torch.isfinite(tensor).all()) or float(tensor.sum()) <= 0:
        raise UsageError("weights must be finite, non-negative and not all zero")
    return tensor


def _digest(values: list[int]) -> str:
    """A short digest of ``lengths=``: a saved position is resumed only in the order the same lengths make."""
    return hashlib.sha256(str(values).encode()).hexdigest()[:16]


def _check_lengths(lengths: Sequence[int] | torch.Tensor, length: int) -> list[int]:
    values = torch.as_tensor(lengths).flatten()
    if len(values) != length or values.is_floating_point() or values.is_complex() or bool((values < 0).any()):
        raise UsageError(
            f"lengths= needs one non-negative whole number per sample (its tokens, say); got {len(values)} "
            f"{values.dtype} value(s) for a dataset of {length}"
        )
    return values.tolist()


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
    assert global_batch_size is not None  # exactly one of the two was given, and not batch_size
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


def batch_shard(length: int, batch_size: int, rank: int, world_size: int) -> range:
    """This rank's samples for evaluation: a contiguous run of whole batches of ``batch_size`` laid from
    sample 0, the batches split as :func:`shard_range` splits samples (counts differ by at most one).

    Every batch holds the same samples on any world size, so each forward gives the same bits (a
    kernel's result for a row can depend on how many rows it is given):

    >>> [batch_shard(10, 4, r, 2) for r in range(2)], [batch_shard(10, 4, r, 1) for r in range(1)]
    ([range(0, 8), range(8, 10)], [range(0, 10)])

    Args:
        length: samples in the dataset.
        batch_size: samples per batch (the last batch may hold fewer).
        rank: this process's rank.
        world_size: processes that share the batches.
    """
    batches = shard_range(-(-length // batch_size), rank, world_size)
    return range(min(length, batches.start * batch_size), min(length, batches.stop * batch_size))


def rows_per_rank(length: int, world_size: int) -> Sequence[int]:
    """Sizes of :func:`shard_range` for every rank."""
    return [len(shard_range(length, r, world_size)) for r in range(world_size)]
