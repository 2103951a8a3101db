"""Training functions for tests/test_loop_state.py, written the way real scripts are: importable,
so ``ddpkit.launch`` can spawn them, and run in-process for a world of one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ddpkit

N_TRAIN, GLOBAL_BATCH, EPOCHS = 50, 4, 3  # 13 steps per epoch, the last one short


class Toy(torch.utils.data.Dataset):
    """Seeded features and labels; augmentation noise from ddpkit.sample_rng()."""

    def __init__(self, length: int, offset: int = 0):
        generator = torch.Generator().manual_seed(100 + offset)
        self.x = torch.randn(length, 8, generator=generator)
        self.y = torch.randint(0, 3, (length,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        noise = 0.05 * torch.randn(8, generator=ddpkit.sample_rng())
        return self.x[index] + noise, self.y[index]


class Held(Toy):
    """Validation data: another dataset type, so its loader has its own identity."""


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))


def variations(mode: str, checkpoint: str, stop_at: int = 20, num_workers: int = 0) -> dict:
    """A loop with the habits of real scripts: ``load`` before the loaders, a shape probe, a
    validation loader read partly (``break``) inside and after each epoch, an end-of-epoch save.

    ``mode``: ``"full"`` runs to the end; ``"stop"`` saves to ``checkpoint`` after step ``stop_at``
    and returns; ``"resume"`` loads ``checkpoint`` first and runs to the end.
    """
    rt = ddpkit.init(seed=3)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    if mode == "resume":
        rt.load(checkpoint, state)  # before any loader exists
    train = rt.loader(Toy(N_TRAIN), global_batch_size=GLOBAL_BATCH, shuffle=True, num_workers=num_workers)
    val = rt.loader(Held(12, offset=1), global_batch_size=4)
    probe_x, _ = next(iter(train))  # a shape probe
    assert probe_x.shape[-1] == 8
    steps_per_epoch = []
    for _ in rt.epochs(EPOCHS):
        steps = 0
        for x, y in train:
            loss = F.cross_entropy(model(x), y)
            rt.backward(loss)
            if rt.step(optimizer):
                scheduler.step()
            steps += 1
            if rt.global_step % 5 == 0:  # a look at validation, cut short
                with torch.no_grad():
                    for vx, _ in val:
                        model(vx)
                        break
            if mode == "stop" and rt.global_step == stop_at:
                rt.save(checkpoint, state)
                rt.close()
                return {"stopped": rt.global_step}
        steps_per_epoch.append(steps)
        with torch.no_grad():
            next(iter(val))  # half-read validation at the end of the epoch
        rt.save(checkpoint + f".epoch{rt.epoch}", state)
    weights = {k: v.detach().clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
    result = {
        "weights": weights,
        "steps": rt.global_step,
        "steps_per_epoch": steps_per_epoch,
        "lr": scheduler.get_last_lr()[0],
    }
    rt.close()
    return result


def worker_draws(num_workers: int) -> dict:
    """Numbers the global torch / numpy / random generators give inside ``__getitem__``."""
    rt = ddpkit.init(seed=7)
    loader = rt.loader(_GlobalRandom(), batch_size=2, num_workers=num_workers)
    draws = {}
    for epoch in rt.epochs(2):
        draws[epoch] = [batch.tolist() for batch in loader]
    rt.close()
    return draws


class _GlobalRandom(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        import random

        import numpy as np

        return torch.tensor([float(torch.rand(())), float(np.random.rand()), random.random()])


def rank0_only_save(checkpoint: str, hang_timeout: float | None = None) -> dict:
    """The README habit gone wrong: ``if rt.is_main: rt.save(...)``."""
    rt = ddpkit.init(seed=0, save_timeout=5 if hang_timeout == 0 else 60, hang_timeout=hang_timeout)
    model = torch.nn.Linear(2, 1)
    model = rt.setup(model)
    if rt.is_main:
        rt.save(checkpoint, {"model": model})
    return {"rank": rt.rank}


def accumulation(mode: str, checkpoint: str, stop_after_batch: int = 4) -> dict:
    """``rt.accumulate(model, 3)``; ``"stop"`` saves after batch ``stop_after_batch`` (inside a group)."""
    rt = ddpkit.init(seed=5)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer}
    train = rt.loader(Toy(40), global_batch_size=4, shuffle=True)
    if mode == "resume":
        rt.load(checkpoint, state)  # after the loader this time
    batches = 0
    for _ in rt.epochs(2):
        for x, y in train:
            with rt.accumulate(model, 3):
                rt.backward(F.cross_entropy(model(x), y))
                rt.step(optimizer)
            batches += 1
            if mode == "stop" and batches == stop_after_batch:
                micro = rt._run.loop.micro_step
                rt.save(checkpoint, state)
                rt.close()
                return {"micro_step": micro}
    weights = {k: v.detach().clone().tolist() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
    result = {"weights": weights, "steps": rt.global_step, "batches": batches}
    rt.close()
    return result


def saved_before_its_step(checkpoint_dir: str, where: str) -> dict:
    """Accumulation by hand (``rt.backward(loss / 2)``, ``rt.step`` every 2 batches) with a save at
    ``where``: ``"mid-group"`` (after the group's first backward), ``"tail"`` (after a pass whose odd
    last batch left its gradients for the next pass), ``"stepped"`` (right after a step) or
    ``"dropped"`` (the first backward's gradients dropped by ``optimizer.zero_grad()``). Returns the
    error each rank raised (None: saved) and the checkpoints written."""
    import os

    rt = ddpkit.init(seed=5, checkpoint_dir=checkpoint_dir)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer}
    train = rt.loader(Toy(12), global_batch_size=4)  # 3 batches a pass: the last one opens a group
    raised = None
    try:
        for epoch in rt.epochs(2):
            for i, (x, y) in enumerate(train):
                rt.backward(F.cross_entropy(model(x), y) / 2)
                if where == "dropped" and epoch == 0 and i == 0:
                    optimizer.zero_grad()
                    rt.checkpoint(state)
                    raise StopIteration
                if where == "mid-group" and epoch == 0 and i == 0:
                    rt.checkpoint(state)
                if i % 2 == 1:
                    rt.step(optimizer)
                    if where == "stepped":
                        rt.checkpoint(state)
                        raise StopIteration
            if where == "tail":
                rt.checkpoint(state)
    except ddpkit.UsageError as exc:
        raised = str(exc)
    except StopIteration:
        pass
    rt.close()
    written = (
        sorted(f for f in os.listdir(checkpoint_dir) if f.endswith(".pt")) if os.path.isdir(checkpoint_dir) else []
    )
    return {"raised": raised, "written": written}


def failed_write(checkpoint_dir: str, blocking: bool = True) -> dict:
    """Rank 0 cannot write (a file stands where a directory should): every rank must raise, at
    this save (``blocking``) or, written in the background, at the next one."""
    rt = ddpkit.init(seed=0)
    model = rt.setup(torch.nn.Linear(2, 1))
    try:
        rt.save(checkpoint_dir, {"model": model}, blocking=blocking)
        if not blocking:
            rt.save(checkpoint_dir, {"model": model}, blocking=True)
    except ddpkit.DdpkitError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    except OSError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def bucket_views(as_views: bool | None = None) -> dict:
    """How many storages DDP's gradients live in after each backward, and whether rt.step clears them."""
    rt = ddpkit.init(seed=0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp_kwargs = {} if as_views is None else {"gradient_as_bucket_view": as_views}
    model, optimizer = rt.setup(model, optimizer, **ddp_kwargs)
    storages, cleared = [], []
    for _ in range(3):
        rt.backward(model(torch.randn(2, 4)).sum())
        storages.append({p.grad.untyped_storage().data_ptr() for p in model.parameters()})
        rt.step(optimizer)
        cleared.append(all(p.grad is None for p in model.parameters()))
    return {"storages": [len(s) for s in storages], "cleared": cleared}


def weighted_batches(num_samples: int, dataloader: bool = False) -> list:
    """The global batches a weighted loader gives, gathered from every rank; ``dataloader``: given as a
    DataLoader with a ``WeightedRandomSampler``."""
    rt = ddpkit.init(seed=9)
    weights = [0.0] * 5 + [1.0] * 5 + [8.0] * 2
    if dataloader:
        sampler = torch.utils.data.WeightedRandomSampler(weights, num_samples)
        loader = rt.loader(torch.utils.data.DataLoader(list(range(12)), batch_size=4, sampler=sampler))
    else:
        loader = rt.loader(list(range(12)), global_batch_size=4, weights=weights, num_samples=num_samples)
    seen = []
    for batch in loader:
        parts = ddpkit.all_gather_object(batch.tolist())
        seen.append(sorted(i for part in parts for i in part))
    rt.close()
    return seen


class Augmented(torch.utils.data.Dataset):
    """A transform that draws from torch's, numpy's and ``random``'s global generators, as torchvision's
    random transforms, albumentations and ``random.random() < 0.5`` flips do."""

    def __init__(self, draws: bool = True) -> None:
        self.draws = draws

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> torch.Tensor:
        import random

        import numpy as np

        noise = [float(torch.rand(1)), float(np.random.rand()), random.random()] if self.draws else [0.0] * 3
        return torch.tensor([float(index), *noise], dtype=torch.float64)


class AugmentedStream(torch.utils.data.IterableDataset):
    """:class:`Augmented` as a plain stream: each sample's draws are made as the stream reaches it."""

    def __init__(self, draws: bool = True) -> None:
        self.samples = Augmented(draws)

    def __iter__(self):
        return (self.samples[i] for i in range(len(self.samples)))


def drawing_worker_init(worker_id: int) -> None:
    """A ``worker_init_fn`` that draws (a shuffle, a number to log) and seeds nothing."""
    import random

    import numpy as np

    random.shuffle(list(range(10)))
    np.random.randint(10)


def recipe_worker_init(worker_id: int) -> None:
    """PyTorch's reproducibility notes' ``seed_worker``: numpy and ``random`` from torch's worker seed."""
    import random

    import numpy as np

    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def global_draws(num_workers: int, draws: bool = True, stream: bool = False, worker_init: str | None = None) -> dict:
    """Each sample's draws from torch's, numpy's and ``random``'s global generators in ``__getitem__``,
    by (epoch, index), over every rank; and the loop's own draws from the three after each batch (the
    streams outside the reads). ``worker_init``: the name of a ``worker_init_fn`` here."""
    import random

    import numpy as np

    rt = ddpkit.init(seed=4)
    model = torch.nn.Linear(2, 2)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = AugmentedStream(draws) if stream else Augmented(draws)
    given = {"worker_init_fn": globals()[worker_init]} if worker_init else {}
    loader = rt.loader(data, global_batch_size=8, shuffle=True, num_workers=num_workers, **given)
    seen, outside = {}, []
    for epoch in rt.epochs(2):
        for batch in loader:
            seen.update({f"{epoch},{int(row[0])}": row[1:].tolist() for row in batch})
            outside.append([float(torch.rand(1)), float(np.random.rand()), random.random()])
            model(torch.zeros(1, 2)).sum().backward()
            rt.step(optimizer)
    merged = {key: value for part in ddpkit.all_gather_object(seen) for key, value in part.items()}
    rt.close()
    return {"seen": merged, "outside": outside}


class Corrupt(torch.utils.data.Dataset):
    """Samples of which every seventh comes as None (a file that fails to decode)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int):
        if index % 7 == 3:
            return None
        generator = torch.Generator().manual_seed(index)
        return torch.randn(4, generator=generator), torch.tensor(index % 2)


def skip_none(samples: list) -> object:
    """The usual collate for such a dataset: the samples that came, stacked."""
    return torch.utils.data.default_collate([sample for sample in samples if sample is not None])


class CorruptStream(torch.utils.data.IterableDataset):
    """:class:`Corrupt`'s samples as a stream."""

    def __iter__(self):
        samples = Corrupt()
        return (samples[index] for index in range(len(samples)))


def corrupt_samples(counted: bool, micro_shards: int = 0, stream: bool = False, num_workers: int = 0) -> dict:
    """A loop over :class:`Corrupt` (``stream``: :class:`CorruptStream`) with :func:`skip_none`: ``counted``
    weighs each backward by its samples."""
    with ddpkit.init(seed=0) as rt:
        net = torch.nn.Linear(4, 2)
        options = {"micro_shards": micro_shards} if micro_shards else {}
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1), **options)
        data = CorruptStream() if stream else Corrupt()
        for x, y in rt.loader(data, global_batch_size=8, collate_fn=skip_none, num_workers=num_workers):
            for xs, ys in rt.shards(x, y) if micro_shards else [(x, y)]:
                loss = F.cross_entropy(model(xs), ys)
                rt.backward(loss, count=len(ys)) if counted else rt.backward(loss)
            rt.step(optimizer)
        return {name: tensor.clone() for name, tensor in net.state_dict().items()}


def stages(
    checkpoint_dir: str, stop_at: int | None = None, break_after: int | None = None, between: bool = False
) -> dict:
    """A warm-up stage (``rt.epochs(2)``) then a fine-tuning one at a lower rate (``rt.epochs(3)``),
    checkpoints every 4 steps, resumed where one is; ``stop_at``: closes after that step, as a crash
    would end it; ``break_after``: leaves the warm-up by ``break`` after that many batches; ``between``: a
    checkpoint between the loops too. What each loop yielded, ``rt.epoch`` at each, and the weights."""
    rt = ddpkit.init(seed=5, checkpoint_dir=checkpoint_dir, resume="auto")
    model = _model()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    state = {"model": model, "optimizer": optimizer}
    rt.resume(state)
    train = rt.loader(Toy(40), global_batch_size=8, shuffle=True)
    seen: list = []

    def one_epoch(stage: str, epoch: int) -> bool:
        seen.append((stage, epoch, rt.epoch))
        for batch, (x, y) in enumerate(train):
            rt.backward(F.cross_entropy(model(x), y))
            rt.step(optimizer)
            if rt.global_step % 4 == 0:
                rt.checkpoint(state)
            if rt.global_step == stop_at:
                return False
            if stage == "warm-up" and batch + 1 == break_after:
                return False
        return True

    for epoch in rt.epochs(2):
        if not one_epoch("warm-up", epoch):
            break
    if between and rt.global_step != stop_at:
        rt.checkpoint(state)
    if rt.global_step != stop_at:
        for group in optimizer.param_groups:
            group["lr"] = 0.02
        for epoch in rt.epochs(3):
            if not one_epoch("fine-tuning", epoch):
                break
    weights = {k: v.detach().clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
    result = {"seen": seen, "steps": rt.global_step, "weights": weights}
    rt.close()
    return result
