"""The loader of a stream: the same contract as :class:`ddpkit.loop.loader.ShardedLoader`.

Each ``iter(loader)`` starts the epoch (after ``rt.load``: continues the saved one), every rank
takes the same number of steps, a short last global batch is split unevenly and weighed by
:meth:`StreamLoader.batch_weight`. The position saved in a checkpoint is the number of global
batches done, so a :class:`ddpkit.Shards` run resumes on any world size and worker count, and a
plain stream (read whole by every rank) does too.

A plain stream's length is not known in advance. Ranks agree once per batch (one small
all-reduce) that they read the same amount of it, so a stream that yields different samples
on different ranks (one that splits itself by rank) is one clear error, never a hang.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate

from ddpkit import rng
from ddpkit.distributed import collectives
from ddpkit.errors import DdpkitError
from ddpkit.loop.batch import to_device
from ddpkit.loop.loader import LoaderPosition, ShardCollate, collate_shards
from ddpkit.loop.streams.lengths import ensure_lengths
from ddpkit.loop.streams.order import Layout
from ddpkit.loop.streams.pieces import Pieces, RawSamples, as_is, join, warn_once, warn_plain_stream
from ddpkit.loop.streams.shards import Shards
from ddpkit.observe import worker_stacks


class StreamPlan:
    """The part of :class:`ddpkit.loop.sampler.GlobalBatchSampler`'s interface the training loop reads."""

    def __init__(
        self, layout: Layout | None, global_batch_size: int, rank: int, world_size: int, signature: dict[str, Any]
    ):
        self.layout, self.global_batch_size = layout, global_batch_size
        self.rank, self.world_size = rank, world_size
        self._signature = signature

    def __len__(self) -> int:
        if self.layout is None:
            raise TypeError("a plain stream's number of batches is not known before it ends")
        return self.layout.batches

    def global_count(self, index: int) -> int:
        """Samples in global batch ``index`` (the last one may be short; 0 past the end or for a plain stream)."""
        return self.layout.batch_count(index) if self.layout is not None else 0

    def signature(self) -> dict[str, Any]:
        """What must match for a saved position to name the same batches again (plain data)."""
        return dict(self._signature)

    loader: Callable[[], Any] | None = None
    """A weak reference to the loader that reads this plan (set by the loader)."""

    def set_epoch(self, epoch: int) -> None:
        """``loader.sampler.set_epoch(epoch)``, torch's habit: sets the epoch of the loader reading this plan."""
        owner = self.loader() if self.loader is not None else None
        if owner is not None:
            owner.set_epoch(epoch)


class StreamLoader(LoaderPosition):
    """Batches of this rank's share of each global batch of a stream, on the device."""

    cuts_global_batches = True
    """Its batches are this rank's share of fixed global batches: micro-shards can cut them."""

    def __init__(
        self,
        dataset: Any,
        *,
        global_batch_size: int,
        rank: int,
        world_size: int,
        device: torch.device,
        shuffle: bool = False,
        drop_last: bool = False,
        seed: int = 0,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        on_batch: Callable[[StreamLoader], None] | None = None,
        pin_memory: bool | None = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        watch: Callable[[Callable[[], int]], None] | None = None,
    ):
        self.dataset = dataset
        self.device = device
        self._user_collate = collate_fn
        self.num_workers = num_workers
        self._start_positions(None, on_batch)
        self.positions: list[int] = []  # stream indices of this rank's current batch
        self.is_shards = isinstance(dataset, Shards)
        signature = {
            "stream": type(dataset).__name__,
            "global_batch_size": global_batch_size,
            "shuffle": shuffle,
            "seed": seed,
            "drop_last": drop_last,
            "weighted": False,
        }
        self._pieces = Pieces(
            dataset,
            mode="train",
            rank=rank,
            world_size=world_size,
            batch_size=global_batch_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            collate_fn=ShardCollate(collate_fn) if collate_fn is not None else default_collate,  # (counts Nones)
        )
        if watch is not None:
            progress = self._pieces.progress
            watch(lambda: int(progress[0]))
        layout = None
        if self.is_shards:
            ensure_lengths(
                dataset, num_workers=num_workers, rank=rank, world_size=world_size, progress=self._pieces.tick
            )
            layout = Layout(sum(dataset.lengths), global_batch_size=global_batch_size, drop_last=drop_last)
            signature.update(
                length=sum(dataset.lengths),
                samples=layout.length,
                shards=len(dataset.shards),
                window=dataset.shuffle_window if shuffle else None,
            )
            if layout.batches == 0 and rank == 0:
                warn_once(
                    f"empty:{id(dataset)}",
                    f"ddpkit: the stream has {sum(dataset.lengths)} samples, "
                    f"fewer than one global batch of {global_batch_size}; drop_last leaves no batches",
                )
        else:
            signature.update(length=None, samples=None)
            if rank == 0:
                warn_plain_stream(dataset, world_size, num_workers, "and keeps its share")
        self.sampler = StreamPlan(layout, global_batch_size, rank, world_size, signature)
        self.sampler.loader = weakref.ref(self)
        self._parts = max(1, num_workers) if self.is_shards else 1
        workers = num_workers > 0
        self._pieces.user_worker_init = worker_init_fn
        self._loader = DataLoader(
            self._pieces,
            batch_size=None,
            collate_fn=as_is,  # type: ignore[arg-type]  # batch_size=None: each piece, not a list (torch's stub)
            num_workers=num_workers,
            pin_memory=device.type == "cuda" if pin_memory is None else pin_memory,
            persistent_workers=workers if persistent_workers is None else persistent_workers and workers,
            prefetch_factor=(prefetch_factor or 2) if workers else None,
            worker_init_fn=self._pieces.seed_worker if workers else None,
            generator=rng.private_generator(seed),
        )
        if workers:
            worker_stacks.add(self)

    @property
    def contiguous_split(self) -> bool:
        """Whether a rank's share is a contiguous run of the global batch (ddpkit.Shards' columns), not every W-th sample."""
        return self.is_shards

    @property
    def length_known(self) -> bool:  # type: ignore[override]
        """Whether the number of batches is known before the pass ends (Shards: yes; a plain stream: no)."""
        return self.sampler.layout is not None

    def position_record(self) -> dict[str, Any]:
        """As a map-style loader's, plus the global sample count it stands at."""
        return {**super().position_record(), "samples": self.position * self.sampler.global_batch_size}

    def __repr__(self) -> str:
        return (
            f"StreamLoader(name={self.name!r}, dataset={self.dataset!r}, epoch={self.epoch}, position={self.position})"
        )

    # -- iteration --------------------------------------------------------------------------
    def _collate(self, samples: RawSamples, shards: int) -> Any:
        """The rank's batch collated here from its samples as they are (and each micro-shard alone):
        a ``ddpkit.Shards`` stream lays the shards end to end, a plain one deals them out in turn."""
        runs = None
        if self.is_shards and shards > 1:
            runs = self.sampler.global_batch_size // (shards * self.sampler.world_size)
        assert self._user_collate is not None
        key = (self._pieces.seed, self.epoch, list(self.positions))  # each call keyed by its samples' positions
        return self._take_parts(collate_shards(self._user_collate, list(samples), shards, runs, key=key))

    def __iter__(self) -> Iterator[Any]:
        start, this_pass = self._begin_pass()
        shards = self._local_shards()
        # a collate of the script's runs here where a batch is joined from several workers' pieces or
        # cut into micro-shards: each piece padded to its own longest sample would not join, or cut alike
        raw = self._user_collate is not None and (self._parts > 1 or shards > 1)
        self._pieces.control[0], self._pieces.control[1], self._pieces.control[2] = self.epoch, start, int(raw)
        self.shard_batches = None
        expected, ran_out = start, False
        try:
            with worker_stacks.starting_workers():
                pieces = iter(self._loader)
            self._reading = weakref.ref(pieces)  # (weakly: a pass's workers end with its iterator, as before)
            for b, local, batch, count, seen in join(pieces, self._parts):
                self._check_pass(this_pass)
                if b != expected:
                    raise DdpkitError(f"internal: stream batch {b} arrived where {expected} was due")
                expected += 1
                if not self.is_shards:
                    self._agree(1, *seen)
                self.position += 1
                self.positions, self.local_count, self.global_count = local, len(local), count
                batch = self._collate(batch, shards) if isinstance(batch, RawSamples) else self._take_parts(batch)
                self.whole_batch = batch = to_device(batch, self.device)
                if self._on_batch is not None:
                    self._on_batch(self)
                yield batch
            if not self.is_shards:
                self._agree(0, -1, 0)
            elif expected != len(self):
                raise DdpkitError(f"internal: the stream pass ended after {expected} of {len(self)} batches")
            ran_out = True
        finally:
            self._end_pass(this_pass, ran_out=ran_out)

    def _agree(self, more: int, seen: int, digest: int) -> None:
        """Ranks of a plain stream check they read the same: as much of it, and the same first
        sample of the global batch (all of them see the result, so all of them stop)."""
        if self.sampler.world_size == 1:
            return
        value = torch.tensor([more, seen, digest, -more, -seen, -digest], dtype=torch.int64)
        top = collectives.all_reduce(value, "max").tolist()
        if top[0] != -top[3] or (more and (top[1] != -top[4] or top[2] != -top[5])):
            raise DdpkitError(
                f"the ranks read different streams from {type(self.dataset).__name__}: at "
                f"batch {self.position} some have {'more' if top[0] else 'no more'} samples "
                "than others. ddpkit splits a plain stream itself, so it must yield the "
                "same samples on every rank (does it split itself by rank?); or use ddpkit.Shards"
            )
