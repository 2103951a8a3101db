"""Where each sample of a stream goes: pure functions of lengths, seed, epoch, rank and world size.

A stream of known length ``N`` read in global batches of ``G`` is laid out as ``G`` *columns*:
column ``j`` is a contiguous run of the epoch's sample order, and global batch ``b`` takes row
``b`` of every column. The last batch is the short one (it has a row only in the first columns),
exactly one batch is short, and which samples form batch ``b`` depends on ``N``, ``G``, the seed
and the epoch only. Rank ``r`` of ``W`` takes columns ``[r*G/W, (r+1)*G/W)``: one contiguous
stretch of the epoch's order, so it reads only the shards that hold it.

Example:
    >>> layout = Layout(10, global_batch_size=4)
    >>> [layout.batch_positions(b) for b in range(layout.batches)]
    [[0, 3, 6, 8], [1, 4, 7, 9], [2, 5]]
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from typing import Sequence

import torch

from ddpkit.data import shard_range


class Layout:
    """Global batches of ``length`` samples (``drop_last`` cuts the tail) as columns; see module doc."""

    def __init__(self, length: int, *, global_batch_size: int, drop_last: bool = False):
        size = global_batch_size
        self.global_batch_size = size
        self.length = length // size * size if drop_last else length
        self.batches = -(-self.length // size)
        self.last = self.length - (self.batches - 1) * size if self.batches else 0

    def column_length(self, column: int) -> int:
        return self.batches if column < self.last else max(0, self.batches - 1)

    def column_start(self, column: int) -> int:
        return column * max(0, self.batches - 1) + min(column, self.last)

    def batch_count(self, batch: int) -> int:
        """Samples in global batch ``batch`` (the last one may be short; 0 past the end)."""
        if not 0 <= batch < self.batches:
            return 0
        return self.global_batch_size if batch < self.batches - 1 else self.last

    def batch_positions(self, batch: int) -> list[int]:
        """Positions in the epoch's order of the samples of global batch ``batch``, column by column."""
        return [self.column_start(j) + batch for j in range(self.batch_count(batch))]

    def rank_columns(self, rank: int, world_size: int) -> range:
        per_rank = self.global_batch_size // world_size
        return range(rank * per_rank, (rank + 1) * per_rank)


def worker_columns(columns: range, worker: int, workers: int) -> range:
    """A worker's contiguous part of its rank's columns (possibly none)."""
    part = shard_range(len(columns), worker, workers)
    return range(columns.start + part.start, columns.start + part.stop)


def permutation(size: int, *key: int) -> list[int]:
    """A permutation of ``range(size)`` keyed by integers (the same on every rank and worker)."""
    digest = hashlib.blake2b(("stream:" + ":".join(map(str, key))).encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return torch.randperm(size, generator=generator).tolist()


class EpochOrder:
    """The sample order of one epoch of shards: shards permuted, samples permuted in windows.

    Position ``p`` of the epoch's order lies in shard slot ``i`` (``order[i]`` is the shard) at
    ``offset``; within that shard it is the ``read_index(shard, offset)``-th sample ``read``
    yields. Windows are aligned to the start of each shard, so no window spans two shards.
    """

    def __init__(self, lengths: Sequence[int], *, shuffle: bool, seed: int, epoch: int, window: int):
        self.lengths = list(lengths)
        self.shuffle, self.seed, self.epoch, self.window = shuffle, seed, epoch, window
        count = len(self.lengths)
        self.order = permutation(count, seed, epoch) if shuffle and count > 1 else list(range(count))
        self.starts = [0, *itertools.accumulate(self.lengths[s] for s in self.order)]
        self.natural = [0, *itertools.accumulate(self.lengths)]
        self._perms: dict[tuple[int, int], list[int]] = {}

    @property
    def length(self) -> int:
        return self.starts[-1]

    def locate(self, position: int) -> tuple[int, int]:
        """(shard, offset) of ``position``."""
        slot = bisect.bisect_right(self.starts, position) - 1
        while self.lengths[self.order[slot]] == 0:     # empty shards share a start
            slot += 1
        return self.order[slot], position - self.starts[slot]

    def window_of(self, shard: int, offset: int) -> tuple[int, int]:
        """(first read index, size) of the shuffle window holding ``offset`` of ``shard``."""
        if not self.shuffle:
            return offset, 1
        base = offset // self.window * self.window
        return base, min(self.window, self.lengths[shard] - base)

    def read_index(self, shard: int, offset: int) -> int:
        base, size = self.window_of(shard, offset)
        if size == 1:
            return base + (offset - base)
        key = (shard, base)
        perm = self._perms.get(key)
        if perm is None:
            if len(self._perms) > 64:
                self._perms.clear()
            perm = self._perms[key] = permutation(size, self.seed, self.epoch, shard, base)
        return base + perm[offset - base]
