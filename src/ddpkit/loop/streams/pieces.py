"""What each DataLoader worker (or the main process) reads from a stream, as *pieces*.

A piece is a dict: ``b`` (the global batch or chunk it belongs to), ``parts`` (how many pieces
make that batch), ``pos`` (the stream indices of its samples), ``batch`` (them collated, or as
they are in a :class:`RawSamples` for the main process to collate, or None), ``template`` (a batch
of zero rows, for a rank with no samples in a batch), ``count`` (samples in the global batch),
``seen`` (samples of the stream read up to it: a plain stream must read the same on every rank)
and ``error`` (one line naming a shard that failed: the main process raises it, so the user sees
the shard, not a worker's traceback).

* :class:`ddpkit.Shards` for training: a rank's columns are split between its workers; every
  worker sends one piece per global batch and the main process joins them.
* A plain ``IterableDataset``: every rank and worker reads all of it; worker ``w`` of ``k``
  sends the rank's strided part of global batches ``b % k == w``.
* Evaluation reads chunks of ``batch_size`` laid from the stream's start (each the same on any world
  size): contiguous runs of them per rank for Shards, round robin over ranks and workers for a plain
  stream.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ddpkit import rng
from ddpkit._tensors import raw_bytes
from ddpkit._torch import worker_info_hidden
from ddpkit.errors import warn
from ddpkit.loop.batch import concat_batches, zero_rows
from ddpkit.loop.loader import ShardCollate, collate_shards
from ddpkit.loop.sampler import batch_shard
from ddpkit.loop.streams.order import EpochOrder, Layout, permutation, window_rows, worker_columns
from ddpkit.loop.streams.shards import ShardError, Shards, read_range
from ddpkit.observe import worker_stacks

PLAIN_WINDOW = 256  # shuffle window of a plain stream with shuffle=True


def _held(pieces: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """``pieces``, each read inside :func:`ddpkit.rng.holding` (the global generators' states put back
    once a piece, where the main process reads), and closed with the caller (its readers' files)."""
    try:
        while True:
            with rng.holding():
                piece = next(pieces, None)
            if piece is None:
                return
            yield piece
    finally:
        if isinstance(pieces, Generator):
            pieces.close()


class Pieces(IterableDataset):
    """The dataset a stream loader hands to its DataLoader (see the module docstring).

    ``control`` (shared memory: epoch, first batch, whether the main process collates) is set by
    the main process before each pass, so persistent workers read the right epoch; ``progress``
    counts samples read, for the hang watchdog.
    """

    def __init__(
        self,
        source: Any,
        *,
        mode: str,
        rank: int,
        world_size: int,
        batch_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        collate_fn: Callable[[list[Any]], Any],
    ):
        self.source, self.mode = source, mode
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        self.collate_fn = collate_fn
        self.control = torch.zeros(3, dtype=torch.int64).share_memory_()
        self._raw = False  # this pass's pieces carry their samples as they are (RawSamples)
        self.progress = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._unsent, self._sent_at = 0, 0.0
        self.user_worker_init: Callable[[int], None] | None = None
        self._seeded_epoch: int | None = None

    def seed_worker(self, worker_id: int) -> None:
        """DataLoader's ``worker_init_fn``: ddpkit's seeding first, then the user's function."""
        worker_stacks.listen()  # a stack for the watchdog, should a read hang
        self._seed(int(self.control[0]), worker_id)
        if self.user_worker_init is not None:
            rng.run_worker_init(self.user_worker_init, worker_id)

    def _seed(self, epoch: int, worker: int) -> None:
        """Seed a worker's global generators from (seed, epoch, rank, worker), as map-style loaders do."""
        rng.seed_worker_globals(self.seed, epoch, self.rank, worker)
        self._seeded_epoch = epoch

    def tick(self) -> None:
        """One sample read; the shared count (a tensor op) moves every 16 samples or 50 ms."""
        self._unsent += 1
        now = time.monotonic()
        if self._unsent >= 16 or now - self._sent_at > 0.05:
            self.progress += self._unsent
            self._unsent, self._sent_at = 0, now

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch, start, raw = (int(v) for v in self.control)
        self._raw = bool(raw) and self.mode == "train"
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None and self._seeded_epoch != epoch:
            self._seed(epoch, worker)  # a persistent worker reading a new epoch
        try:
            if isinstance(self.source, Shards):
                pieces = (
                    self._shard_train(epoch, start, worker, workers)
                    if self.mode == "train"
                    else self._shard_eval(worker, workers)
                )
            else:
                pieces = (
                    self._plain_train(epoch, start, worker, workers)
                    if self.mode == "train"
                    else self._plain_eval(worker, workers)
                )
            yield from _held(pieces)
        except ShardError as exc:  # StreamError too
            yield _failed(str(exc))

    # -- Shards -----------------------------------------------------------------------------
    def _shard_train(self, epoch: int, start: int, worker: int, workers: int) -> Iterator[dict[str, Any]]:
        shards = self.source
        order = EpochOrder(shards.lengths, shuffle=self.shuffle, seed=self.seed, epoch=epoch)
        layout = Layout(order.length, global_batch_size=self.batch_size, drop_last=self.drop_last)
        rank_columns = layout.rank_columns(self.rank, self.world_size)
        mine = [j for j in worker_columns(rank_columns, worker, workers) if start < layout.column_length(j)]
        readers = {j: self._column(order, layout, j, start) for j in mine}
        template = None
        try:
            for b in range(start, layout.batches):
                count = layout.batch_count(b)
                samples = [next(readers[j]) for j in mine if j < count]
                piece = self._piece(b, workers, samples, count)
                piece["w"] = worker
                if piece["batch"] is not None:
                    if not self._raw:
                        template = zero_rows(piece["batch"])
                    elif template is None:  # (samples as they are: one collated for it, once a pass)
                        template = zero_rows(self.collate_fn(piece["batch"][:1]))
                elif worker == 0 and rank_columns.start >= count:  # the rank has nothing here
                    if template is None:
                        probe = [s for _, s in read_range(shards, order, 0, 1, seed=self.seed)]
                        template = zero_rows(self.collate_fn(probe))
                    piece["template"] = template
                yield piece
        finally:
            for reader in readers.values():
                reader.close()

    def _column(
        self, order: EpochOrder, layout: Layout, column: int, row: int
    ) -> Generator[tuple[int, Any], None, None]:
        """Rows ``row, row+1, ...`` of ``column``: its stretch read once, in order, and with
        ``shuffle`` permuted within windows of ``shuffle_window`` rows."""
        first, rows = layout.column_start(column), layout.column_length(column)
        window = self.source.shuffle_window if self.shuffle else 1
        block = row // window * window
        stream = read_range(self.source, order, first + block, first + rows, seed=self.seed, progress=self.tick)
        try:
            while block < rows:
                _, shuffled = window_rows(rows, window, block, self.seed, order.epoch, column)
                held = [next(stream) for _ in shuffled]
                for at in range(max(row, block), block + len(shuffled)):
                    yield held[shuffled[at - block] - block]
                block += len(shuffled)
        finally:
            stream.close()

    def _shard_eval(self, worker: int, workers: int) -> Iterator[dict[str, Any]]:
        shards = self.source
        order = EpochOrder(shards.lengths, shuffle=False, seed=self.seed, epoch=0)
        # whole batches laid from the stream's start, so each batch is the same on any world size
        rank_part = batch_shard(order.length, self.batch_size, self.rank, self.world_size)
        part = batch_shard(len(rank_part), self.batch_size, worker, workers)  # (rank_part starts a batch)
        first, stop = rank_part.start + part.start, rank_part.start + part.stop
        chunk: list[tuple[int, Any]] = []
        for item in read_range(shards, order, first, stop, seed=self.seed, progress=self.tick):
            chunk.append(item)
            if len(chunk) == self.batch_size:
                yield self._piece(item[0] // self.batch_size, 1, chunk, len(chunk))
                chunk = []
        if chunk:
            yield self._piece(chunk[0][0] // self.batch_size, 1, chunk, len(chunk))

    # -- a plain IterableDataset ------------------------------------------------------------
    def _stream(self, epoch: int) -> Iterator[tuple[int, Any]]:
        """(stream index, sample) of the whole stream, shuffled in windows if asked."""
        with worker_info_hidden():
            it = iter(self.source)
        index = 0
        window: list[tuple[int, Any]] = []
        block = 0
        while True:
            try:
                with rng.reading(rng.SampleKey(self.seed, epoch, index)), worker_info_hidden():
                    sample = next(it)
            except StopIteration:
                break
            except Exception as exc:
                raise StreamError(
                    f"{type(self.source).__name__} failed at sample {index}: {type(exc).__name__}: {exc}"
                ) from exc
            self.tick()
            if not self.shuffle:
                yield index, sample
            else:
                window.append((index, sample))
                if len(window) == PLAIN_WINDOW:
                    yield from _shuffled(window, self.seed, epoch, block)
                    window, block = [], block + 1
            index += 1
        if window:
            yield from _shuffled(window, self.seed, epoch, block)

    def _plain_train(self, epoch: int, start: int, worker: int, workers: int) -> Iterator[dict[str, Any]]:
        size = self.batch_size
        batch: list[tuple[int, Any]] = []
        b, seen = 0, 0
        for item in self._stream(epoch):
            seen += 1
            if b < start:  # a resumed pass: these batches were trained
                if seen % size == 0:
                    b += 1
                continue
            batch.append(item)
            if len(batch) == size:
                if b % workers == worker:
                    yield self._plain_piece(b, batch, seen)
                batch, b = [], b + 1
        if batch and not self.drop_last and b % workers == worker:
            yield self._plain_piece(b, batch, seen)

    def _plain_piece(self, b: int, batch: list[tuple[int, Any]], seen: int) -> dict[str, Any]:
        piece = self._piece(b, 1, batch[self.rank :: self.world_size], len(batch))
        piece["seen"], piece["fp"] = seen, fingerprint(batch[0][1])
        if piece["batch"] is None:
            piece["template"] = zero_rows(self.collate_fn([batch[0][1]]))
        return piece

    def _plain_eval(self, worker: int, workers: int) -> Iterator[dict[str, Any]]:
        slot, slots = self.rank * workers + worker, self.world_size * workers
        chunk: list[tuple[int, Any]] = []
        seen, first = 0, 0
        for index, sample in self._stream(0):
            seen += 1
            if index == 0:
                first = fingerprint(sample)
            if index // self.batch_size % slots != slot:
                continue
            chunk.append((index, sample))
            if len(chunk) == self.batch_size:
                yield self._piece(index // self.batch_size, 1, chunk, len(chunk))
                chunk = []
        if chunk:
            yield self._piece(chunk[0][0] // self.batch_size, 1, chunk, len(chunk))
        yield {
            "b": -1,
            "w": 0,
            "parts": 0,
            "pos": [],
            "batch": None,
            "template": None,
            "count": 0,
            "seen": seen,
            "fp": first,
            "error": None,
        }  # the end: what the stream was

    # -- helpers ----------------------------------------------------------------------------
    def _collate(self, read: list[Any], positions: list[int]) -> Any:
        """The piece collated in the worker; a collate of the script's draws from streams keyed by its
        samples' positions in the stream (:func:`ddpkit.rng.collating`)."""
        if isinstance(self.collate_fn, ShardCollate):
            return collate_shards(self.collate_fn.collate, read, 0, key=(self.seed, int(self.control[0]), positions))
        return self.collate_fn(read)

    def _piece(self, b: int, parts: int, samples: list[tuple[int, Any]], count: int) -> dict[str, Any]:
        batch: Any = None
        if samples:
            read = [sample for _, sample in samples]
            batch = RawSamples(read) if self._raw else self._collate(read, [index for index, _ in samples])
        return {
            "b": b,
            "w": 0,
            "parts": parts,
            "pos": [index for index, _ in samples],
            "batch": batch,
            "template": None,
            "count": count,
            "seen": -1,
            "fp": 0,
            "error": None,
        }


class RawSamples(list):
    """A piece's samples as the stream read them, collated in the main process: a batch made of
    several workers' pieces, or cut into micro-shards, is collated whole and shard by shard there
    (a collate that pads to the longest sample pads each piece to its own otherwise)."""


class StreamError(ShardError):
    """A plain stream raised while being read."""


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Warn ``message`` once per process for ``key``."""
    if key not in _warned:
        _warned.add(key)
        warn(message)


def warn_plain_stream(dataset: Any, world_size: int, num_workers: int, doing: str) -> None:
    """Rank 0, once per stream type: every rank and worker reads a plain stream whole, at this cost.

    A single reader (one process, at most one worker) is not warned.

    Args:
        dataset: the plain stream (its type names it).
        world_size: processes of the job.
        num_workers: DataLoader workers per process (0: the main process reads).
        doing: what each reader does with it, ending the message (``"and keeps its share"``).
    """
    readers = world_size * max(1, num_workers)
    if readers > 1:
        name = type(dataset).__name__
        warn_once(
            f"plain:{name}:{doing}",
            f"ddpkit: {name} is a plain IterableDataset, so each of the {world_size} "
            f"process(es) x {max(1, num_workers)} reader(s) reads the whole stream {doing}: every sample "
            f"is read {readers} times per epoch; make it a ddpkit.Shards to read each sample once",
        )


def as_is(piece: dict[str, Any]) -> dict[str, Any]:
    """The DataLoader's ``collate_fn`` for pieces: they are collated already."""
    return piece


def _failed(message: str) -> dict[str, Any]:
    return {
        "b": -1,
        "w": 0,
        "parts": 0,
        "pos": [],
        "batch": None,
        "template": None,
        "count": 0,
        "seen": -1,
        "fp": 0,
        "error": message,
    }


def _shuffled(window: list[tuple[int, Any]], seed: int, epoch: int, block: int) -> Iterator[tuple[int, Any]]:
    for i in permutation(len(window), seed, epoch, -1, block):
        yield window[i]


def fingerprint(sample: Any) -> int:
    """A 62-bit digest of one sample (its tensors' bytes, other leaves' repr), equal on every rank."""
    digest = hashlib.blake2b(digest_size=8)

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            digest.update(repr((flat.dtype, tuple(value.shape))).encode())
            digest.update(raw_bytes(flat))
        elif isinstance(value, Mapping):
            for key in sorted(value, key=repr):
                digest.update(repr(key).encode())
                add(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                add(item)
        else:
            digest.update(repr(value).encode())

    add(sample)
    return int.from_bytes(digest.digest(), "little") & (2**62 - 1)


def join(pieces: Any, parts: int) -> Iterator[tuple[int, list[int], Any, int, tuple[int, int]]]:
    """(batch, stream indices, batch, global count, (seen, fingerprint)) from a DataLoader's pieces.

    ``parts`` pieces make a batch; they may arrive in any order. A piece carrying an error is
    raised here, in the main process, as one line.
    """
    waiting: dict[int, list[dict[str, Any]]] = {}
    for piece in pieces:
        if piece["error"] is not None:
            raise ShardError(piece["error"])
        group = waiting.setdefault(piece["b"], [])
        group.append(piece)
        if len(group) < parts:
            continue
        del waiting[piece["b"]]
        group.sort(key=lambda p: p["w"])
        filled = [p["batch"] for p in group if p["batch"] is not None]
        batch: Any
        if filled and isinstance(filled[0], RawSamples):
            batch = RawSamples(sample for samples in filled for sample in samples)
        elif filled:
            batch = filled[0] if len(filled) == 1 else concat_batches(filled)
        else:
            batch = next((p["template"] for p in group if p["template"] is not None), None)
            if batch is None:
                raise ShardError(f"internal: no sample and no template for stream batch {piece['b']}")
        positions = [index for p in group for index in p["pos"]]
        yield piece["b"], positions, batch, piece["count"], (max(p["seen"] for p in group), piece["fp"])
    if waiting:
        raise ShardError(f"internal: stream batches {sorted(waiting)} arrived incomplete")
