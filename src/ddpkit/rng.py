"""Every seed and random state of a run: seeding, per-sample randomness, capture and restore.

:func:`seed_everything` seeds a process; :func:`sample_rng` gives the sample being read its own
generator, keyed by (seed, epoch, index) so augmentations never change with the number of
processes or workers (:func:`reading` marks that sample and keys torch's global generator for its
read, :func:`collating` keys a ``collate_fn``'s draws by its samples, :func:`seed_worker_globals` seeds
a loader worker); :func:`rng_state` and :func:`set_rng_state` are the states a checkpoint holds.

A base module (it imports nothing of ddpkit). Every state is made of tensors and plain values,
so a checkpoint holding it loads with ``torch.load(weights_only=True)``; numpy's state tuple
(:func:`numpy_state`) is also how PowerSGD's generator is saved (:mod:`ddpkit.parallel.compression`).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

try:  # a dependency of ddpkit; an image with CUDA torch alone (make gpu-check) may lack it
    import numpy as np
except ImportError:  # pragma: no cover - exercised by tests/test_bench.py's bare interpreter
    np = None  # type: ignore[assignment]


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch identically (the same initial weights on every rank)."""
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass(frozen=True)
class SampleKey:
    """Which sample is being read: the run's seed, the epoch and the dataset index."""

    seed: int
    epoch: int
    index: int


_current_key: SampleKey | None = None


def _seed_of(text: str) -> int:
    """A 63-bit seed hashed from ``text``."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample in one epoch, independent of rank, worker and world size."""
    return _seed_of(f"{seed}:{epoch}:{index}")


def sample_rng(device: str | torch.device = "cpu") -> torch.Generator:
    """A generator for augmentations of the sample being read, keyed by (seed, epoch, index).

    Call it inside ``Dataset.__getitem__`` (or a transform) of a dataset read through a ddpkit
    loader. Augmentations then differ across samples and epochs but never change with the
    number of processes or workers.

    Example:
        >>> class Noisy(torch.utils.data.Dataset):
        ...     def __len__(self): return 4
        ...     def __getitem__(self, i):
        ...         return torch.randn(2, generator=ddpkit.sample_rng())   # doctest: +SKIP
    """
    if _current_key is None:
        raise RuntimeError("sample_rng() is only available while a ddpkit loader reads a sample")
    key = _current_key
    return torch.Generator(device=device).manual_seed(sample_seed(key.seed, key.epoch, key.index))


def global_seed(key: SampleKey) -> int:
    """The seed of torch's global generator while sample ``key`` is read: keyed as :func:`sample_seed`,
    apart from :func:`sample_rng`'s stream (a script that draws from both gets two streams)."""
    return _seed_of(f"{key.seed}:{key.epoch}:{key.index}:global")


_torch_keyed = True
"""This process keys torch's global generator while a sample is read: False in a loader worker whose
``worker_init_fn`` (the script's) seeded torch itself, whose stream then wins, as the script asked."""

_numpy_keyed = True
"""The same for numpy's global generator (``np.random.seed`` in the script's ``worker_init_fn``)."""

_random_keyed = True
"""The same for ``random``'s (``random.seed`` in the script's ``worker_init_fn``)."""


def run_worker_init(worker_init_fn: Any, worker_id: int) -> None:
    """Run the script's ``worker_init_fn`` after ddpkit's seeding of the worker; one that seeds a global
    generator itself (``torch.manual_seed``, ``np.random.seed``, ``random.seed``, or sets its state)
    keeps that generator's stream for the samples' reads too. Seeding numpy and ``random`` from
    ``torch.initial_seed()``, as PyTorch's reproducibility notes do so that workers draw apart, asks for
    nothing the keyed reads do not give, and keeps them keyed. A draw is not a seeding."""
    global _torch_keyed, _numpy_keyed, _random_keyed
    before = torch.initial_seed()
    calls: set[str] = set()
    recipe = before % 2**32  # the notes' `worker_seed = torch.initial_seed() % 2**32`

    def watched(module: Any, name: str, kind: str) -> Any:
        original = getattr(module, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if not (name == "seed" and len(args) == 1 and not kwargs and args[0] == recipe):
                calls.add(kind)
            return original(*args, **kwargs)

        return original, call

    targets = [(random, "seed", "random"), (random, "setstate", "random")]
    if np is not None:
        targets += [(np.random, "seed", "numpy"), (np.random, "set_state", "numpy")]
    originals = []
    for module, name, kind in targets:
        original, call = watched(module, name, kind)
        originals.append((module, name, original))
        setattr(module, name, call)
    try:
        worker_init_fn(worker_id)
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
    if torch.initial_seed() != before:
        _torch_keyed = False
    if "numpy" in calls:
        _numpy_keyed = False
    if "random" in calls:
        _random_keyed = False


@contextlib.contextmanager
def reading(key: SampleKey | None) -> Iterator[None]:
    """Mark the sample ``key`` as the one being read for the block (what :func:`sample_rng` keys on).

    The one place the current sample is set: the loaders, the stream readers and the shard
    readers all read a sample inside it, and it is cleared after, also when the read fails.

    For the block, torch's, numpy's and ``random``'s global generators draw from the sample's own seeds
    (:func:`global_seed`, apart for each): a transform that draws from them (torchvision's
    ``RandomCrop``, ``np.random`` draws, ``random.random() < 0.5``; not recent albumentations, which
    keeps a generator of its own) gives each sample the same
    numbers on any number of processes or workers, and a run resumed mid-epoch the numbers an
    uninterrupted run drew. torch's state is put back after each read, so the stream outside the read
    (the main process's dropout) goes on as before; numpy's and ``random``'s
    are put back where the main process reads (a worker's own streams serve no one else), once a batch
    inside :func:`holding` (numpy's state costs about 90 us to save and put back). A worker whose
    ``worker_init_fn`` seeded a generator itself keeps that generator's stream (:func:`run_worker_init`).
    """
    global _current_key
    _current_key = key
    keyed = key is not None and _torch_keyed
    outside = torch.default_generator.get_state() if keyed else None
    if keyed:
        torch.default_generator.manual_seed(global_seed(key))
    held = None
    if key is not None and (_numpy_keyed or _random_keyed):
        held = None if _holds or _in_worker() else _globals_state()
        _seed_globals(f"{key.seed}:{key.epoch}:{key.index}")  # the sample's own seeds
    try:
        yield
    finally:
        _current_key = None
        if outside is not None:
            torch.default_generator.set_state(outside)
        if held is not None:
            _put_globals_back(held)


@contextlib.contextmanager
def collating(seed: int, epoch: int, indices: Sequence[int]) -> Iterator[None]:
    """The script's ``collate_fn`` draws in the block from streams keyed by the samples it collates: (seed,
    epoch, their indices in order), as each sample's read is keyed by its own.

    A collate that draws (a language model's masks, ``torch.bernoulli`` in Hugging Face's
    ``DataCollatorForLanguageModeling``; mixup's weight in timm's collate) drew from the process's
    stream: in a loader worker, one seeded per rank and worker that a resumed run starts afresh (a run
    resumed mid-epoch ended 1e-2 from the uninterrupted one), and under ``micro_shards`` one that
    another number of processes advances otherwise. torch's state is put back after the block;
    numpy's and ``random``'s as after a read (once a batch in the main process, inside :func:`holding`;
    not in a worker). A worker whose ``worker_init_fn`` seeded a generator itself keeps its stream.
    """
    text = f"{seed}:{epoch}:collate:{','.join(map(str, indices))}"
    outside = torch.default_generator.get_state() if _torch_keyed else None
    if outside is not None:
        torch.default_generator.manual_seed(_seed_of(f"{text}:torch"))
    with holding():
        _seed_globals(text)
        try:
            yield
        finally:
            if outside is not None:
                torch.default_generator.set_state(outside)


_holds = 0
"""Open :func:`holding` blocks: numpy's and ``random``'s states are put back at the outermost one's end."""


@contextlib.contextmanager
def holding() -> Iterator[None]:
    """Reads of several samples (a batch) in the block, with numpy's and ``random``'s global states put
    back once at its end rather than after each read (:func:`reading`); nothing in a loader worker."""
    global _holds
    if _in_worker() or not (_numpy_keyed or _random_keyed):
        yield
        return
    held = _globals_state() if _holds == 0 else None
    _holds += 1
    try:
        yield
    finally:
        _holds -= 1
        if held is not None:
            _put_globals_back(held)


def _in_worker() -> bool:
    return torch.utils.data.get_worker_info() is not None


def _keyed(every: bool) -> tuple[bool, bool]:
    """Whether numpy's and ``random``'s global generators are keyed: both (``every``: a micro-shard's draws),
    else those a loader worker's ``worker_init_fn`` left to ddpkit."""
    return (True, True) if every else (_numpy_keyed, _random_keyed)


def _globals_state(*, every: bool = False) -> tuple[Any, Any]:
    numpy, python = _keyed(every)
    return (np.random.get_state() if np is not None and numpy else None), (random.getstate() if python else None)


def _put_globals_back(state: tuple[Any, Any]) -> None:
    numpy, python = state
    if numpy is not None:
        np.random.set_state(numpy)
    if python is not None:
        random.setstate(python)


def _seed_globals(text: str, *, every: bool = False) -> None:
    """numpy's and ``random``'s global generators at ``text``'s own seeds (each its own stream)."""
    numpy, python = _keyed(every)
    if np is not None and numpy:
        np.random.seed(_seed_of(f"{text}:numpy") % 2**32)
    if python:
        random.seed(_seed_of(f"{text}:random"))


def key_globals(text: str) -> None:
    """torch's (every device's), numpy's and ``random``'s global generators at ``text``'s own seeds: the
    draws that follow are the same wherever ``text`` is (a micro-shards batch's,
    :meth:`ddpkit.parallel.exact.Exact.key_batch`)."""
    seed_torch(_seed_of(f"{text}:torch"))
    _seed_globals(text, every=True)


def seed_torch(seed: int) -> None:
    """``torch.manual_seed(seed)`` for the CPU and an initialised CUDA, the same bits, at a hundredth of its
    cost where it runs per batch and per shard: where a device is not initialised (CUDA, MPS and XPU on a
    build without a GPU), ``torch.manual_seed`` queues a seed for it, formatting the caller's stack for
    each (86 us a call on this project's CPU machine)."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # (a run on a GPU has made its context by now)
        torch.cuda.manual_seed_all(seed)


@contextlib.contextmanager
def keyed_globals(key: int) -> Iterator[None]:
    """numpy's and ``random``'s global generators draw from ``key``'s own seeds in the block, and go on from
    where they were after it: a micro-shard's draws in the training loop (``np.random.beta`` for mixup,
    ``random.random() < p``), as torch's do there (:meth:`ddpkit.parallel.exact.Exact.shards`)."""
    saved = _globals_state(every=True)
    _seed_globals(str(key), every=True)
    try:
        yield
    finally:
        _put_globals_back(saved)


def current_sample() -> SampleKey | None:
    """The (seed, epoch, index) of the sample being read, or None outside a ddpkit loader."""
    return _current_key


def private_generator(seed: int = 0) -> torch.Generator:
    """A generator for a DataLoader's worker base seed.

    Without one, every ``iter(DataLoader)`` draws from the global torch RNG, so a run resumed
    mid-epoch (one more iterator) would see other dropout masks than an uninterrupted run.
    """
    return torch.Generator().manual_seed(seed)


def seed_worker_globals(seed: int, epoch: int, rank: int, worker: int) -> None:
    """Seed a loader worker's global torch / numpy / ``random`` generators from (seed, epoch,
    rank, worker id), so ranks and workers draw different numbers (never a sample's key).

    Args:
        seed: the loader's seed.
        epoch: the epoch the worker reads.
        rank: the worker's process's global rank.
        worker: the DataLoader worker's id on that rank (0 to ``num_workers - 1``).
    """
    value = sample_seed(seed, epoch, -1 - (rank * 4096 + worker))
    # a generator the script's worker_init_fn seeded (run_worker_init) keeps its stream: a persistent
    # worker reading a new epoch goes on with it, as torch's persistent workers do
    if _random_keyed:
        random.seed(value)
    if _torch_keyed:
        torch.manual_seed(value)
    if np is not None and _numpy_keyed:
        np.random.seed(value % 2**32)


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch, its CUDA device's, numpy, python) as tensors and plain values."""
    state = {
        **torch_state(),
        "numpy": numpy_state(np.random.get_state()) if np is not None else None,
        "python": _to_lists(random.getstate()),
    }
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    set_torch_state(state)
    if np is not None and state.get("numpy") is not None:
        np.random.set_state(numpy_state_tuple(state["numpy"]))
    random.setstate(_to_tuples(state["python"]))


def check_state(state: Mapping[str, Any]) -> None:
    """Try what :func:`set_rng_state` would restore on generators of each kind that nobody draws from.

    Raises:
        ValueError: naming the part (``"torch"``, ``"python"``, ``"numpy"``, ``"cuda"``) that no
            generator of its kind takes.
    """
    tries = {
        "torch": lambda: torch.Generator().set_state(state["torch"]),
        "python": lambda: random.Random().setstate(_to_tuples(state["python"])),
    }
    if np is not None and state.get("numpy") is not None:
        tries["numpy"] = lambda: np.random.RandomState().set_state(numpy_state_tuple(state["numpy"]))
    for part, call in tries.items():
        try:
            call()
        except (TypeError, ValueError, RuntimeError, KeyError, IndexError, OverflowError, AttributeError):
            raise ValueError(part) from None
    cuda = state.get("cuda")  # a CUDA generator's state is a byte tensor (a list of them before)
    if cuda is not None and not all(
        isinstance(c, torch.Tensor) and c.dtype == torch.uint8 for c in (cuda if isinstance(cuda, list) else [cuda])
    ):
        raise ValueError("cuda")


def torch_state() -> dict[str, Any]:
    """torch's generator and, where this process has started CUDA, the generator of its own device.

    Its own device's only, not every visible GPU's: a resume where each process sees another number
    of GPUs (``srun --gpus-per-task=1`` after 8 GPUs a node) would otherwise index past them. A process
    that has not started CUDA has drawn nothing there, and reading the state would start it: a context
    on GPU 0 in every rank of a CPU run on a GPU host, which a GPU in exclusive-process mode refuses.
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_torch_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`torch_state` captured (the CUDA state into this process's own device).

    A checkpoint from before held every visible GPU's states, a list: the entry of this process's
    device is taken where there is one.
    """
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_initialized():  # a process that has not started CUDA draws nothing there
        return
    device = torch.cuda.current_device()
    if isinstance(cuda, (list, tuple)):
        if device >= len(cuda):
            return  # saved where fewer GPUs were visible: this device's stream was not among them
        cuda = cuda[device]
    torch.cuda.set_rng_state(cuda, device)


def numpy_state(state: tuple) -> list[Any]:
    """A numpy ``RandomState.get_state()`` tuple as a tensor and plain values (``weights_only``-safe)."""
    kind, keys, pos, has_gauss, gauss = state
    return [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]


def numpy_state_tuple(saved: list[Any]) -> tuple:
    """What :func:`numpy_state` made, back as the tuple ``set_state`` takes."""
    kind, keys, pos, has_gauss, gauss = saved
    return (kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss)


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, tuple) else value


def _to_tuples(value: Any) -> Any:
    return tuple(_to_tuples(v) for v in value) if isinstance(value, list) else value
