"""``ddpkit.Shards``: a stream made of shards, read so that no sample depends on the world size.

This module is the stream's description and how it is read: in order, from a start, counted,
with errors that name the shard. :mod:`ddpkit.loop.streams.lengths` learns the lengths of all
shards across ranks and workers.

A shard is anything ``read`` understands (a file path, a URL, an index into a Hugging Face
streaming dataset); ``read(shard)`` yields its samples, always in the same order. If ``read``
takes a second argument, ddpkit calls ``read(shard, start)`` to begin at sample ``start``
(:func:`ddpkit.read_tar` does that without reading the skipped samples); otherwise it reads
and drops them. See :mod:`ddpkit.loop.streams.order` for the order an epoch reads them in.

Example:
    >>> shards = Shards(["a.tar", "b.tar"], read=ddpkit.read_tar)        # doctest: +SKIP
    >>> loader = rt.loader(shards, global_batch_size=256, shuffle=True)    # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset

from ddpkit import rng
from ddpkit._files import atomic_path
from ddpkit._torch import worker_info_hidden
from ddpkit.errors import DdpkitError, UsageError, warn
from ddpkit.loop.sampler import shard_range
from ddpkit.loop.streams.order import EpochOrder

DEFAULT_WINDOW = 256


class ShardError(DdpkitError):
    """A shard failed to read, or yielded another number of samples than its length."""


class Shards(IterableDataset):
    """A stream from ``shards`` and ``read(shard)``; iterate it through ``rt.loader``.

    Args:
        shards: the shards, in their natural (stream) order.
        read: yields the samples of one shard, the same ones in the same order every time.
        lengths: samples per shard. Without them ddpkit counts the shards once, spread over
            ranks and workers, before the first epoch, and caches the counts (``cache``).
        shuffle_window: with ``shuffle=True`` samples are shuffled within windows of this many
            consecutive samples of a column (a rank holds one window per column in memory).
        cache: a directory for learned lengths, ``None`` for ``$XDG_CACHE_HOME/ddpkit`` (or
            ``~/.cache/ddpkit``), ``False`` to count every run.

    Iterated directly (outside ddpkit) it yields every sample once, in stream order.
    """

    def __init__(
        self,
        shards: Sequence[Any],
        read: Callable[..., Any],
        *,
        lengths: Sequence[int] | None = None,
        shuffle_window: int = DEFAULT_WINDOW,
        cache: str | os.PathLike | None | bool = None,
    ):
        if isinstance(shards, (str, bytes)) or not hasattr(shards, "__len__"):
            raise UsageError(f"Shards needs a list of shards (paths, URLs, ...), got {type(shards).__name__}")
        if not shards:
            raise UsageError("Shards got an empty list of shards")
        if not callable(read):
            raise UsageError(f"Shards needs read= a function that yields one shard's samples, got {read!r}")
        if lengths is not None:
            lengths = list(lengths)
            if len(lengths) != len(shards) or any(not isinstance(n, int) or n < 0 for n in lengths):
                raise UsageError(f"lengths= needs one count >= 0 per shard ({len(shards)}), got {lengths!r}")
        if not isinstance(shuffle_window, int) or shuffle_window < 1:
            raise UsageError(f"shuffle_window must be at least 1, got {shuffle_window!r}")
        self.shards = list(shards)
        self.read = read
        self.lengths: list[int] | None = lengths
        self.shuffle_window = shuffle_window
        self.cache = cache
        self.takes_start = _takes_start(read)

    @classmethod
    def from_hf(cls, dataset: Any, **kwargs: Any) -> Shards:
        """The shards of a Hugging Face streaming ``IterableDataset`` (``n_shards`` of them, e.g.
        one per data file), each read through ``dataset.shard(n_shards, i)``."""
        count = getattr(dataset, "n_shards", None)
        if not isinstance(count, int) or not hasattr(dataset, "shard"):
            raise UsageError(
                "Shards.from_hf needs a Hugging Face datasets.IterableDataset (load_dataset(..., streaming=True))"
            )
        return cls(list(range(count)), _HfShard(dataset, count), **kwargs)

    @classmethod
    def from_dataset(cls, dataset: Any, *, shards: int = 16, **kwargs: Any) -> Shards:
        """A map-style ``dataset`` as a stream of ``shards`` contiguous shards (to compare, or to
        read an indexable set in stream order)."""
        parts = [shard_range(len(dataset), i, shards) for i in range(shards)]
        return cls(parts, _DatasetShard(dataset), lengths=[len(p) for p in parts], **kwargs)

    def __len__(self) -> int:
        if self.lengths is None:
            raise TypeError("the lengths of these Shards are not known yet (rt.loader learns them)")
        return sum(self.lengths)

    def __repr__(self) -> str:
        known = f"{sum(self.lengths)} samples" if self.lengths is not None else "lengths unknown"
        return f"Shards({len(self.shards)} shards, {known})"

    def __iter__(self) -> Iterator[Any]:
        if self.lengths is None:
            self.lengths = [count_shard(self, i) for i in range(len(self.shards))]
        order = EpochOrder(self.lengths, shuffle=False, seed=0, epoch=0)
        for _, sample in read_range(self, order, 0, order.length, seed=0):
            yield sample

    # -- lengths --------------------------------------------------------------------------
    def cache_file(self) -> Path | None:
        """Where learned lengths are kept: keyed by the shards (with file sizes and times) and read's code."""
        cache = self.cache
        if cache is False:
            return None
        root = (
            Path(cache)
            if cache is not None and cache is not True
            else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddpkit"
        )
        key = hashlib.sha256(
            json.dumps([_describe_read(self.read)] + [_describe_shard(s) for s in self.shards]).encode()
        ).hexdigest()[:24]
        return root / "shard-lengths" / f"{key}.json"

    def load_cached(self) -> list[int] | None:
        """The lengths cached in :meth:`cache_file`, or None (no cache, unreadable, or another shard count)."""
        path = self.cache_file()
        if path is None or not path.is_file():
            return None
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return saved if isinstance(saved, list) and len(saved) == len(self.shards) else None

    def save_cached(self) -> None:
        """Write the known lengths to :meth:`cache_file` atomically; a failed write only warns."""
        path = self.cache_file()
        if path is None or self.lengths is None:
            return
        try:
            with atomic_path(path) as tmp:
                tmp.write_text(json.dumps(self.lengths))
        except OSError as exc:
            warn(f"ddpkit: could not cache shard lengths in {path}: {exc}")


# -- reading ------------------------------------------------------------------------------
# Every call into the user's ``read`` runs with worker info hidden (see
# :func:`ddpkit._torch.worker_info_hidden`) and marks the sample for :func:`ddpkit.sample_rng`.


def shard_name(shards: Shards, shard: int) -> str:
    """Shard number ``shard`` as messages name it: its path, else its ``repr``."""
    value = shards.shards[shard]
    return os.fspath(value) if isinstance(value, (str, os.PathLike)) else repr(value)


def _open(shards: Shards, shard: int, start: int) -> tuple[Iterator[Any], int]:
    """An iterator over ``shard`` and the read index it yields first (``start`` if read can skip)."""
    try:
        with worker_info_hidden():
            if shards.takes_start and start:
                return iter(shards.read(shards.shards[shard], start)), start
            return iter(shards.read(shards.shards[shard])), 0
    except Exception as exc:  # the user's read: name the shard, whatever it raised
        raise ShardError(f"shard {shard_name(shards, shard)} failed to open: {type(exc).__name__}: {exc}") from exc


def _next(shards: Shards, shard: int, it: Iterator[Any], index: int, key: rng.SampleKey | None) -> Any:
    """The next sample of ``shard`` (read index ``index``); a short shard or an error names it."""
    try:
        with rng.reading(key), worker_info_hidden():
            return next(it)
    except StopIteration:
        expected = shards.lengths[shard] if shards.lengths is not None else index
        raise ShardError(
            f"shard {shard_name(shards, shard)} ended after {index} samples, but its length "
            f"is {expected}; it changed since its length was counted (pass lengths= "
            f"or delete {shards.cache_file() or 'the cached lengths'})"
        ) from None
    except ShardError:
        raise
    except Exception as exc:
        raise ShardError(
            f"shard {shard_name(shards, shard)} failed at sample {index}: {type(exc).__name__}: {exc}"
        ) from exc


def _check_end(shards: Shards, shard: int, it: Iterator[Any]) -> None:
    try:
        with worker_info_hidden():
            next(it)
    except StopIteration:
        return
    except Exception:
        return  # an error past the last counted sample: not one of ours to read
    lengths = shards.lengths
    assert lengths is not None  # a shard is read by an EpochOrder built from the known lengths
    raise ShardError(
        f"shard {shard_name(shards, shard)} yields more than its length "
        f"{lengths[shard]}; it changed since its length was counted (pass "
        f"lengths= or delete {shards.cache_file() or 'the cached lengths'})"
    )


def read_shard(
    shards: Shards,
    order: EpochOrder,
    shard: int,
    first: int,
    stop: int,
    seed: int,
    progress: Callable[[], None] | None = None,
) -> Iterator[tuple[int, Any]]:
    """(stream index, sample) for samples ``[first, stop)`` of ``shard``, read in order.

    Args:
        shards: the stream.
        order: the epoch being read (its ``natural`` starts give stream indices; its epoch keys samples).
        shard: which shard, by its index in ``shards.shards``.
        first: the shard's first sample to yield (those before it are skipped, by ``read`` if it can).
        stop: the sample to stop before.
        seed: keys :func:`ddpkit.sample_rng` of each sample, with the epoch and the stream index.
        progress: called once per sample yielded (None: not called).
    """
    it, index = _open(shards, shard, first)
    natural = order.natural[shard]
    try:
        if index < first:  # skip what read could not
            _warn_skip(shards, shard, first - index)
        while index < first:
            _next(shards, shard, it, index, None)
            index += 1
        while index < stop:
            item = _next(shards, shard, it, index, rng.SampleKey(seed, order.epoch, natural + index))
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
        warn(
            f"ddpkit: read({shard_name(shards, shard)}) cannot start mid-shard, so {count} samples "
            "were read and dropped to reach a reader's first sample; give read a second "
            "parameter, read(shard, start), that starts at sample start"
        )


def read_range(
    shards: Shards, order: EpochOrder, first: int, stop: int, *, seed: int, progress: Callable[[], None] | None = None
) -> Generator[tuple[int, Any], None, None]:
    """(stream index, sample) for positions ``[first, stop)`` of the epoch's order, lazily.

    Args:
        shards: the stream.
        order: the epoch whose order the positions are in.
        first: the first position to yield.
        stop: the position to stop before.
        seed: keys :func:`ddpkit.sample_rng` of each sample, with the epoch and the stream index.
        progress: called once per sample yielded (None: not called).
    """
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
                raise ShardError(
                    f"shard {shard_name(shards, shard)} failed at sample {count}: {type(exc).__name__}: {exc}"
                ) from exc
            count += 1
            if progress is not None:
                progress()
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


class _HfShard:
    """``read`` for :meth:`Shards.from_hf` (a class, so workers can pickle it)."""

    def __init__(self, dataset: Any, count: int):
        self.dataset, self.count = dataset, count

    def __call__(self, index: int, start: int = 0) -> Iterator[Any]:
        part = self.dataset.shard(num_shards=self.count, index=index, contiguous=True)
        return iter(part.skip(start) if start else part)


class _DatasetShard:
    """``read`` for :meth:`Shards.from_dataset`: the samples of one range of indices."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __call__(self, part: range, start: int = 0) -> Iterator[Any]:
        return (self.dataset[i] for i in part[start:])


def _takes_start(read: Callable[..., Any]) -> bool:
    try:
        params = list(inspect.signature(read).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def _describe_read(read: Callable[..., Any]) -> str:
    target = getattr(read, "__func__", read)
    code = getattr(target, "__code__", None)
    name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', type(target).__qualname__)}"
    if code is not None:
        name += ":" + hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest()[:12]
    return name


def _describe_shard(shard: Any) -> list[Any]:
    text = os.fspath(shard) if isinstance(shard, (str, os.PathLike)) else repr(shard)
    try:
        stat = os.stat(text)
    except (OSError, ValueError):
        return [text]
    return [text, stat.st_size, stat.st_mtime_ns]
