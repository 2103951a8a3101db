"""A rank's part of a stream for :func:`ddpkit.evaluate` and :func:`ddpkit.predict`.

Every sample is read by exactly one rank: :class:`ddpkit.Shards` in contiguous stretches of the
stream (each rank reads only its shards), a plain stream in chunks of ``batch_size`` dealt round
robin to ranks and workers (each reads all of it). Batches carry their stream indices, so
predictions go back into stream order. No collective runs per batch; a plain stream's length
is compared across ranks once at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, default_collate

from ddpkit.distributed import collectives
from ddpkit.errors import DdpkitError
from ddpkit.loop.streams.lengths import ensure_lengths
from ddpkit.loop.streams.order import EpochOrder
from ddpkit.loop.streams.pieces import Pieces, as_is, warn_plain_stream
from ddpkit.loop.streams.shards import ShardError, Shards, read_range
from ddpkit.observe import heartbeats


class StreamShard:
    """This rank's batches of a stream, each with the stream indices of its samples."""

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ):
        self.dataset, self.num_workers = dataset, num_workers
        self.rank, self.world_size = collectives.rank(), collectives.world_size()
        self.pieces = Pieces(
            dataset,
            mode="eval",
            rank=self.rank,
            world_size=self.world_size,
            batch_size=batch_size,
            shuffle=False,
            seed=0,
            drop_last=False,
            collate_fn=collate_fn or default_collate,
        )
        progress = self.pieces.progress
        heartbeats.watch(lambda: int(progress[0]))
        self.seen, self.first = -1, 0
        if isinstance(dataset, Shards):
            ensure_lengths(
                dataset, num_workers=num_workers, rank=self.rank, world_size=self.world_size, progress=self.pieces.tick
            )
            assert dataset.lengths is not None  # ensure_lengths set them
            self.seen = sum(dataset.lengths)
        elif self.rank == 0:
            warn_plain_stream(dataset, self.world_size, num_workers, "to evaluate its share")

    @property
    def known_length(self) -> int | None:
        """Samples in the stream, known before reading for :class:`ddpkit.Shards`; None for a plain stream."""
        return self.seen if isinstance(self.dataset, Shards) else None

    def batches(self) -> Iterator[tuple[list[int], Any]]:
        """(stream indices, batch) of this rank's chunks; a plain stream's end is noted for :meth:`total`."""
        loader = DataLoader(
            self.pieces,
            batch_size=None,
            collate_fn=as_is,  # type: ignore[arg-type]  # batch_size=None: each piece, not a list (torch's stub)
            num_workers=self.num_workers,
        )
        for piece in loader:
            if piece["error"] is not None:
                raise ShardError(piece["error"])
            if piece["b"] == -1:
                self.seen, self.first = max(self.seen, int(piece["seen"])), int(piece["fp"])
                continue
            yield piece["pos"], piece["batch"]

    def total(self) -> int:
        """Samples in the stream, the same on every rank (a collective for a plain stream)."""
        if isinstance(self.dataset, Shards) or self.world_size == 1:
            return self.seen
        every = collectives.all_gather_object((self.seen, self.first))
        lengths = [seen for seen, _ in every]
        if len(set(every)) > 1:
            raise DdpkitError(
                f"the ranks read different streams from {type(self.dataset).__name__} "
                f"({', '.join(map(str, lengths))} samples by rank, first samples "
                f"{'alike' if len({f for _, f in every}) == 1 else 'differ'}); ddpkit splits a plain stream "
                "itself, so it must yield the same samples on every rank (does it split itself "
                "by rank?); or use ddpkit.Shards"
            )
        return lengths[0]


def first_sample(dataset: Any) -> Any:
    """The stream's first sample (for the output shape on a rank that had none)."""
    if isinstance(dataset, Shards):
        assert dataset.lengths is not None  # the StreamShard that evaluated it learned them (ensure_lengths)
        order = EpochOrder(dataset.lengths, shuffle=False, seed=0, epoch=0)
        for _, sample in read_range(dataset, order, 0, 1, seed=0):
            return sample
    for sample in dataset:
        return sample
    raise DdpkitError(f"the stream {type(dataset).__name__} is empty")
