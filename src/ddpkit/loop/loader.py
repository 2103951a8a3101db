"""The loader a script iterates: batches of this rank's share of each global batch, on the device.

It behaves like a ``DataLoader`` where a PyTorch user expects it to: each ``iter(loader)``
starts the epoch from its first batch, so ``next(iter(loader))`` to probe a shape takes
nothing from training, and ``break`` ends the pass. Two things are ddpkit's own:

* after :meth:`ddpkit.Runtime.load`, the next pass continues the saved epoch mid-way, and
  keeps doing so (a probe or two) until a batch of it is trained on;
* while a sample is read, torch's, numpy's and ``random``'s global generators are keyed by (seed,
  epoch, index) (:func:`ddpkit.rng.reading`: torchvision's random transforms, ``np.random`` draws and
  ``random.random()`` flips draw alike on any world size and number of workers; not for a dataset
  that runs no code of the script's, :func:`draws_nothing`); with ``num_workers > 0``, each worker's
  generators are seeded from (seed, epoch, rank, worker id) as it starts; a ``collate_fn`` of the
  script's draws keyed by the samples it collates (:func:`ddpkit.rng.collating`), in a worker or not;
  :func:`ddpkit.sample_rng` is a per-sample generator of its own.

The loop state (:mod:`ddpkit.state.loop`) reads each loader's :meth:`ShardedLoader.position_record`
into checkpoints and hands saved positions back through :meth:`ShardedLoader.resume_at`.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate, get_worker_info

from ddpkit import rng
from ddpkit.checkpoint import background
from ddpkit.errors import UsageError
from ddpkit.loop.batch import map_tensors, to_device, zero_rows
from ddpkit.loop.sampler import GlobalBatchSampler
from ddpkit.observe import worker_stacks

SHARDS = "micro-shards"
"""The first element of the key :class:`_EpochBatches` adds to a batch for :class:`ShardCollate`: its local shards."""


class ShardCollate:
    """The script's ``collate_fn``, applied to each micro-shard's samples on its own too.

    A collate that pads to the batch's longest sample (Hugging Face's ``DataCollatorWithPadding``)
    pads a rank's batch to the longest of its samples: a shard cut from it had another width on
    each world size, its dropout masks were drawn over another shape, and ``micro_shards`` lost its
    bits (1e-2 apart on 1 and 2 processes). Given the local shard count (the :data:`SHARDS` key the
    batch sampler adds, so a persistent worker learns it too), it returns :class:`Collated`: the batch
    as before, and each shard collated as one process collates that shard.
    """

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: list[Any]) -> Any:
        shards, key = 0, None
        if samples and isinstance(samples[-1], _ShardCount):
            shards, key, samples = samples[-1].shards, samples[-1].key, samples[:-1]
        return collate_shards(self.collate, samples, shards, key=key)


def collate_shards(
    collate: Callable[[list[Any]], Any],
    samples: list[Any],
    shards: int,
    runs: int | None = None,
    key: BatchKey | None = None,
) -> Any:
    """``collate(samples)``; with more than one local micro-shard, a :class:`Collated` of it and of each
    shard's samples collated alone, as ``rt.shards`` cuts the batch; a :class:`Collated` too where samples
    came as None (which the collate leaves out), with their count.

    Args:
        collate: the script's ``collate_fn``.
        samples: the rank's samples of the batch, in its order.
        shards: the rank's local micro-shards (0 or 1: the batch alone).
        runs: None: shard ``j`` is samples ``j, j + shards, ...``; a number: the ``j``-th run of that
            many (a ``ddpkit.Shards`` stream lays its shards end to end).
        key: (seed, epoch, the samples' indices): each call draws from streams keyed by the samples it
            collates (:func:`ddpkit.rng.collating`), the same on any world size and in a resumed run.
    """
    with contextlib.nullcontext() if key is None else rng.holding():
        whole = _collated(collate, samples, key, slice(None))
        # read as None (failed to decode): the collate left them out
        missing = sum(sample is None for sample in samples)
        if shards <= 1:
            return Collated(whole, None, missing) if missing else whole
        cuts = [slice(j, None, shards) if runs is None else slice(j * runs, (j + 1) * runs) for j in range(shards)]
        return Collated(
            whole, [_collated(collate, samples[cut], key, cut) if samples[cut] else None for cut in cuts], missing
        )


BatchKey = tuple[int, int, list[int]]
"""A batch's (seed, epoch, its samples' indices in order): what keys the streams its collate draws from."""


def _collated(collate: Callable[[list[Any]], Any], samples: list[Any], key: BatchKey | None, cut: slice) -> Any:
    """``collate(samples)``, keyed by ``key``'s indices under ``cut`` (the samples' own)."""
    if key is None:
        return collate(samples)
    seed, epoch, indices = key
    with rng.collating(seed, epoch, indices[cut]):
        return collate(samples)


class _ShardCount:
    """What :class:`_KeyedDataset` reads for the :data:`SHARDS` key: the batch's local shards, and (read
    with the batch's keys) the :data:`BatchKey` its collate draws by."""

    def __init__(self, shards: int, key: BatchKey | None = None) -> None:
        self.shards, self.key = shards, key


class Collated:
    """A batch and its local micro-shards, each collated on its own (:class:`ShardCollate`; None: not
    cut), and how many of its samples came as None, which the script's collate left out."""

    def __init__(self, whole: Any, parts: list[Any] | None, missing: int = 0) -> None:
        self.whole, self.parts, self.missing = whole, parts, missing

    def pin_memory(self) -> Collated:
        """DataLoader's ``pin_memory`` thread calls it."""
        pin = lambda batch: None if batch is None else map_tensors(lambda t: t.pin_memory(), batch)  # noqa: E731
        parts = None if self.parts is None else [pin(part) for part in self.parts]
        return Collated(pin(self.whole), parts, self.missing)


class _KeyedDataset(Dataset):
    """Reads ``dataset[index]`` with the sample's key set (for :func:`ddpkit.sample_rng`) and
    seeds a worker's global generators at the start of every epoch it reads."""

    def __init__(self, dataset: Any, seed: int, rank: int, worker_init_fn: Callable[[int], None] | None = None):
        self.dataset = dataset
        self.seed = seed
        self.rank = rank
        self.start_epoch = 0  # the epoch being read when workers start
        self.user_worker_init = worker_init_fn
        self._seeded_epoch: int | None = None
        self.draws_nothing = draws_nothing(dataset)  # its reads need no keyed generators

    def __len__(self) -> int:
        return len(self.dataset)

    def seed_worker(self, worker_id: int) -> None:
        """DataLoader's ``worker_init_fn``: ddpkit's seeding first, then the user's function."""
        worker_stacks.listen()  # a stack for the watchdog, should a read hang
        self._seed_globals(self.start_epoch, worker_id)
        if self.user_worker_init is not None:
            rng.run_worker_init(self.user_worker_init, worker_id)

    def _seed_globals(self, epoch: int, worker_id: int) -> None:
        rng.seed_worker_globals(self.seed, epoch, self.rank, worker_id)
        self._seeded_epoch = epoch

    def __getitem__(self, key: tuple[Any, int]) -> Any:
        epoch, index = key
        if epoch == SHARDS:
            return _ShardCount(index)
        worker = get_worker_info()
        if worker is not None and self._seeded_epoch != epoch:
            self._seed_globals(epoch, worker.id)  # a persistent worker reading a new epoch
        if self.draws_nothing:
            return self.dataset[index]
        with rng.reading(rng.SampleKey(self.seed, epoch, index)):
            return self.dataset[index]

    def __getitems__(self, keys: list[tuple[Any, int]]) -> list[Any]:
        """A batch's samples (DataLoader's fetch of one batch), the global generators' states put back
        once for all of them where the main process reads (:func:`ddpkit.rng.holding`); the
        :data:`SHARDS` key last becomes a :class:`_ShardCount` that knows the batch's keys."""
        with contextlib.nullcontext() if self.draws_nothing else rng.holding():
            samples = [self[key] for key in keys]
        if keys and keys[-1][0] == SHARDS:
            samples[-1] = _ShardCount(keys[-1][1], (self.seed, keys[0][0], [index for _, index in keys[:-1]]))
        return samples


def draws_nothing(dataset: Any) -> bool:
    """Whether reading ``dataset`` runs no code that could draw a random number: a ``TensorDataset``, a
    ``Subset`` or ``ConcatDataset`` of such, or a class that says so in its own body (``_draws_nothing =
    True``: ddpkit's in-memory datasets; a subclass, which may add a transform, does not inherit it).
    Its reads skip keying the global generators (about 12 us a sample)."""
    kind = type(dataset)
    if kind is torch.utils.data.TensorDataset or kind.__dict__.get("_draws_nothing", False):
        return True
    if kind is torch.utils.data.Subset:
        return draws_nothing(dataset.dataset)
    if kind is torch.utils.data.ConcatDataset:
        return all(draws_nothing(part) for part in dataset.datasets)
    return False


class _EpochBatches:
    """The batch sampler handed to DataLoader: the loader's plan for the pass it is starting.

    It holds its loader weakly: a strong reference would close a cycle (loader, DataLoader, this), which
    only the cyclic collector frees, so a loader built anew each epoch kept its persistent workers alive
    for many epochs (two more processes an epoch)."""

    def __init__(self, loader: ShardedLoader):
        self._loader = weakref.ref(loader)

    @property
    def loader(self) -> ShardedLoader:
        loader = self._loader()
        assert loader is not None, "a DataLoader read after its ddpkit loader was freed"
        return loader

    def __len__(self) -> int:
        return len(self.loader.sampler)

    def __iter__(self) -> Iterator[list[tuple[Any, int]]]:
        # what the pass needs, read now: a pass left by break keeps this generator, which must not hold its loader
        epoch, shards, plan = self.loader.epoch, self.loader._local_shards(), self.loader._plan
        marked = self.loader._user_collate is not None  # its collate learns the batch's keys (ShardCollate)
        for local, _ in plan:
            # An empty part still reads one sample so collate sees a batch; it is cut away later.
            keys: list[tuple[Any, int]] = [(epoch, index) for index in (local or [0])]
            cut = shards if local else 0  # (an empty part's one sample is collated keyed too, then cut away)
            yield keys + [(SHARDS, cut)] if cut > 1 or marked else keys


_PASSES = itertools.count()  # passes begun by every loader, in order


class LoaderPosition:
    """Where a loader's passes stand: what the loop state saves and restores, for any kind of data.

    Subclasses set ``sampler`` (with ``world_size`` and ``signature()``) and ``dataset``.
    """

    sampler: Any
    dataset: Any
    device: torch.device
    length_known = True
    num_workers = 0
    """DataLoader workers of this rank (``ddpkit.evaluate(model, loader)`` reads with as many)."""

    @property
    def collate_fn(self) -> Callable[[list[Any]], Any] | None:
        """The script's ``collate_fn`` (None: torch's default), as ``DataLoader.collate_fn`` tells it."""
        return self._user_collate

    local_shards: Callable[[], int] | None = None
    """Asked at each pass's start: the micro-shards this rank computes of a batch (0: none), which a
    ``collate_fn`` of the script's collates each on its own (:class:`ShardCollate`)."""

    shard_batches: list[Any] | None = None
    """The batch in hand's local micro-shards, each collated on its own (None: cut from the batch)."""

    missing = 0
    """Samples of the batch in hand that came as None, which the script's ``collate_fn`` left out."""

    whole_batch: Any = None
    """The batch in hand as handed out (what ``rt.shards`` finds the shards' parts of)."""

    _user_collate: Callable[[list[Any]], Any] | None = None
    """The script's ``collate_fn`` (None: torch's default, whose shards cut from a batch are alike)."""

    epochs_driven: Callable[[], bool] | None = None
    """The loop state's: whether ``rt.epochs`` sets the epochs (then a pass never moves on by itself)."""

    on_trained: Callable[[Any], None] | None = None
    """The loop state's: told each time a batch of this loader feeds a backward or a step."""

    _reading: Callable[[], Any] | None = None
    """The DataLoader iterator of the current pass, weakly (:meth:`reading`)."""

    def reading(self) -> Any:
        """The DataLoader iterator of the current pass, if any (the watchdog asks its workers for their stacks)."""
        return self._reading() if self._reading is not None else None

    def _local_shards(self) -> int:
        """The local micro-shards a collate of the script's makes each on its own (0: it does not)."""
        if self._user_collate is None or self.local_shards is None:
            return 0
        return self.local_shards()

    def _take_parts(self, batch: Any) -> Any:
        """The batch of a :class:`Collated`, its shards kept (on the device) for ``rt.shards``."""
        if not isinstance(batch, Collated):
            self.shard_batches, self.missing = None, 0
            return batch
        self.missing = batch.missing
        if batch.parts is None:
            self.shard_batches = None
        else:
            self.shard_batches = [None if part is None else to_device(part, self.device) for part in batch.parts]
        return batch.whole

    def _start_positions(self, name: str | None, on_batch: Callable[[Any], None] | None) -> None:
        self.name = name  # the key its position is saved under (set by the loop state)
        self.epoch = 0
        self.position = 0  # batches handed out by the current pass
        self.finished = False  # the current pass ran out or was left (``break``)
        self.ran_out = False  # the current pass handed out its last batch and ended (not left by ``break``)
        self._new_pass_marks()
        self.trained = False  # a batch of it fed a backward: its position matters for resume
        self.local_count = 0  # samples of this rank in the current batch
        self.global_count = 0  # samples of all ranks in the current batch
        self._resume: int | None = None  # a saved position the next passes start from
        self._passes = 0  # passes started; an older iterator leaves no mark
        self._pass_trained = False  # a batch of the current pass fed a backward
        self._epoch_set = False  # the epoch was set (set_epoch, a resume) since the current pass began
        self.live = False  # an iterator of a pass is out and not yet run out or left
        self._began: int | None = None  # the current pass's place among every loader's passes
        self._pass_epoch = 0  # the epoch the current pass read as it began
        self._resume_trained = False  # a saved pass continued by the next: whether it had fed a step
        self._on_batch = on_batch

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass read ``epoch`` (``rt.epochs`` calls this for you; without it, a pass after
        one that fed training reads the next epoch by itself)."""
        self._epoch_set = True
        if epoch != self.epoch:
            self.epoch, self.position, self.finished = epoch, 0, False
            self._resume = None

    def resume_at(self, epoch: int, position: int, *, ended: bool = False, trained: bool = False) -> None:
        """Continue ``epoch`` at batch ``position`` in the next passes, until one is trained on.

        Args:
            epoch: the epoch of the saved pass.
            position: the batches of it already handed out.
            ended: the pass was over when it was saved (read to its end, or left), so the next pass
                begins as it would have after it, not at ``position``.
            trained: a batch of the ended pass fed a backward: the next pass then reads the next
                epoch, where ``rt.epochs`` does not set the epochs.
        """
        self.ran_out = False
        if ended:
            self.epoch, self.position, self.finished = epoch, position, True
            self._resume, self._pass_trained, self._epoch_set = None, trained, False
            return
        self.epoch, self.position, self.finished = epoch, position, False
        self._resume, self._resume_trained = position, trained
        self._epoch_set = True

    def _new_pass_marks(self) -> None:
        """What the forwards of a pass tell (:func:`ddpkit.loop.steps.watch_forwards`), cleared as it begins."""
        self.handed: dict[int, weakref.ref[torch.Tensor]] = {}  # the tensors of the pass's batches, by id
        self.forwarded = False  # a forward with gradients ran while the pass was live and its batch latest
        self.forward_after = False  # a forward with gradients ran after the pass was over
        self.reread = False  # a forward with gradients took a tensor of the pass after it was over

    def _end_pass(self, this_pass: int, *, ran_out: bool = False) -> None:
        """A pass ran out or was left (``break``): the script's next pass is a new one."""
        if this_pass != self._passes:
            return
        self.finished, self.live, self.ran_out = True, False, ran_out
        if self._resume is not None and self.position == self._resume:  # a resumed pass with nothing left
            self._resume, self._pass_trained = None, self._resume_trained  # (a stream's end, a heal at it)

    def _begin_pass(self) -> tuple[int, int]:
        """(first batch, number) of a new pass. It reads the next epoch when the pass before fed a
        backward and nothing set the epoch since: a loop without ``rt.epochs`` or ``set_epoch`` (``for
        epoch in range(n)``, or ``next(it)`` with a new ``iter(loader)`` at its end) shuffles each pass
        anew, where torch's ``DistributedSampler`` would repeat the first epoch's order."""
        driven = self.epochs_driven is not None and self.epochs_driven()
        if self._pass_trained and not self._epoch_set and not driven:
            self.epoch += 1
            self._resume = None
        start = self._resume or 0
        self._passes += 1
        self.position, self.finished, self.live, self.ran_out = start, False, True, False
        self._new_pass_marks()
        self._began, self._pass_epoch = next(_PASSES), self.epoch
        self._pass_trained = self._epoch_set = False
        return start, self._passes

    def _check_pass(self, this_pass: int) -> None:
        """Refuse to go on with an iterator that a newer ``iter(loader)`` replaced."""
        if this_pass != self._passes:
            raise RuntimeError(
                "this iterator of a ddpkit loader was replaced by a newer "
                "iter(loader); iterate one pass at a time, like a DataLoader"
            )

    def mark_trained(self) -> None:
        """A batch of the current pass fed a backward: a pending resume point is used up."""
        self.trained = self._pass_trained = True
        self._resume = None
        if self.on_trained is not None:
            self.on_trained(self)

    def batch_weight(self) -> float:
        """Factor that turns this rank's mean loss into its share of the global-batch mean.

        DDP averages gradients over ``W`` ranks, so rank ``r`` must contribute
        ``sum_r / n_global * W`` = ``mean_r * n_r * W / n_global``.
        """
        if self.global_count == 0:
            return 1.0
        return self.local_count * self.sampler.world_size / self.global_count

    def signature(self) -> dict[str, Any]:
        """What must match for a saved position to mean the same batches again."""
        return self.sampler.signature()

    def position_record(self) -> dict[str, Any]:
        """Where the current pass stands, for a checkpoint (plain data)."""
        done = self.finished or (self.length_known and self.position >= len(self))
        return {
            "epoch": self.epoch,
            "position": self.position,
            "finished": done,
            # its iterator ran out or was left; not so a pass that handed out its last batch and is still
            # read (zip's second loader, whose StopIteration ends the zip at the first's next batch)
            "ran_out": self.finished,
            "pass_trained": self._pass_trained,
            "began": self._began if self._pass_trained else None,  # which pass of several began an epoch
            "pass_epoch": self._pass_epoch,
            "signature": self.signature(),
        }


class ShardedLoader(LoaderPosition):
    """An iterable of batches already on the device, sharded by :class:`GlobalBatchSampler`.

    Knows its epoch and the position of its current pass, so a checkpoint can resume mid-epoch,
    and the true sample counts of the current batch, so the loss can weigh an uneven last batch.
    Made by :meth:`ddpkit.Runtime.loader`.
    """

    cuts_global_batches = True
    """Its batches are this rank's share of fixed global batches: micro-shards can cut them."""

    reversed_slots: Callable[[], bool] | None = None
    """Asked at each pass's start: whether the rank reads its reversed-bits slot (:attr:`GlobalBatchSampler.slot`)."""

    def __init__(
        self,
        dataset: Any,
        sampler: GlobalBatchSampler,
        *,
        device: torch.device,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        seed: int = 0,
        on_batch: Callable[[ShardedLoader], None] | None = None,
        pin_memory: bool | None = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        name: str | None = None,
    ):
        self.dataset = dataset
        self.sampler = sampler
        sampler.loader = weakref.ref(self)  # loader.sampler.set_epoch(epoch), torch's habit, sets this loader's
        self.device = device
        self._start_positions(name, on_batch)
        self._plan: list[tuple[list[int], int]] = []  # (local part, global size) of each batch left
        workers = num_workers > 0
        self._keyed = _KeyedDataset(dataset, seed, sampler.rank, worker_init_fn)
        # (default_collate stacks: a shard cut from its batch is the one it makes of the shard's samples)
        self._user_collate = collate_fn
        self.num_workers = num_workers
        self._shard_collate = ShardCollate(collate_fn) if collate_fn is not None else None
        self._loader = DataLoader(
            self._keyed,
            batch_sampler=_EpochBatches(self),
            num_workers=num_workers,
            collate_fn=self._shard_collate or default_collate,
            pin_memory=device.type == "cuda" if pin_memory is None else pin_memory,
            persistent_workers=workers if persistent_workers is None else persistent_workers and workers,
            prefetch_factor=(prefetch_factor or 2) if workers else None,
            worker_init_fn=self._keyed.seed_worker if workers else None,
            generator=rng.private_generator(seed),
        )
        if workers:
            worker_stacks.add(self)

    def __iter__(self) -> Iterator[Any]:
        self._check_length()
        start, this_pass = self._begin_pass()
        self._keyed.start_epoch = self.epoch
        # One permutation per pass: the DataLoader's batch sampler reads this plan too.
        if self.reversed_slots is not None:  # decided a pass at a time (rt.setup may come after rt.loader)
            self.sampler.reversed_slots = self.reversed_slots()
        self._plan = [
            (self.sampler.local_part(batch), len(batch)) for batch in self.sampler.global_batches(self.epoch, start)
        ]
        ran_out = False
        try:
            with worker_stacks.starting_workers():
                batches = iter(self._loader)
            self._reading = weakref.ref(batches)  # (weakly: a pass's workers end with its iterator, as before)
            for batch, (local, total) in zip(batches, self._plan):
                self._check_pass(this_pass)
                batch = self._take_parts(batch)
                if not local:
                    batch = zero_rows(batch)
                self.position += 1
                self.local_count, self.global_count = len(local), total
                self.whole_batch = batch = to_device(batch, self.device)
                if self._on_batch is not None:
                    self._on_batch(self)
                yield batch
            ran_out = True
        finally:
            # Run out, or left by ``break``: either way the script's next pass is a new one.
            self._end_pass(this_pass, ran_out=ran_out)

    def _check_length(self) -> None:
        """Refuse a pass over a dataset that grew or shrank since the loader was built (samples labeled
        in active learning): the loader's batches cover the samples it was built for, so a DataLoader's
        ``RandomSampler`` would read the new ones where this pass silently would not."""
        now, built = len(self.dataset), self.sampler.dataset_length
        if now != built:
            raise UsageError(
                f"rt.loader {self.name!r}: its dataset holds {now} samples now and held {built} when the loader "
                "was built, and a loader reads the samples it was built for; build a new rt.loader over it "
                "after it changes (loader = rt.loader(...) inside the epoch loop)"
            )

    def __repr__(self) -> str:
        return f"ShardedLoader(name={self.name!r}, batches={len(self)}, epoch={self.epoch}, position={self.position})"


class QuorumLoader(ShardedLoader):
    """A fault-tolerant job's loader: each batch is this replica's part of the step's global batch,
    split over the replicas in that step's quorum (:class:`ddpkit.distributed.ft.Replica`).

    Before each batch the replicas form a quorum (a replica that is behind heals there, and its
    loader continues at the peer's epoch and position). The global batches are those of every
    other world size; only the split changes from step to step. A step that does not commit
    (a replica died during it) steps the position back, so the same global batch comes again,
    split over the new quorum. Samples are read in this process (no DataLoader workers).
    """

    def __init__(self, dataset: Any, sampler: GlobalBatchSampler, *, replica: Any, **options: Any):
        super().__init__(dataset, sampler, **options)
        self.replica = replica
        self._order: tuple[int, list[int]] | None = None
        self._ending = False  # in the quorum at the pass's end, before what is due there is done

    def _global_batch(self, index: int) -> list[int]:
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, self.sampler.order(self.epoch))
        size = self.sampler.global_batch_size
        return self._order[1][index * size : (index + 1) * size]

    def __iter__(self) -> Iterator[Any]:
        self._check_length()
        start, this_pass = self._begin_pass()
        ran_out = False
        try:
            while True:
                rank, world = self.replica.quorum()  # may heal: epoch and position become the peer's
                self._check_pass(this_pass)
                if self.position >= len(self):
                    self._at_pass_end()  # in this quorum: an infrequent sync's exchange due
                    break
                batch = self._global_batch(self.position)
                if self.replica.whole_batches:  # micro-shards: the quorum shares the shards, not the samples
                    rank, world = 0, 1
                self.sampler.rank, self.sampler.world_size = rank, world
                local = batch[rank::world]
                read = [self._keyed[(self.epoch, index)] for index in (local or batch[:1])]
                shards = self._local_shards() if local else 0
                if shards > 1 or self._user_collate is not None:
                    read.append(_ShardCount(shards, (self._keyed.seed, self.epoch, local or batch[:1])))
                samples = self._take_parts((self._shard_collate or default_collate)(read))
                if not local:
                    samples = zero_rows(samples)
                self.position += 1
                self.local_count, self.global_count = len(local), len(batch)
                self.whole_batch = samples = to_device(samples, self.device)
                if self._on_batch is not None:
                    self._on_batch(self)
                yield samples
                if self.position >= len(self):
                    self._at_pass_end()  # in a quorum of its own, if anything is due
                    break
            ran_out = True
        finally:
            self._end_pass(this_pass, ran_out=ran_out)

    def _at_pass_end(self) -> None:
        """What is due between steps (an infrequent sync's exchange), once a save still copying the
        weights it changes is done."""
        if self.replica.at_pass_end:
            background.WRITER.copied()
        self._ending = True
        try:
            for call in self.replica.at_pass_end:
                call()
        finally:
            self._ending = False

    def position_record(self) -> dict[str, Any]:
        """Where the pass stands; in the quorum at its end, not yet finished: a replica that heals
        there from this one does what is due there too (in the same quorum), then evaluates this
        epoch as this one does."""
        record = super().position_record()
        if self._ending:
            record["finished"] = record["ran_out"] = False
        return record

    def step_back(self) -> None:
        """The step of the batch in hand did not commit: hand out the same global batch again."""
        self.position = max(0, self.position - 1)
