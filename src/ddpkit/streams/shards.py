"""``ddpkit.Shards``: a stream made of shards, read so that no sample depends on the world size.

A shard is anything ``read`` understands (a file path, a URL, an index into a Hugging Face
streaming dataset); ``read(shard)`` yields its samples, always in the same order. If ``read``
takes a second argument, ddpkit calls ``read(shard, start)`` to begin at sample ``start``
(:func:`ddpkit.read_tar` does that without reading the skipped samples); otherwise it reads
and drops them. See :mod:`ddpkit.streams.order` for the order an epoch reads them in.

Example:
    >>> shards = Shards(["a.tar", "b.tar"], read=ddpkit.read_tar)        # doctest: +SKIP
    >>> loader = rt.loader(shards, global_batch_size=256, shuffle=True)    # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from torch.utils.data import IterableDataset

from ddpkit.errors import DdpkitError, UsageError
from ddpkit.streams.order import EpochOrder

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

    def __init__(self, shards: Sequence[Any], read: Callable[..., Any], *,
                 lengths: Sequence[int] | None = None, shuffle_window: int = DEFAULT_WINDOW,
                 cache: str | os.PathLike | None | bool = None):
        if isinstance(shards, (str, bytes)) or not hasattr(shards, "__len__"):
            raise UsageError("Shards needs a list of shards (paths, URLs, ...), got "
                             f"{type(shards).__name__}")
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
    def from_hf(cls, dataset: Any, **kwargs: Any) -> "Shards":
        """The shards of a Hugging Face streaming ``IterableDataset`` (``n_shards`` of them, e.g.
        one per data file), each read through ``dataset.shard(n_shards, i)``."""
        count = getattr(dataset, "n_shards", None)
        if not isinstance(count, int) or not hasattr(dataset, "shard"):
            raise UsageError("Shards.from_hf needs a Hugging Face datasets.IterableDataset "
                             "(load_dataset(..., streaming=True))")
        return cls(list(range(count)), _HfShard(dataset, count), **kwargs)

    @classmethod
    def from_dataset(cls, dataset: Any, *, shards: int = 16, **kwargs: Any) -> "Shards":
        """A map-style ``dataset`` as a stream of ``shards`` contiguous shards (to compare, or to
        read an indexable set in stream order)."""
        from ddpkit.data import shard_range

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
        from ddpkit.streams.reading import count_shard, read_range

        if self.lengths is None:
            self.lengths = [count_shard(self, i) for i in range(len(self.shards))]
        order = EpochOrder(self.lengths, shuffle=False, seed=0, epoch=0)
        for _, sample in read_range(self, order, 0, order.length, seed=0):
            yield sample

    # -- lengths --------------------------------------------------------------------------
    def cache_file(self) -> Path | None:
        """Where learned lengths are kept: keyed by the shards (with file sizes and times) and read's code."""
        if self.cache is False:
            return None
        root = Path(self.cache) if self.cache not in (None, True) else \
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddpkit"
        key = hashlib.sha256(json.dumps([_describe_read(self.read)] + [_describe_shard(s) for s in self.shards])
                             .encode()).hexdigest()[:24]
        return root / "shard-lengths" / f"{key}.json"

    def load_cached(self) -> list[int] | None:
        path = self.cache_file()
        if path is None or not path.is_file():
            return None
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return saved if isinstance(saved, list) and len(saved) == len(self.shards) else None

    def save_cached(self) -> None:
        path = self.cache_file()
        if path is None or self.lengths is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.lengths))
            os.replace(tmp, path)
        except OSError as exc:
            warnings.warn(f"ddpkit: could not cache shard lengths in {path}: {exc}", stacklevel=3)


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
