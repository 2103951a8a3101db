"""``rt.loader``: a map-style dataset becomes a :class:`~ddpkit.loop.loader.ShardedLoader`, an
``IterableDataset`` a :class:`~ddpkit.loop.streams.loader.StreamLoader`, registered with the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any, TypedDict

import torch

from ddpkit.errors import UsageError, warn
from ddpkit.loop import same_data
from ddpkit.loop.loader import QuorumLoader, ShardedLoader
from ddpkit.loop.sampler import GlobalBatchSampler, check_batch_sizes
from ddpkit.loop.streams.loader import StreamLoader
from ddpkit.state.run import RunState


@dataclass(frozen=True)
class LoaderOptions:
    """How ``rt.loader`` reads a dataset (its keyword arguments)."""

    batch_size: int | None = None
    """Samples per batch per process; the global batch then grows with the world size."""
    global_batch_size: int | None = None
    """Samples per batch across all processes: every world size visits the same samples in each batch.
    A batch is one optimizer step, or one micro-step of ``rt.accumulate(model, k)``, whose step
    takes ``k`` batches."""
    shuffle: bool = False
    """A new order every epoch, keyed by the run's seed and the epoch."""
    drop_last: bool = False
    """Leave out the last, short global batch."""
    num_workers: int = 0
    """DataLoader worker processes."""
    collate_fn: Callable[[list[Any]], Any] | None = None
    """Makes a batch of samples (the DataLoader's default when None)."""
    name: str | None = None
    """Keys the loader's position in checkpoints (default: the dataset's type name)."""
    weights: Any = None
    """One per sample: each epoch draws ``num_samples`` with replacement (map-style data only)."""
    num_samples: int | None = None
    """Samples drawn per epoch with ``weights`` (default: all)."""
    lengths: Any = None
    """One per sample (its tokens, say): each global batch holds samples of similar length, as Hugging Face's
    ``group_by_length`` gives (:meth:`ddpkit.loop.sampler.GlobalBatchSampler.order`), the same on any world size."""
    pin_memory: bool | None = None
    """DataLoader's pin_memory (default: on CUDA)."""
    prefetch_factor: int | None = None
    """DataLoader's prefetch_factor."""
    persistent_workers: bool | None = None
    """DataLoader's persistent_workers (default: on with workers)."""
    worker_init_fn: Callable[[int], None] | None = None
    """Run in each worker after ddpkit seeds it."""


class _CommonOptions(TypedDict):
    """The keyword arguments that every kind of loader takes alike."""

    device: torch.device
    num_workers: int
    collate_fn: Callable[[list[Any]], Any] | None
    seed: int
    on_batch: Callable[[Any], None]
    pin_memory: bool | None
    prefetch_factor: int | None
    persistent_workers: bool | None
    worker_init_fn: Callable[[int], None] | None


def loader_options(given: dict[str, Any]) -> LoaderOptions:
    """``rt.loader``'s keyword arguments as :class:`LoaderOptions`; an unknown name is a TypeError."""
    known = {f.name for f in fields(LoaderOptions)}
    unknown = sorted(set(given) - known)
    if unknown:
        hint = (
            " (rt.loader draws the samples itself: shuffle=True for a RandomSampler, weights= and num_samples= "
            "for a WeightedRandomSampler; or pass it a DataLoader that has the sampler)"
            if unknown[0] in ("sampler", "batch_sampler")
            else ""
        )
        raise TypeError(
            f"rt.loader() got an unexpected keyword argument {unknown[0]!r}; it takes {', '.join(sorted(known))}{hint}"
        )
    return LoaderOptions(**given)


def build_loader(
    run: RunState,
    dataset: Any,
    options: LoaderOptions,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    on_batch: Callable[[Any], None],
    watch: Callable[[Callable[[], int]], None],
) -> Any:
    """Make and register the loader of ``dataset`` for this rank.

    Args:
        run: the run whose loop registers the loader (and its saved position, if any).
        dataset: a map-style dataset or an ``IterableDataset``.
        options: ``rt.loader``'s keyword arguments.
        rank: this process's global rank.
        world_size: processes of the job.
        device: where batches go.
        on_batch: called with the loader each time it hands out a batch.
        watch: registers a probe of samples read by workers, as progress for the watchdog.
    """
    total = check_batch_sizes(world_size, options.batch_size, options.global_batch_size)
    if not run.local_first:  # (there local rank 0 runs the block alone: a collective would wait for the others)
        same_data.check(dataset, "rt.loader", options.lengths)  # every rank cuts the same data (a collective)
    seed = run.seed or 0
    common = _CommonOptions(
        device=device,
        num_workers=options.num_workers,
        collate_fn=options.collate_fn,
        seed=seed,
        on_batch=on_batch,
        pin_memory=options.pin_memory,
        prefetch_factor=options.prefetch_factor,
        persistent_workers=options.persistent_workers,
        worker_init_fn=options.worker_init_fn,
    )
    quorum = run.world.quorum  # a fault-tolerant replica: batches split over each step's quorum
    if _is_stream(dataset):
        if quorum is not None:
            raise UsageError(
                "--fault-tolerant does not read streams yet (an IterableDataset); give a map-style dataset"
            )
        if options.weights is not None or options.num_samples is not None or options.lengths is not None:
            raise UsageError(
                "weights=, num_samples= and lengths= need a map-style dataset (they order its indices); "
                "a stream is read in its own order"
            )

        made: Any = StreamLoader(
            dataset,
            global_batch_size=total,
            rank=rank,
            world_size=world_size,
            shuffle=options.shuffle,
            drop_last=options.drop_last,
            watch=watch,
            **common,
        )
        made.local_shards = lambda: run.local_micro_shards  # a collate_fn of the script's makes each shard
    elif quorum is not None:
        if options.num_workers:
            raise UsageError(
                "--fault-tolerant reads samples in the training process, between quorums: "
                "drop num_workers (each replica is one process)"
            )
        sampler = GlobalBatchSampler(
            len(dataset),
            global_batch_size=total,
            rank=0,
            world_size=1,
            shuffle=options.shuffle,
            seed=seed,
            drop_last=options.drop_last,
            weights=options.weights,
            num_samples=options.num_samples,
            lengths=options.lengths,
        )
        made = QuorumLoader(dataset, sampler, replica=quorum, **common)
        made.local_shards = lambda: run.local_micro_shards
    else:
        sampler = GlobalBatchSampler(
            len(dataset),
            global_batch_size=total,
            rank=rank,
            world_size=world_size,
            shuffle=options.shuffle,
            seed=seed,
            drop_last=options.drop_last,
            weights=options.weights,
            num_samples=options.num_samples,
            lengths=options.lengths,
        )
        made = ShardedLoader(dataset, sampler, **common)
        # micro-shards over 4 or more ranks: neighbouring ranks (one node's) hold the shards the tree adds
        # first, so the exchange's first rounds stay on a node (the same bits either way)
        made.reversed_slots = lambda: run.micro_shards
        made.local_shards = lambda: run.local_micro_shards  # a collate_fn of the script's makes each shard
    if not _is_stream(dataset) and rank == 0 and len(made) == 0:
        _say_empty(made.sampler.length, total, options.drop_last)  # (num_samples=, where drawn)
    run.loop.register(made, options.name)
    return made


def _say_empty(length: int, total: int, drop_last: bool) -> None:
    """Warn (rank 0) that a pass over the loader reads nothing, as a DataLoader of no batch would silently."""
    if length == 0:
        why, fix = "its dataset holds no sample", "check how the dataset was built or split"
    else:
        why = f"its {length} sample(s) fill no global batch of {total} and drop_last=True drops the rest"
        fix = "give a smaller global_batch_size, or drop_last=False"
    warn(f"rt.loader: {why}, so a pass over it reads nothing; {fix}")


def _is_stream(dataset: Any) -> bool:
    """An ``IterableDataset`` (read as a stream); a bare iterator or generator is refused."""
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset):
        return True
    if isinstance(dataset, Iterator) and not hasattr(dataset, "__getitem__"):
        raise UsageError(
            f"rt.loader got a {type(dataset).__name__}, which can be read only once; wrap it "
            "in a torch IterableDataset whose __iter__ starts it anew each epoch"
        )
    return False
