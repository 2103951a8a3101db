"""Reading the shards of :class:`ddpkit.Shards`: in order, from a start, counted, with errors that
name the shard. Every call into the user's ``read`` runs with worker info hidden (see
:func:`ddpkit._torch.worker_info_hidden`) and sets the sample's key for :func:`ddpkit.sample_rng`.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Iterator

from torch.utils.data import DataLoader, Dataset

from ddpkit import data
from ddpkit._torch import worker_info_hidden
from ddpkit.streams.order import EpochOrder
from ddpkit.streams.shards import ShardError, Shards


def shard_name(shards: Shards, shard: int) -> str:
    value = shards.shards[shard]
    return os.fspath(value) if isinstance(value, (str, os.PathLike)) else repr(value)


def _open(shards: Shards, shard: int, start: int) -> tuple[Iterator[Any], int]:
    """An iterator over ``shard`` and the read index it yields first (``start`` if read can skip)."""
    try:
        with worker_info_hidden():
            if shards.takes_start and start:
                return iter(shards.read(shards.shards[shard], start)), start
            return iter(shards.read(shards.shards[shard])), 0
    except Exception as exc:   # the user's read: name the shard, whatever it raised
        raise ShardError(f"shard {shard_name(shards, shard)} failed to open: {type(exc).__name__}: {exc}") from exc


def _next(shards: Shards, shard: int, it: Iterator[Any], index: int, key: data.SampleKey | None) -> Any:
    """The next sample of ``shard`` (read index ``index``); a short shard or an error names it."""
    data._current_key = key
    try:
        with worker_info_hidden():
            return next(it)
    except StopIteration:
        expected = shards.lengths[shard] if shards.lengths is not None else index
        raise ShardError(f"shard {shard_name(shards, shard)} ended after {index} samples, but its length "
                         f"is {expected}; it changed since its length was counted (pass lengths= "
                         f"or delete {shards.cache_file() or 'the cached lengths'})") from None
    except ShardError:
        raise
    except Exception as exc:
        raise ShardError(f"shard {shard_name(shards, shard)} failed at sample {index}: "
                         f"{type(exc).__name__}: {exc}") from exc
    finally:
        data._current_key = None


def _check_end(shards: Shards, shard: int, it: Iterator[Any]) -> None:
    try:
        with worker_info_hidden():
            next(it)
    except StopIteration:
        return
    except Exception:
        return      # an error past the last counted sample: not one of ours to read
    raise ShardError(f"shard {shard_name(shards, shard)} yields more than its length "
                     f"{shards.lengths[shard]}; it changed since its length was counted (pass "
                     f"lengths= or delete {shards.cache_file() or 'the cached lengths'})")


def read_shard(shards: Shards, order: EpochOrder, shard: int, first: int, stop: int,
               seed: int, progress: Callable[[], None] | None = None) -> Iterator[tuple[int, Any]]:
    """(stream index, sample) for samples ``[first, stop)`` of ``shard``, read in order."""
    it, index = _open(shards, shard, first)
    natural = order.natural[shard]
    try:
        if index < first:                          # skip what read could not
            _warn_skip(shards, shard, first - index)
        while index < first:
            _next(shards, shard, it, index, None)
            index += 1
        while index < stop:
            item = _next(shards, shard, it, index, data.SampleKey(seed, order.epoch, natural + index))
            if progress is not None:
                progress()
            yield natural + index, item
            index += 1
        if index == order.lengths[shard]:
            _check_end(shards, shard, it)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


_SKIP_WARNING = 1000
_skip_warned = False


def _warn_skip(shards: Shards, shard: int, count: int) -> None:
    global _skip_warned
    if count >= _SKIP_WARNING and not _skip_warned:
        _skip_warned = True
        warnings.warn(f"ddpkit: read({shard_name(shards, shard)}) cannot start mid-shard, so {count} samples "
                      "were read and dropped to reach a reader's first sample; give read a second "
                      "parameter, read(shard, start), that starts at sample start", stacklevel=2)


def read_range(shards: Shards, order: EpochOrder, first: int, stop: int, *, seed: int,
               progress: Callable[[], None] | None = None) -> Iterator[tuple[int, Any]]:
    """(stream index, sample) for positions ``[first, stop)`` of the epoch's order, lazily."""
    position = first
    while position < stop:
        shard, offset = order.locate(position)
        end = min(order.lengths[shard], offset + stop - position)
        yield from read_shard(shards, order, shard, offset, end, seed, progress)
        position += end - offset


def count_shard(shards: Shards, shard: int, progress: Callable[[], None] | None = None) -> int:
    """Samples in ``shard``, by reading it (without a key: nothing random is drawn for counting)."""
    it, _ = _open(shards, shard, 0)
    count = 0
    try:
        while True:
            try:
                with worker_info_hidden():
                    next(it)
            except StopIteration:
                return count
            except Exception as exc:
                raise ShardError(f"shard {shard_name(shards, shard)} failed at sample {count}: "
                                 f"{type(exc).__name__}: {exc}") from exc
            count += 1
            if progress is not None:
                progress()
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


# -- learning lengths ---------------------------------------------------------------------

class _Counting(Dataset):
    """Counts shards in DataLoader workers: item ``i`` is (shard, count or error line)."""

    def __init__(self, shards: Shards, mine: list[int], progress: Callable[[], None] | None):
        self.shards, self.mine, self.progress = shards, mine, progress

    def __len__(self) -> int:
        return len(self.mine)

    def __getitem__(self, i: int) -> tuple[int, int | str]:
        try:
            return self.mine[i], count_shard(self.shards, self.mine[i], self.progress)
        except ShardError as exc:
            return self.mine[i], str(exc)


def ensure_lengths(shards: Shards, *, num_workers: int, rank: int, world_size: int,
                   progress: Callable[[], None] | None = None) -> None:
    """Give ``shards`` its lengths: given, cached (rank 0's cache decides), or counted now.

    A collective when the lengths are not given: every rank must call it. Shards are counted
    round robin over ranks (and over each rank's workers); a shard that fails to read is
    raised on every rank, naming it, so no rank is left waiting.
    """
    if shards.lengths is not None:
        return
    from ddpkit.dist import collectives

    cached = shards.load_cached() if rank == 0 else None
    if world_size > 1:
        cached = collectives.broadcast_object(cached)
    if cached is not None:
        shards.lengths = list(cached)
        return
    mine = list(range(rank, len(shards.shards), world_size))
    found: dict[int, int | str] = {}
    if mine:
        workers = min(num_workers, len(mine))
        for shard, count in DataLoader(_Counting(shards, mine, progress), batch_size=None,
                                       num_workers=workers):
            found[int(shard)] = count if isinstance(count, str) else int(count)
    every = [found] if world_size == 1 else collectives.all_gather_object(found)
    merged = {shard: count for part in every for shard, count in part.items()}
    failed = sorted((shard, count) for shard, count in merged.items() if isinstance(count, str))
    if failed:
        raise ShardError(failed[0][1] + (f" (and {len(failed) - 1} more shards)" if len(failed) > 1 else ""))
    shards.lengths = [int(merged[i]) for i in range(len(shards.shards))]
    empty = [shard_name(shards, i) for i, n in enumerate(shards.lengths) if n == 0]
    if rank == 0:
        shards.save_cached()
        if empty:
            warnings.warn(f"ddpkit: {len(empty)} shard(s) yield no samples and are left out: "
                          f"{', '.join(empty[:5])}{' ...' if len(empty) > 5 else ''}", stacklevel=3)
