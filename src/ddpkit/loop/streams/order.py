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
from collections.abc import Sequence

import torch

from ddpkit.loop.sampler import shard_range


class Layout:
    """Global batches of ``length`` samples (``drop_last`` cuts the tail) as columns; see module doc."""

    def __init__(self, length: int, *, global_batch_size: int, drop_last: bool = False):
        size = global_batch_size
        self.global_batch_size = size
        self.length = length // size * size if drop_last else length
        self.batches = -(-self.length // size)
        self.last = self.length - (self.batches - 1) * size if self.batches else 0

    def column_length(self, column: int) -> int:
        """Rows of ``column``: one per global batch, one fewer in the columns the short last batch lacks."""
        return self.batches if column < self.last else max(0, self.batches - 1)

    def column_start(self, column: int) -> int:
        """Position in the epoch's order of ``column``'s first row (columns lie end to end)."""
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
        """The ``global_batch_size // world_size`` consecutive columns that ``rank`` reads."""
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
    """The shards of one epoch in order (permuted with ``shuffle``), their samples end to end.

    Position ``p`` lies in shard ``locate(p)[0]`` at that offset; ``natural[shard]`` is the
    stream index of a shard's first sample. Shuffling within windows happens per column, in
    :func:`column_rows`, so a column reader reads only its own stretch.
    """

    def __init__(self, lengths: Sequence[int], *, shuffle: bool, seed: int, epoch: int):
        self.lengths = list(lengths)
        self.shuffle, self.seed, self.epoch = shuffle, seed, epoch
        count = len(self.lengths)
        self.order = permutation(count, seed, epoch) if shuffle and count > 1 else list(range(count))
        self.starts = [0, *itertools.accumulate(self.lengths[s] for s in self.order)]
        self.natural = [0, *itertools.accumulate(self.lengths)]

    @property
    def length(self) -> int:
        """Samples in the epoch: every shard's, end to end."""
        return self.starts[-1]

    def locate(self, position: int) -> tuple[int, int]:
        """(shard, offset) of ``position``."""
        slot = bisect.bisect_right(self.starts, position) - 1
        while self.lengths[self.order[slot]] == 0:  # empty shards share a start
            slot += 1
        return self.order[slot], position - self.starts[slot]


def window_rows(rows: int, window: int, row: int, *key: int) -> tuple[int, list[int]]:
    """The shuffle window of a column holding ``row``: its first row and the order of its rows.

    Windows are aligned to the column's start.

    Args:
        rows: rows in the column (the last window may be shorter).
        window: rows per shuffle window.
        row: a row of the column (0 is its first); its window is returned.
        *key: integers keying the order (seed, epoch, column), the same on every rank and worker.
    """
    first = row // window * window
    size = min(window, rows - first)
    return first, [first + i for i in permutation(size, *key, first)]
