"""Functions run in child processes by tests (module level so spawned children can import them)."""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

import ddpkit
import ddpkit._torch
import ddpkit.checkpoint
import ddpkit.loop.sampler


def rank_sum() -> dict:
    rt = ddpkit.init()
    return {"rank": rt.rank, "world_size": rt.world_size, "sum": int(rt.all_reduce(rt.rank))}


def environment() -> dict:
    """This process's environment, parent pid, threads and torch's threads; prints a line to stdout and stderr."""
    import os
    import sys
    import threading

    # one write a line: print's text and its newline are two writes, which the ranks' unbuffered
    # streams interleave ("stdout of rank 0 ...stdout of rank 1 ...", then two newlines)
    for stream, name in ((sys.stdout, "stdout"), (sys.stderr, "stderr")):
        stream.write(f"{name} of rank {os.environ['RANK']} in launch {os.environ.get('DDPKIT_TEST_MARK')}\n")
        stream.flush()
    return {
        "environ": dict(os.environ),
        "ppid": os.getppid(),
        "threads": [thread.name for thread in threading.enumerate()],
        "torch_threads": torch.get_num_threads(),
    }


def fail_on_rank_one() -> None:
    rt = ddpkit.init()
    if rt.rank == 1:
        raise ValueError("rank one refuses")
    rt.barrier()


def gather_uneven() -> list:
    import torch

    rt = ddpkit.init()
    rows = torch.full((rt.rank, 2), float(rt.rank))  # rank 0 holds zero rows
    gathered = rt.all_gather(rows)
    means = rt.all_reduce(torch.tensor([float(rt.rank)]), op="mean")
    return [gathered.tolist(), means.tolist(), rt.all_reduce(rt.rank, op="max")]


# -- training workers ---------------------------------------------------------------------


def _toy_data(length: int = 100):
    import torch

    generator = torch.Generator().manual_seed(123)
    images = torch.randn(length, 1, 8, 8, generator=generator)
    labels = torch.randint(0, 10, (length,), generator=generator)
    return torch.utils.data.TensorDataset(images, labels, torch.arange(length))


def train_steps(
    steps: int,
    global_batch: int = 12,
    length: int = 100,
    sync_bn: bool = True,
    stop_at: int | None = None,
    checkpoint_dir: str | None = None,
) -> dict:
    """Train the seeds' ConvNet for ``steps`` steps; returns weights and the samples of each step.

    With ``checkpoint_dir``: resume from it when it holds a checkpoint, and with ``stop_at``
    save there after that step and stop.
    """
    import torch
    import torch.nn.functional as F

    from ddpkit.recipes.models import build_model

    rt = ddpkit.init(seed=0)
    model = build_model("convnet", num_classes=10, in_channels=1, image_size=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer, sync_batchnorm=sync_bn)
    loader = rt.loader(_toy_data(length), global_batch_size=global_batch, shuffle=True)
    state = {"model": model, "optimizer": optimizer}
    if checkpoint_dir is not None and ddpkit.checkpoint.latest(checkpoint_dir) is not None:
        rt.load(checkpoint_dir, state)
    visited = []
    for _ in rt.epochs(10**6):
        for images, labels, index in loader:
            loss = F.cross_entropy(model(images), labels)
            rt.backward(loss)
            rt.step(optimizer)
            visited.append(sorted(rt.all_gather(index).tolist()))
            if rt.global_step == stop_at:
                rt.save(checkpoint_dir, state)
                return {"stopped": stop_at}
            if rt.global_step == steps:
                break
        if rt.global_step == steps:
            break
    weights = {k: v.detach().clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
    return {"weights": weights, "visited": visited, "epoch": rt.epoch}


class _NoisyToy(torch.utils.data.Dataset):
    """Toy samples with per-sample augmentation noise from ddpkit.sample_rng()."""

    def __init__(self):
        self.base = _toy_data(60)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        import torch

        image, label, _ = self.base[index]
        return image + 0.1 * torch.randn(image.shape, generator=ddpkit.sample_rng()), label


def resumable_run(total_steps: int, stop_at: int | None, checkpoint_dir: str) -> dict:
    """Dropout + momentum + augmentation; optionally stop after ``stop_at`` steps or resume."""
    import os

    import torch
    import torch.nn.functional as F

    rt = ddpkit.init(seed=4)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(_NoisyToy(), global_batch_size=8, shuffle=True)
    state = {"model": model, "optimizer": optimizer, "note": "plain values survive too"}
    if stop_at is None and os.listdir(checkpoint_dir):
        rt.load(checkpoint_dir, state)
    for _ in rt.epochs(10):
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            rt.backward(loss)
            rt.step(optimizer)
            if rt.global_step == stop_at:
                rt.save(checkpoint_dir, state)
                return {"stopped": rt.global_step}
            if rt.global_step == total_steps:
                break
        if rt.global_step == total_steps:
            break
    weights = {k: v.detach().clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
    return {"weights": weights, "step": rt.global_step, "note": state["note"]}


# -- evaluation workers -------------------------------------------------------------------

LENGTHS = (1, 7, 1000, 1001)


class IndexedModel(torch.nn.Module):
    """Logits from features 1..8, and column 0 (the sample's index) passed through."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.linear = torch.nn.Linear(8, 5)

    def forward(self, x):
        return {"logits": self.linear(x[:, 1:]), "index": x[:, 0].round().long()}


class LogitsOnly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = IndexedModel()

    def forward(self, x):
        return self.inner(x)["logits"]


def indexed_dataset(length: int):
    generator = torch.Generator().manual_seed(length)
    features = torch.randn(length, 9, generator=generator)
    features[:, 0] = torch.arange(length, dtype=torch.float32)
    labels = torch.randint(0, 5, (length,), generator=generator)
    return torch.utils.data.TensorDataset(features, labels)


def evaluate_everything(stream_dir: str | None = None) -> dict:
    import torchmetrics

    from ddpkit import predict_to_file

    rt = ddpkit.init()
    results = {}
    for length in LENGTHS:
        data = indexed_dataset(length)
        main = ddpkit.predict(IndexedModel(), data, batch_size=64, to="main")
        everywhere = ddpkit.predict(IndexedModel(), data, batch_size=64, to="all")
        accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=5)
        metrics = ddpkit.evaluate(
            LogitsOnly(), data, num_classes=5, batch_size=64, extra_metrics={"tm_accuracy": accuracy}
        )
        streamed = None
        if stream_dir is not None:
            path = predict_to_file(LogitsOnly(), data, f"{stream_dir}/pred{length}.npy", batch_size=64)
            streamed = None if path is None else str(path)
        results[length] = {
            "main": main,
            "all": everywhere,
            "metrics": metrics,
            "streamed": streamed,
            "shard": len(ddpkit.loop.sampler.batch_shard(length, 64, rt.rank, rt.world_size)),
        }
    return results


def resume_auto_step(checkpoint_dirs: list[str]) -> int:
    """Resume automatically from this rank's own directory; the step every rank ended up at."""
    import os

    rt = ddpkit.init(seed=0, checkpoint_dir=checkpoint_dirs[int(os.environ["RANK"])], resume="auto")
    model = rt.setup(torch.nn.Linear(4, 2))
    rt.resume({"model": model})
    return rt.global_step


def accumulated_run(steps: int, global_batch: int) -> dict:
    """Two passes over 18 samples with ``rt.accumulate(model, steps)``; rank 0's final weights."""
    import torch.nn.functional as F

    rt = ddpkit.init(seed=0)
    generator = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(
        torch.randn(18, 3, generator=generator), torch.randn(18, 1, generator=generator)
    )
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(data, global_batch_size=global_batch, shuffle=True)
    for _ in rt.epochs(2):
        for x, y in loader:
            with rt.accumulate(model, steps):
                rt.backward(F.mse_loss(model(x), y))
                rt.step(optimizer)
    weights = {k: v.detach().clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
    return {"weights": weights, "steps": rt.global_step}


def accumulation_allreduces(group_sizes: list[int], batches: int) -> list[dict]:
    """DDP's allreduce calls (bucket indices) in one pass of ``batches`` batches per group size."""
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    rt = ddpkit.init(seed=0)
    generator = torch.Generator().manual_seed(6)
    data = torch.utils.data.TensorDataset(
        torch.randn(4 * batches, 3, generator=generator), torch.randn(4 * batches, 1, generator=generator)
    )
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    buckets: list[int] = []

    def counting_allreduce(process_group, bucket):
        buckets.append(bucket.index())
        return default_hooks.allreduce_hook(process_group, bucket)

    model.register_comm_hook(None, counting_allreduce)
    loader = rt.loader(data, global_batch_size=4)
    passes = []
    for steps in group_sizes:
        buckets.clear()
        before = rt.global_step
        for x, y in loader:
            with rt.accumulate(model, steps):
                rt.backward(F.mse_loss(model(x), y))
                rt.step(optimizer)
        passes.append({"buckets": list(buckets), "steps": rt.global_step - before})
    return passes


def buffer_broadcasts() -> dict:
    """Whether DDP's forward broadcasts buffers, with sync BN and without (``{True: ..., False: ...}``).

    A buffer tagged with the rank after setup survives a forward only without a broadcast.
    """
    rt = ddpkit.init(seed=0)
    found = {}
    for sync_batchnorm in (True, False):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        model.register_buffer("tag", torch.zeros(()))
        model = rt.setup(model, sync_batchnorm=sync_batchnorm)
        module = ddpkit._torch.unwrap(model)
        module.tag.fill_(float(rt.rank))  # after setup: DDP's start-up broadcast is done
        model(torch.randn(8, 4))
        found[sync_batchnorm] = {
            "tag": float(module.tag),
            "flag": bool(model.broadcast_buffers),
            "sync_bn": any(type(m).__name__ == "SyncBatchNorm" for m in module.modules()),
        }
    return found


class AugmentedIndex(torch.utils.data.Dataset):
    """Each sample's index and three numbers of noise from ``ddpkit.sample_rng()``."""

    def __len__(self):
        return 30

    def __getitem__(self, index):
        return torch.tensor(index), torch.randn(3, generator=ddpkit.sample_rng())


def augmented_batches(num_workers: int, epochs: int = 2) -> list:
    """(indices, noise) of every batch this rank saw over ``epochs`` shuffled epochs."""
    rt = ddpkit.init(seed=7)
    loader = rt.loader(AugmentedIndex(), global_batch_size=6, shuffle=True, num_workers=num_workers)
    seen = []
    for _ in rt.epochs(epochs):
        for index, noise in loader:
            seen.append((index.tolist(), noise.tolist()))
    return seen


def three_layers():
    torch.manual_seed(0)  # 1 MiB + 4 MiB + 40 KiB of fp32 weights: more than DDP's 1 MiB first bucket
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


def bucket_layout(model, steps: int = 2) -> list[list[list[str]]]:
    """Per step, the parameter names of each bucket in the order DDP reduces them (a comm hook)."""
    names = {id(p): n.removeprefix("module.") for n, p in model.named_parameters()}
    seen: list[list[str]] = []

    def record(state, bucket):
        seen.append([names[id(p)] for p in bucket.parameters()])
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    model.register_comm_hook(None, record)
    layouts = []
    for _ in range(steps):
        seen.clear()
        model(torch.randn(4, 256, device=next(model.parameters()).device)).sum().backward()
        layouts.append(list(seen))
    return layouts


def ddpkit_bucket_layout() -> list:
    """The bucket layout of a model set up by rt.setup (several processes), over two steps."""
    rt = ddpkit.init(seed=0)
    model = rt.setup(three_layers())
    return bucket_layout(model)


def ddpkit_bucket_count() -> tuple:
    """What _torch.ddp_bucket_count says of a model set up by rt.setup, and the buckets a comm hook saw."""
    from ddpkit import _torch

    rt = ddpkit.init(seed=0)
    model = rt.setup(three_layers())
    return _torch.ddp_bucket_count(model), len(bucket_layout(model, steps=1)[0])


def digits_convnet(dtype_name: str, epochs: int = 1, sync_bn: bool = True) -> dict:
    """The demo's ConvNet on digits (global batch 64, SGD lr 0.05 momentum 0.9) in ``dtype_name``;
    returns rank 0's final weights."""
    import torch
    import torch.nn.functional as F

    from ddpkit.recipes.datasets import load_dataset
    from ddpkit.recipes.models import build_model

    dtype = getattr(torch, dtype_name)
    rt = ddpkit.init(seed=0)
    info = load_dataset("digits", "train")
    model = build_model("convnet", num_classes=10, in_channels=info.in_channels, image_size=info.image_size).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer, sync_batchnorm=sync_bn)
    loader = rt.loader(info.dataset, global_batch_size=64, shuffle=True)
    for _ in rt.epochs(epochs):
        for images, labels in loader:
            rt.backward(F.cross_entropy(model(images.to(dtype)), labels))
            rt.step(optimizer)
    weights = {k: v.detach().clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
    rt.close()
    return weights


def periodic_run(
    sync: str,
    total_steps: int,
    stop_at: int | None,
    checkpoint_dir: str,
    every: int | None = 3,
    sync_dtype: str | None = None,
    accumulate: int = 1,
    fragments: int = 1,
    delay: int = 0,
) -> dict:
    """resumable_run's model and data under an infrequent sync (Adam inner, as DiLoCo trains); optionally
    stop mid-period after ``stop_at`` steps, or resume from ``checkpoint_dir``. Returns rank's local and
    synced weights, the sync count, a held-out evaluation and what the checkpoint's model entry holds."""
    import os

    import torch
    import torch.nn.functional as F

    from ddpkit.parallel import periodic

    rt = ddpkit.init(seed=4)
    model = torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(64, 32),
        torch.nn.BatchNorm1d(32),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.3),
        torch.nn.Linear(32, 10),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = rt.setup(
        model, optimizer, sync=sync, sync_every=every, sync_dtype=sync_dtype, sync_fragments=fragments, sync_delay=delay
    )
    loader = rt.loader(_NoisyToy(), global_batch_size=12, shuffle=True)  # 5 steps an epoch, even on 2 and 3
    state = {"model": model, "optimizer": optimizer}
    if stop_at is None and os.listdir(checkpoint_dir):
        rt.load(checkpoint_dir, state)
    done = False
    for _ in rt.epochs(10):
        for images, labels in loader:
            with rt.accumulate(model, accumulate):
                rt.backward(F.cross_entropy(model(images), labels))
                rt.clip_grad_norm_(model, 5.0)
                rt.step(optimizer)
            if rt.global_step == stop_at and rt._run.loop.micro_step == 0:
                path = rt.save(checkpoint_dir, state)
                return {
                    "stopped": rt.global_step,
                    "saved": str(path),
                    "steps_into_period": periodic.of(model).steps,
                    "pending": len(periodic.of(model).pending),
                    "synced": [s.clone() for s in periodic.of(model).synced],
                    "local": [p.detach().clone() for p in model.parameters()],
                    "every": periodic.of(model).every,
                    "delay": periodic.of(model).delay,
                    "decision": periodic.of(model).decision,
                }
            if rt.global_step == total_steps:
                done = True
                break
        if done:
            break
    syncer = periodic.of(model)
    toy = _toy_data(60)
    metrics = ddpkit.evaluate(model, torch.utils.data.TensorDataset(*toy.tensors[:2]), num_classes=10)
    local = {k: v.detach().clone() for k, v in model.state_dict().items()}
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "weights": local,
        "synced": [s.clone() for s in syncer.synced],
        "syncs": syncer.syncs,
        "steps_into_period": syncer.steps,
        "step": rt.global_step,
        "accuracy": metrics["accuracy"],
        "loss": metrics["loss"],
        "evaluation_restored_local": all(torch.equal(local[k], after[k]) for k in local),
        "sent_bytes": syncer.sent_bytes,
        "exported": rt.full_state_dict(model),
        "fragment0_elements": sum(syncer.params[i].numel() for i in syncer.fragments[0]),
        "every": syncer.every,
        "delay": syncer.delay,
        "decision": syncer.decision,
    }


def auto_compression(
    steps: int = 8, checkpoint_dir: str | None = None, stop_at: int | None = None, min_gain: float | None = None
) -> dict:
    """grad_compression="auto" on a small MLP: its decision (the same on every rank) after ``steps``;
    optionally save after ``stop_at`` steps, or resume from ``checkpoint_dir``. ``min_gain``
    replaces the gain a compression must promise (``float("inf")``: the choice is always none)."""
    import os

    import torch
    import torch.nn.functional as F

    from ddpkit.parallel import auto

    if min_gain is not None:
        auto.MIN_GAIN = min_gain

    rt = ddpkit.init(seed=1)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer, grad_compression="auto")
    state = {"model": model, "optimizer": optimizer}
    if checkpoint_dir and stop_at is None and os.listdir(checkpoint_dir):
        rt.load(checkpoint_dir, state)
    loader = rt.loader(_toy_data(200), global_batch_size=20, shuffle=True)
    compressor = rt._run.entries[0].mode.compressor
    decided_at = None
    for _ in rt.epochs(10):
        for images, labels, _index in loader:
            rt.backward(F.cross_entropy(model(images), labels))
            rt.step(optimizer)
            if decided_at is None and compressor.decision is not None:
                decided_at = rt.global_step
            if rt.global_step == stop_at:
                rt.save(checkpoint_dir, state)
                return {"stopped": stop_at, "decision": compressor.decision}
            if rt.global_step == steps:
                return {
                    "decision": compressor.decision,
                    "decided_at": decided_at,
                    "weights": [p.detach().clone() for p in model.parameters()],
                }
    return {}


def exact_run(
    micro_shards: int,
    epochs: int = 1,
    stop_after: int | None = None,
    checkpoint_dir: str | None = None,
    precision: str = "fp32",
    samples: int | None = None,
    clip: float | None = None,
    bucket_bytes: int | None = None,
    accumulate: int | None = None,
) -> dict:
    """A BatchNorm + dropout ConvNet on digits with ``rt.setup(micro_shards=...)`` (global batch 48,
    so the last batch's shards are uneven). Stops after ``stop_after`` steps with a checkpoint, or
    resumes from ``checkpoint_dir``'s newest; returns rank 0's final state, the steps, the
    mean train loss of the last epoch and the test accuracy. ``bucket_bytes``: the exchange's
    buckets, small enough to be handed over one by one during the last shard's backward.
    ``accumulate``: steps every that many batches, inside ``rt.accumulate``."""
    import torch
    import torch.nn.functional as F

    from ddpkit.parallel import exact_exchange
    from ddpkit.recipes.datasets import load_dataset

    if bucket_bytes is not None:
        exact_exchange.BUCKET_BYTES = exact_exchange.FIRST_BUCKET_BYTES = bucket_bytes

    rt = ddpkit.init(
        seed=3,
        precision=precision,
        checkpoint_dir=checkpoint_dir,
        resume="auto" if checkpoint_dir and stop_after is None else None,
    )
    train, test = load_dataset("digits", "train"), load_dataset("digits", "test")
    torch.manual_seed(3)
    if samples is None:
        model = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.2),
            torch.nn.Flatten(),
            torch.nn.Linear(8 * 64, 32),
            torch.nn.BatchNorm1d(32, momentum=None),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 10),
        )
    else:  # a last batch of a sample or two leaves some ranks no shard: no BatchNorm then
        data = torch.utils.data.Subset(train.dataset, range(samples))
        model = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
        )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer, micro_shards=micro_shards)
    state = {"model": model, "optimizer": optimizer}
    rt.resume(state)
    loader = rt.loader(train.dataset if samples is None else data, global_batch_size=48, shuffle=True)
    loss_sum = torch.zeros((), dtype=torch.float64)
    for _ in rt.epochs(epochs):
        loss_sum.zero_()
        for images, labels in loader:
            group = rt.accumulate(model, accumulate) if accumulate else contextlib.nullcontext(True)
            with group as last:
                for x, y in rt.shards(images, labels):
                    with rt.autocast():
                        loss = F.cross_entropy(model(x), y)
                    rt.backward(loss)
                    loss_sum += loss.detach().double() * len(y)
                if clip is not None and last:
                    rt.clip_grad_norm_(model, clip)
                rt.step(optimizer)
            if stop_after is not None and rt.global_step == stop_after:
                rt.checkpoint(state)
                rt.close()
                return {"stopped_at": rt.global_step}
    metrics = ddpkit.evaluate(model, test.dataset, num_classes=10)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {
        "state": weights,
        "steps": rt.global_step,
        "train_loss": float(rt.all_reduce(loss_sum)),
        "accuracy": metrics["accuracy"],
        "threads": torch.get_num_threads(),
    }
    rt.close()
    return out


def loader_slots(micro_shards: int | None) -> dict:
    """The strided part of each global batch a rank's ``rt.loader`` reads in a pass begun before
    ``rt.setup`` and in one begun after it, and the samples of the first batch of each."""
    rt = ddpkit.init(seed=0)
    data = torch.utils.data.TensorDataset(torch.arange(32.0).unsqueeze(1), torch.zeros(32, dtype=torch.long))
    loader = rt.loader(data, global_batch_size=8)
    before = next(iter(loader))[0].flatten().tolist()
    slot_before = loader.sampler.slot
    model = torch.nn.Linear(1, 2)
    rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_shards=micro_shards)
    after = next(iter(loader))[0].flatten().tolist()
    out = {"before": (slot_before, before), "after": (loader.sampler.slot, after)}
    rt.close()
    return out


def exact_step_buffers(steps: int = 3) -> dict:
    """``micro_shards=2`` over the job's ranks: per step, the address of each bucket's buffer once the
    step is reduced, the gradients' addresses, and whether the last shard's own gradients are still held
    after ``rt.step``."""
    from ddpkit.parallel.modes import MicroShards

    rt = ddpkit.init(seed=1)
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 3)
    )
    data = torch.utils.data.TensorDataset(torch.randn(16 * steps, 6), torch.randint(0, 3, (16 * steps,)))
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_shards=2)
    exact = next(mode.exact for mode in rt._run.modes if isinstance(mode, MicroShards))
    buffers, grads, held, kept = [], [], [], []
    for x, y in rt.loader(data, global_batch_size=16):
        for xs, ys in rt.shards(x, y):
            rt.backward(torch.nn.functional.cross_entropy(model(xs), ys))
        assert not exact.cut  # the shards' loop ended with their sum, before rt.step
        kept.append(list(exact.exchange._buffers.values()))  # held here: a new tensor cannot reuse an id
        buffers.append(len(kept[-1]) > 0 and all(a is b for a, b in zip(kept[0], kept[-1])))
        grads.append([p.grad.data_ptr() for p in model.parameters()])
        held.append(len(exact._held))
        rt.step(optimizer)
        held.append(len(exact._held))
    rt.close()
    return {"buffers": buffers, "grads": grads, "held": held}


def tree_exchange_bits(local_shards: int) -> dict:
    """Each rank's shard gradients for five parameters (one never reached, one on rank 1 only, some
    ``-0.0``), summed by :class:`~ddpkit.parallel.exact_exchange.TreeExchange` in tiny buckets;
    returns the sums as raw bits and what one process's tree makes of the same leaves."""
    import torch

    from ddpkit.parallel.exact_exchange import TreeExchange
    from ddpkit.parallel.exact_tree import tree_sum

    rt = ddpkit.init()
    shapes = [(7,), (3, 5), (1,), (64,), (32,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    world, shards = rt.world_size, local_shards * rt.world_size

    def leaf(s: int, i: int):
        if i == 2 or (i == 4 and s != 1):  # 2: never reached; 4: shard 1 only (rank 1's)
            return None
        g = torch.Generator().manual_seed(100 * s + i)
        value = torch.randn(shapes[i], generator=g) * 10.0 ** torch.randint(-4, 5, shapes[i], generator=g)
        return torch.where(value.abs() < 1e-3, torch.full_like(value, -0.0), value)

    exchange = TreeExchange(
        params, world_size=world, rank=rt.rank, device=torch.device("cpu"), bucket_bytes=64, first_bucket_bytes=16
    )
    for b, members in reversed(list(enumerate(exchange.buckets))):  # handed over out of order
        exchange.submit(b, [[leaf(rt.rank + j * world, i) for j in range(local_shards)] for i in members])
    total = exchange.wait()
    exchange.close()
    whole = [tree_sum([leaf(s, i) for s in range(shards)]) for i in range(len(shapes))]
    bits = lambda t: None if t is None else t.contiguous().view(torch.int32).clone()  # noqa: E731
    out = {
        "sums": [bits(t) for t in total],
        "one_process": [bits(t) for t in whole],
        "buckets": len(exchange.buckets),
        "rounds": exchange.calls_per_step,
    }
    rt.close()
    return out


class _NumberedStream(torch.utils.data.IterableDataset):
    """104 fixed samples of 6 features and 3 classes, in order (every rank reads them all)."""

    def __iter__(self):
        g = torch.Generator().manual_seed(7)
        for _ in range(104):
            yield torch.randn(6, generator=g), torch.randint(0, 3, (), generator=g)


def exact_stream_run(
    kind: str,
    micro_shards: int = 2,
    bucket_bytes: int = 256,
    compile_model: bool = False,
    accumulate: int | None = None,
) -> dict:
    """``micro_shards`` over a stream through ``rt.loader`` (``kind``: "plain", an IterableDataset, or
    "shards", the same samples as a ddpkit.Shards of 4 shards), 2 epochs in global batches of 16;
    returns rank 0's final state, the steps and the samples trained. ``compile_model``:
    ``rt.setup(..., compile=True)``. ``accumulate``: a step every that many batches (rt.accumulate)."""
    import torch.nn.functional as F

    from ddpkit.parallel import exact_exchange

    exact_exchange.BUCKET_BYTES = exact_exchange.FIRST_BUCKET_BYTES = bucket_bytes
    rt = ddpkit.init(seed=4)
    samples = list(_NumberedStream())
    if kind == "plain":
        data = _NumberedStream()
    else:
        data = ddpkit.Shards.from_dataset(
            torch.utils.data.TensorDataset(torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])),
            shards=4,
        )
    torch.manual_seed(4)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3)
    )
    model, optimizer = rt.setup(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        micro_shards=micro_shards,
        compile=compile_model,
    )
    loader = rt.loader(data, global_batch_size=16)
    seen = 0
    for _ in rt.epochs(2):
        for x, y in loader:
            with rt.accumulate(model, accumulate) if accumulate else contextlib.nullcontext():
                for xs, ys in rt.shards(x, y):
                    rt.backward(F.cross_entropy(model(xs), ys))
                rt.step(optimizer)
            seen += loader.global_count
    out = {
        "state": {k.removeprefix("_orig_mod."): v.detach().clone() for k, v in model.state_dict().items()},
        "steps": rt.global_step,
        "samples": seen,
        "compiled": hasattr(model, "_orig_mod"),
    }
    rt.close()
    return out


def final_exchange_run(sync: str, every: int, fragments: int, delay: int, checkpoint_dir: str | None = None) -> dict:
    """Two epochs of 5 steps under an infrequent sync whose period does not divide them: this rank's
    weights inside the last epoch after its training pass and after ``rt.epochs``, the synced
    weights, the syncs made, and what ``ddpkit.evaluate`` saw after the loop. With ``checkpoint_dir``
    the run saves after the loop; given one that holds a checkpoint, it resumes from it instead."""
    import os

    import torch
    import torch.nn.functional as F

    from ddpkit.parallel import periodic

    rt = ddpkit.init(seed=4)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = rt.setup(
        model, optimizer, sync=sync, sync_every=every, sync_fragments=fragments, sync_delay=delay
    )
    loader = rt.loader(_NoisyToy(), global_batch_size=12, shuffle=True)
    held_out = torch.Generator().manual_seed(7)  # the same on every rank
    test = torch.utils.data.TensorDataset(
        torch.randn(30, 64, generator=held_out), torch.randint(0, 10, (30,), generator=held_out)
    )
    state = {"model": model, "optimizer": optimizer}
    resuming = checkpoint_dir is not None and bool(os.listdir(checkpoint_dir))
    if resuming:
        rt.load(checkpoint_dir, state)
    syncer = periodic.of(model)
    out: dict = {"syncs_at_start": syncer.syncs}
    for epoch in rt.epochs(2):
        for images, labels in loader:
            rt.backward(F.cross_entropy(model(images), labels))
            rt.step(optimizer)
        out[f"private_after_epoch_{epoch}"] = any(
            not torch.equal(p, s) for p, s in zip(model.parameters(), syncer.synced)
        )
    out["after_epochs"] = [p.detach().clone() for p in model.parameters()]
    out["synced"] = [s.clone() for s in syncer.synced]
    out["evaluated"] = ddpkit.evaluate(model, test, num_classes=10)["loss"]
    with torch.no_grad():
        xs = torch.stack([x for x, _ in test])
        out["own_loss"] = float(F.cross_entropy(model(xs), torch.stack([y for _, y in test])))
    out["syncs"], out["steps_into_period"], out["pending"] = syncer.syncs, syncer.steps, len(syncer.pending)
    out["step"] = rt.global_step
    if checkpoint_dir is not None and not resuming:
        rt.save(checkpoint_dir, state)
    rt.close()
    return out


def save_parts(checkpoint_dir: str) -> dict:
    """Two background saves of a BatchNorm model on every rank: each rank's RNG state at the save,
    and (rank 0) whether the parts the ranks brought through the store are gone from it after."""
    from ddpkit import _torch, rng

    rt = ddpkit.init(seed=3, checkpoint_dir=checkpoint_dir)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    state = {"model": model, "optimizer": optimizer}
    found: dict = {"rng": [], "stats": []}
    for _ in range(2):
        rt.backward(model(torch.randn(8, 4) + rt.rank).sum())
        rt.step(optimizer)
        found["rng"].append(rng.rng_state()["torch"].clone())
        inner = _torch.unwrap(model)[1]
        found["stats"].append(
            {"1.running_mean": inner.running_mean.clone(), "1.running_var": inner.running_var.clone()}
        )
        rt.checkpoint(state)
        torch.rand(3)  # the loop draws on: the saved state is the one at the save
    rt.barrier()
    if rt.is_main:
        store = _torch.default_store()
        from ddpkit.distributed import store_sync

        prefix = f"ddpkit/meet/{store_sync._scope}/save"
        found["left"] = [store.check([f"{prefix}/{n}/rank1"]) for n in (1, 2)]
    rt.close()
    return found


class _WithHead(torch.nn.Module):
    """A body the loss uses and a head it never does (kept for later, say)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 2)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.body(x)


def unused_head(freeze: bool = False, find_unused: bool = False, micro_shards: int | None = None) -> dict:
    """Train _WithHead through rt.backward and rt.step: the steps taken, and the error that stopped them (if any)."""
    import torch.nn.functional as F

    rt = ddpkit.init(seed=0)
    model = _WithHead()
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8), torch.randint(0, 2, (64,))
    )  # before setup: alike on every rank
    if freeze:
        model.head.requires_grad_(False)
    setup: dict = {"find_unused_parameters": True} if find_unused else {}
    if micro_shards:
        setup["micro_shards"] = micro_shards
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), **setup)
    steps, error = 0, None
    try:
        for x, y in rt.loader(data, global_batch_size=16):
            for xs, ys in rt.shards(x, y) if micro_shards else [(x, y)]:
                rt.backward(F.cross_entropy(model(xs), ys))
            rt.step(optimizer)
            steps += 1
    except ddpkit.errors.DdpkitError as exc:
        error = (type(exc).__name__, str(exc))
    body = {k: v.clone() for k, v in ddpkit._torch.unwrap(model).body.state_dict().items()}
    rt.close()
    return {"steps": steps, "error": error, "body": body}


def gan_and_split_optimizers() -> dict:
    """Two loops the unused-parameter refusal must let through under DDP: a GAN's two models (D's step
    after a backward that never reaches G) and one model's two optimizers stepped one call each after
    one backward. Each model's weights and the steps taken."""
    import torch.nn.functional as F

    rt = ddpkit.init(seed=0)
    torch.manual_seed(0)
    real = torch.utils.data.TensorDataset(torch.randn(64, 4) + 2)
    g, d = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)), torch.nn.Linear(4, 1)
    split = _WithHead()
    g, g_opt = rt.setup(g, torch.optim.Adam(g.parameters(), lr=1e-2))
    d, d_opt = rt.setup(d, torch.optim.Adam(d.parameters(), lr=1e-2))
    split = rt.setup(split)
    inner = ddpkit._torch.unwrap(split)
    body_opt = torch.optim.SGD(inner.body.parameters(), lr=0.1)
    head_opt = torch.optim.SGD(inner.head.parameters(), lr=0.1)
    for (x,) in rt.loader(real, global_batch_size=16):
        fake = g(torch.randn(x.shape[0], 2))
        d_real, d_fake = d(x), d(fake.detach())
        rt.backward(
            F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
            + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake))
        )
        rt.step(d_opt)
        out = d(fake)
        rt.backward(F.binary_cross_entropy_with_logits(out, torch.ones_like(out)))
        rt.step(g_opt)
        wide = torch.cat([x, x], dim=1)
        both = split(wide) + inner.head(wide)
        rt.backward(both.square().mean())
        rt.step(body_opt)
        rt.step(head_opt)  # the same backward's step: counted once
    found = {
        "steps": rt.global_step,
        "weights": {
            name: torch.cat([p.detach().flatten() for p in ddpkit._torch.unwrap(m).parameters()])
            for name, m in (("g", g), ("d", d), ("split", split))
        },
    }
    rt.close()
    return found


class _Padded(torch.utils.data.Dataset):
    """Sequences of 0 to 12 tokens padded to 12, their padding labelled -100 (a language model's batch);
    every seventh sample is all padding."""

    def __init__(self, length: int = 48) -> None:
        g = torch.Generator().manual_seed(3)
        self.tokens = torch.randint(0, 11, (length, 12), generator=g)
        lengths = torch.randint(1, 13, (length,), generator=g)
        lengths[::7] = 0
        self.labels = torch.where(torch.arange(12) < lengths[:, None], torch.roll(self.tokens, -1, 1), -100)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        return self.tokens[i], self.labels[i]


def counted_lm(
    use_count: bool = True,
    accumulate: int = 1,
    micro_shards: int | None = None,
    dtype: str = "float64",
    precision: str = "fp32",
    length: int = 48,
    ckpt: str | None = None,
    stop: int | None = None,
    **setup,
) -> dict:
    """A tiny language model on padded sequences, its loss the mean over the tokens that count; with
    ``use_count``, ``rt.backward(loss, count=tokens)``. Rank 0's weights after two passes of 8 samples a
    step; ``ckpt``: resumed from that directory, and saved there after step ``stop``, where it stops."""
    import torch.nn.functional as F

    rt = ddpkit.init(seed=0, precision=precision, checkpoint_dir=ckpt, trackers=())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)).to(getattr(torch, dtype))
    if micro_shards:
        setup["micro_shards"] = micro_shards
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5), **setup)
    loader = rt.loader(_Padded(length), global_batch_size=8 // accumulate, shuffle=True)
    state = {"model": model, "optimizer": optimizer}
    if ckpt:
        rt.resume(state)

    def backward(tokens, labels):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)
        if use_count:
            rt.backward(loss, count=(labels != -100).sum())
        else:
            rt.backward(loss)

    for _ in rt.epochs(2):
        for tokens, labels in loader:
            with rt.accumulate(model, accumulate) if accumulate > 1 else contextlib.nullcontext():
                for t, y in rt.shards(tokens, labels) if micro_shards else [(tokens, labels)]:
                    backward(t, y)
                rt.step(optimizer)
            if rt.global_step == stop:
                rt.checkpoint(state)
                rt.close()
                return {"stopped": stop}
    weights = {k: v.detach().clone() for k, v in (rt.full_state_dict(model) or {}).items()}  # rank 0's
    scaler = rt.precision.scaler
    found = {"weights": weights, "steps": rt.global_step, "scale": None if scaler is None else scaler.get_scale()}
    rt.close()
    return found


def clipped_lm(
    clip: str = "torch",
    use_count: bool = False,
    micro_shards: int | None = None,
    precision: str = "fp32",
    dtype: str = "float64",
    accumulate: int = 1,
) -> dict:
    """:func:`counted_lm`'s model and data, clipped to a norm of 0.3 before each step the way ``clip`` says:
    ``"torch"`` (``torch.nn.utils.clip_grad_norm_``, as a plain PyTorch script does), ``"unscale"``
    (``rt.unscale_gradients()`` first), ``"scaler"`` (``rt.precision.scaler.unscale_`` first), ``"rt"``
    (``rt.clip_grad_norm_``) or ``"none"``. Rank 0's weights and each step's norm before clipping."""
    import torch.nn.functional as F

    rt = ddpkit.init(seed=0, precision=precision)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)).to(getattr(torch, dtype))
    setup = {"micro_shards": micro_shards} if micro_shards else {}
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5), **setup)
    loader = rt.loader(_Padded(48), global_batch_size=8 // accumulate, shuffle=True)
    norms = []
    for _ in rt.epochs(2):
        for tokens, labels in loader:
            with rt.accumulate(model, accumulate) if accumulate > 1 else contextlib.nullcontext() as last:
                for t, y in rt.shards(tokens, labels) if micro_shards else [(tokens, labels)]:
                    with rt.autocast():
                        loss = F.cross_entropy(model(t).flatten(0, 1).float(), y.flatten(), ignore_index=-100)
                    rt.backward(loss, count=(y != -100).sum()) if use_count else rt.backward(loss)
                if last is False:
                    rt.unscale_gradients()  # nothing on a micro-step that does not sync
                    assert rt._run.finished is None
                elif clip == "rt":
                    norms.append(float(rt.clip_grad_norm_(model, 0.3)))
                elif clip != "none":
                    if clip == "unscale":
                        rt.unscale_gradients()
                    elif clip == "scaler":
                        rt.precision.scaler.unscale_(optimizer)
                    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)))
                rt.step(optimizer)
    weights = {k: v.detach().clone() for k, v in (rt.full_state_dict(model) or {}).items()}
    rt.close()
    return {"weights": weights, "norms": norms}


class _Branches(torch.nn.Module):
    """A linear layer's output plus an embedding's: autograd hands the embedding the sum's gradient
    itself, the tensor the linear layer's backward reads too."""

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 3, sparse=sparse)
        self.lin = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.emb((x[:, 0].abs() * 3).long().clamp(max=9))


def sparse_branches(sparse: bool = True, clip: float | None = None) -> dict:
    """:class:`_Branches` (float64) with ``nn.Embedding(sparse=...)``, 2 passes of 4 steps, clipped to ``clip``
    by ``rt.clip_grad_norm_`` where given: rank 0's weights, the norms, and the first step's gradients."""
    import torch.nn.functional as F

    rt = ddpkit.init(seed=0)
    torch.manual_seed(0)
    model = _Branches(sparse).double()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (64,), generator=g)
    )
    norms, first = [], None
    for _ in rt.epochs(2):
        for x, y in rt.loader(data, global_batch_size=16, shuffle=True):
            rt.backward(F.cross_entropy(model(x), y))
            if first is None:
                inner = ddpkit._torch.unwrap(model)
                first = {"lin": inner.lin.weight.grad.clone(), "emb": inner.emb.weight.grad.to_dense()}
            if clip is not None:
                norms.append(float(rt.clip_grad_norm_(model, clip)))
            rt.step(optimizer)
    weights = {k: v.detach().clone() for k, v in (rt.full_state_dict(model) or {}).items()}
    rt.close()
    return {"weights": weights, "norms": norms, "first": first}


def ema_run(checkpoint_dir: str, epochs: int, stop_after: int | None = None) -> dict | None:
    """An EMA of the weights (``AveragedModel`` around the model ``rt.setup`` returned) and a OneCycleLR
    schedule, checkpointed each epoch with ``resume="auto"``; stops after ``stop_after`` epochs. Rank 0's EMA
    in plain names (``ddpkit.checkpoint.user_state``), its count at the resume and at the end, the last rate."""
    import torch.nn.functional as F
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    rt = ddpkit.init(seed=0, checkpoint_dir=checkpoint_dir, resume="auto")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (64,), generator=g)
    )
    loader = rt.loader(data, global_batch_size=16, shuffle=True)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=epochs * len(loader))
    state = {"model": model, "optimizer": optimizer, "ema": ema, "schedule": schedule}
    rt.resume(state)
    resumed_with = int(ema.n_averaged)
    for epoch in rt.epochs(epochs):
        for x, y in loader:
            rt.backward(F.cross_entropy(model(x), y))
            if rt.step(optimizer):
                schedule.step()
            ema.update_parameters(model)
        rt.checkpoint(state)
        if stop_after is not None and epoch + 1 == stop_after:
            rt.close()
            return None
    found = {
        "ema": {k: v.clone() for k, v in ddpkit.checkpoint.user_state({"ema": ema})["ema"].items()},
        "resumed_with": resumed_with,
        "lr": schedule.get_last_lr(),
    }
    rt.close()
    return found


def scripts_sync_batchnorm(how: str = "script") -> dict:
    """A BatchNorm model (float64) synced the way ``how`` says: ``"script"`` (torch's
    ``nn.SyncBatchNorm.convert_sync_batchnorm``, as a plain DDP script does), ``"option"``
    (``rt.setup(sync_batchnorm=True)``) or ``"none"``; rank 0's weights and statistics after 8 steps."""
    import torch.nn.functional as F

    rt = ddpkit.init(seed=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    ).double()
    if how == "script":
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer, sync_batchnorm=how == "option")
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (64,), generator=g)
    )
    for _ in rt.epochs(2):
        for x, y in rt.loader(data, global_batch_size=16, shuffle=True):
            rt.backward(F.cross_entropy(model(x), y))
            rt.step(optimizer)
    weights = {k: v.detach().clone() for k, v in (rt.full_state_dict(model) or {}).items()}
    rt.close()
    return {"weights": weights}


class _Sequences(torch.utils.data.Dataset):
    """48 token sequences of 2 to 13 tokens: a collate pads each batch to its longest."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        lengths = torch.randint(2, 14, (48,), generator=g)
        self.items = [torch.randint(1, 20, (int(n),), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i]


class _SequenceStream(torch.utils.data.IterableDataset):
    """:class:`_Sequences` as a plain stream."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield from _Sequences().items


def _sequence_shard(shard: int) -> Iterator[torch.Tensor]:
    """Shard ``shard`` of six of :class:`_Sequences`: eight sequences."""
    yield from _Sequences().items[shard * 8 : (shard + 1) * 8]


def _sequence_data(data: str) -> Any:
    """:class:`_Sequences` as it is (``"map"``), as a plain stream, or as a ``ddpkit.Shards`` of six shards."""
    if data == "map":
        return _Sequences()
    if data == "stream":
        return _SequenceStream()
    return ddpkit.Shards(list(range(6)), _sequence_shard, lengths=[8] * 6, cache=False)


def _pad(batch: list[torch.Tensor], width: int | None = None) -> dict:
    """Hugging Face's DataCollatorWithPadding, in short: inputs padded with 0 to the batch's longest (or
    ``width``), labels the next token, -100 past the end."""
    n = width or max(len(s) for s in batch)
    x, y = torch.zeros(len(batch), n, dtype=torch.long), torch.full((len(batch), n), -100)
    for i, s in enumerate(batch):
        x[i, : len(s)], y[i, : len(s) - 1] = s, s[1:]
    return {"input_ids": x, "labels": y}


def _pad_to_16(batch: list[torch.Tensor]) -> dict:
    return _pad(batch, 16)


class _TinyLM(torch.nn.Module):
    """An embedding, a causal transformer layer with dropout and padding mask, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20, 16)
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.out = torch.nn.Linear(16, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        return self.out(self.enc(self.emb(x), mask=mask, is_causal=True, src_key_padding_mask=x == 0))


def padded_lm(
    how: str = "dict", num_workers: int = 0, accumulate: int = 1, fixed: bool = False, data: str = "map"
) -> dict:
    """:class:`_TinyLM` with ``micro_shards=2`` on batches its collate pads to their longest (``fixed``: to
    16), two passes of 8 sequences a step; ``how`` hands ``rt.shards`` the batch (``"dict"``), its two
    tensors (``"keys"``) or a copy of them (``"copies"``); ``data`` as :func:`_sequence_data` reads
    them. Rank 0's weights."""
    import torch.nn.functional as F

    rt = ddpkit.init(seed=0)
    torch.manual_seed(0)
    model = _TinyLM()
    model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), micro_shards=2)
    loader = rt.loader(
        _sequence_data(data),
        global_batch_size=8 // accumulate,
        shuffle=True,
        collate_fn=_pad_to_16 if fixed else _pad,
        num_workers=num_workers,
    )
    for _ in rt.epochs(2):
        for batch in loader:
            with rt.accumulate(model, accumulate) if accumulate > 1 else contextlib.nullcontext():
                if how == "dict":
                    shards = ((s["input_ids"], s["labels"]) for s in rt.shards(batch))
                elif how == "keys":
                    shards = rt.shards(batch["input_ids"], batch["labels"])
                else:
                    shards = rt.shards(batch["input_ids"].clone(), batch["labels"].clone())
                for x, y in shards:
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
                    rt.backward(loss, count=(y != -100).sum())
                rt.step(optimizer)
    weights = {k: v.detach().clone() for k, v in (rt.full_state_dict(model) or {}).items()}
    rt.close()
    return {"weights": weights}


def counted_lm_sharded(dtype: str = "float64") -> dict:
    """:func:`counted_lm` under strategy="fsdp"."""
    return counted_lm(True, 1, None, dtype, strategy="fsdp")


def counted_lm_compressed(use_count: bool = True) -> dict:
    """:func:`counted_lm` (float32) with its gradients sent as fp16."""
    return counted_lm(use_count, 1, None, "float32", grad_compression="fp16")


def counted_lm_compiled() -> dict:
    """:func:`counted_lm` (float64) with ``compile={"backend": "aot_eager"}``: a compiled forward and backward."""
    return counted_lm(True, 1, None, "float64", compile={"backend": "aot_eager"})


def unfreezing(setup: dict | None = None, accumulate: int = 1) -> dict:
    """Fine-tuning's gradual unfreezing: a float64 MLP whose first layer is frozen at ``rt.setup`` and
    unfrozen for the second epoch, its parameters a new group of the optimizer (``setup``: more of
    ``rt.setup``'s options, ``micro_shards`` among them). Rank 0's weights, and what it warned."""
    import warnings

    import torch.nn.functional as F

    rt = ddpkit.init(seed=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer, **(setup or {}))
    micro_shards = bool((setup or {}).get("micro_shards"))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (64,), generator=g)
    )
    loader = rt.loader(data, global_batch_size=16 // accumulate)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for epoch in rt.epochs(2):
            if epoch == 1:
                backbone = ddpkit._torch.unwrap(model)[0]
                backbone.requires_grad_(True)
                optimizer.add_param_group({"params": list(backbone.parameters()), "lr": 0.05})
            for x, y in loader:
                with rt.accumulate(model, accumulate) if accumulate > 1 else contextlib.nullcontext():
                    for xs, ys in rt.shards(x, y) if micro_shards else [(x, y)]:
                        rt.backward(F.cross_entropy(model(xs), ys))
                    rt.step(optimizer)
    weights = {k: v.detach().clone() for k, v in (rt.full_state_dict(model) or {}).items()}
    rt.close()
    return {"weights": weights, "warned": [str(w.message) for w in said if "DDP's buckets leave out" in str(w.message)]}


def loss_weights(setup: dict | None = None, split: str | None = None) -> dict:
    """Multi-task learning with learned loss weights (Kendall et al.'s uncertainty weighting): two
    losses of a float64 MLP weighted by ``log_var``, a parameter of the optimizer's outside the model.
    ``split``: ``log_var`` in an optimizer of its own, "given" to ``rt.setup`` with the model's or "not"
    (stepped by ``rt.step(optimizer, its_own)``: the refusal's text). Rank 0's weights and ``log_var``,
    and every rank's ``log_var``."""
    import torch.nn.functional as F

    rt = ddpkit.init(seed=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()
    log_var = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    if split is None:
        optimizer = torch.optim.SGD([{"params": model.parameters()}, {"params": [log_var], "lr": 0.05}], lr=0.1)
        others = []
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        others = [torch.optim.SGD([log_var], lr=0.05)]
    model, optimizer, *_ = rt.setup(model, optimizer, *(others if split == "given" else []), **(setup or {}))
    micro_shards = bool((setup or {}).get("micro_shards"))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (64,), generator=g)
    )
    loader = rt.loader(data, global_batch_size=16)
    for _ in rt.epochs(2):
        for x, y in loader:
            for xs, ys in rt.shards(x, y) if micro_shards else [(x, y)]:
                out = model(xs)
                losses = torch.stack([F.cross_entropy(out, ys), out.pow(2).mean()])
                rt.backward((torch.exp(-log_var) * losses + log_var).sum())
            try:
                rt.step(optimizer, *others)
            except ddpkit.UsageError as refused:
                rt.close()
                return {"refused": str(refused)}
    weights = {k: v.detach().clone() for k, v in (rt.full_state_dict(model) or {}).items()}
    everyone = rt.all_gather(log_var.detach().clone().unsqueeze(0))
    rt.close()
    return {"weights": {**weights, "log_var": log_var.detach().clone()}, "log_vars": everyone}


class _Labelled(torch.utils.data.Dataset):
    """:class:`_Sequences` with a class each (the first token's parity): a text classifier's samples."""

    def __init__(self, count: int = 45) -> None:
        self.items = _Sequences().items[:count]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.items[i], int(self.items[i][0]) % 2


def _pad_labelled(batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences padded with 0 to the batch's longest, and their classes."""
    x = torch.nn.utils.rnn.pad_sequence([s for s, _ in batch], batch_first=True)
    return x, torch.tensor([c for _, c in batch])


class _MeanPooled(torch.nn.Module):
    """An embedding averaged over the tokens that are not padding, then a head: one row per sample."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 8, padding_idx=0)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = (x != 0).unsqueeze(-1).double()
        return self.head((self.emb(x).double() * kept).sum(1).float() / kept.sum(1).float())


def evaluate_padded(batch_size: int = 4) -> dict:
    """``ddpkit.evaluate`` and ``ddpkit.predict`` of :class:`_MeanPooled` over :class:`_Labelled`, whose
    sequences a collate pads to each batch's longest; ``"ragged"``: what predict said of the token
    outputs (``(B, T, 2)``, of each batch's width)."""
    ddpkit.init(seed=0)
    model, data = _MeanPooled(), _Labelled()
    metrics = ddpkit.evaluate(model, data, num_classes=2, batch_size=batch_size, collate_fn=_pad_labelled)
    rows = ddpkit.predict(model, data, batch_size=batch_size, collate_fn=_pad_labelled, to="all")
    per_token = torch.nn.Sequential(model.emb, model.head)
    try:
        ddpkit.predict(per_token, data, batch_size=batch_size, collate_fn=_pad_labelled)
        ragged = ""
    except ddpkit.UsageError as exc:
        ragged = str(exc)
    ddpkit.current().close()
    return {"metrics": metrics, "rows": rows, "ragged": ragged}


def model_copies(
    setup: dict | None = None, checkpoint_dir: str | None = None, stop_after: int | None = None
) -> dict | None:
    """The copies of a float64 BatchNorm model that scripts keep: the best epoch's (``copy.deepcopy``
    after ``ddpkit.evaluate``), SWA's (``AveragedModel(model)``, its statistics recomputed by
    ``update_bn`` at the end) and an EMA of ``model.module`` with its buffers (torchvision's
    ``--model-ema``), the last two checkpointed each epoch with ``resume="auto"`` where
    ``checkpoint_dir`` is given, stopping after ``stop_after`` epochs. Each copy's state in plain
    names and its accuracy, on every rank; with ``micro_shards``, ``update_bn``'s error instead."""
    import copy

    import torch.nn.functional as F
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, update_bn

    rt = ddpkit.init(seed=0, **({"checkpoint_dir": checkpoint_dir, "resume": "auto"} if checkpoint_dir else {}))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    ).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer, **(setup or {}))
    micro_shards = bool((setup or {}).get("micro_shards"))
    swa = AveragedModel(model)
    ema = AveragedModel(ddpkit._torch.unwrap(model), multi_avg_fn=get_ema_multi_avg_fn(0.8), use_buffers=True)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (64,), generator=g)
    )
    loader = rt.loader(data, global_batch_size=16, shuffle=True)
    state = {"model": model, "optimizer": optimizer, "swa": swa, "ema": ema}
    rt.resume(state)
    best, best_accuracy = None, -1.0
    for epoch in rt.epochs(3):
        for x, y in loader:
            for xs, ys in rt.shards(x, y) if micro_shards else [(x, y)]:
                rt.backward(F.cross_entropy(model(xs), ys))
            rt.step(optimizer)
            ema.update_parameters(model)
        swa.update_parameters(model)
        accuracy = ddpkit.evaluate(model, data, num_classes=3)["accuracy"]
        if accuracy > best_accuracy:
            best, best_accuracy = copy.deepcopy(model), accuracy
        if checkpoint_dir:
            rt.checkpoint(state)
        if stop_after is not None and epoch + 1 == stop_after:
            rt.close()
            return None
    copies = {"best": best, "swa": swa, "ema": ema}
    found: dict[str, Any] = {}
    try:
        update_bn(loader, swa)
    except ddpkit.UsageError as exc:
        found["update_bn"] = str(exc)
    for name, held in copies.items():
        found[name] = {
            "accuracy": ddpkit.evaluate(held, data, num_classes=3)["accuracy"],
            "state": {
                k.removeprefix("module."): v.clone()
                for k, v in ddpkit.checkpoint.user_state({name: held})[name].items()
                if torch.is_tensor(v)
            },
        }
    rt.close()
    return found


class _Counting(torch.nn.Module):
    """A BatchNorm MLP with a buffer of its own (samples seen in training): DDP keeps broadcasting its buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
        )
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += x.shape[0]
        return self.net(x)


def differing_ranks(case: str) -> dict:
    """Scripts whose ranks may hold different models. ``"loaded-on-main"``: weights loaded on rank 0
    alone after ``rt.setup``; ``"loaded-everywhere"``: on every rank. ``"unseeded"``: a model built
    with each rank's own seed, evaluated without ``rt.setup``; ``"seeded"``: the same seed. ``"ema"``:
    an EMA updated each step of a model that syncs every 2 steps (local SGD). ``"buffers"``: a
    :class:`_Counting` model under DDP, evaluated as ``model.module`` too. Steps taken, the first error, evaluate's and predict's
    results, rank 0's state."""
    import torch.nn.functional as F
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    rt = ddpkit.init(seed=0)
    torch.manual_seed(rt.rank if case == "unseeded" else 0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    found: dict[str, Any] = {"steps": 0, "error": None}
    model: torch.nn.Module = _Counting() if case == "buffers" else torch.nn.Linear(8, 3)
    try:
        if case not in ("unseeded", "seeded"):
            setup = {"sync": "local-sgd", "sync_every": 2} if case == "ema" else {}
            model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), **setup)
            if case.startswith("loaded"):
                weights = {"weight": torch.ones(3, 8), "bias": torch.zeros(3)}
                if rt.is_main or case == "loaded-everywhere":
                    ddpkit._torch.unwrap(model).load_state_dict(weights)
            ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
            for x, y in rt.loader(data, global_batch_size=16, shuffle=True):
                rt.backward(F.cross_entropy(model(x), y))
                rt.step(optimizer)
                ema.update_parameters(model)
                found["steps"] += 1
            if case == "ema":
                model = ema
        if case == "buffers":  # model.module first: each rank's buffers are still its own
            found["inner_metrics"] = ddpkit.evaluate(ddpkit._torch.unwrap(model), data, num_classes=3)
        found["metrics"] = ddpkit.evaluate(model, data, num_classes=3)
        found["predicted"] = ddpkit.predict(model, data, to="all")
    except ddpkit.UsageError as exc:
        found["error"] = str(exc)
    found["state"] = {k: v.clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
    rt.close()
    return found


def data_of_each_rank(case: str) -> dict:
    """Datasets made after ``rt.setup`` (each rank's own random stream from there). ``"split"``:
    ``random_split`` unseeded; ``"seeded-split"``: with a seeded generator (fine); ``"drawn"``: a
    ``TensorDataset`` of ``torch.randn``; ``"length"``: one sample fewer on rank 1; ``"lengths"``: the
    same data, ``lengths=`` one apart on rank 1. What ``rt.loader``
    and ``ddpkit.evaluate`` said (None: nothing), and the steps taken."""
    import torch.nn.functional as F

    rt = ddpkit.init(seed=0)
    g = torch.Generator().manual_seed(1)
    full = torch.utils.data.TensorDataset(torch.randn(100, 8, generator=g), torch.randint(0, 3, (100,), generator=g))
    model = torch.nn.Linear(8, 3)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if case in ("split", "seeded-split"):
        generator = torch.Generator().manual_seed(0) if case == "seeded-split" else None
        train, test = torch.utils.data.random_split(full, [0.8, 0.2], generator=generator)
    elif case == "drawn":
        train = test = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    elif case == "lengths":  # the same data, lengths= counted on each rank its own way
        train = test = full
    else:
        train = test = torch.utils.data.Subset(full, range(100 - rt.rank))
    found: dict[str, Any] = {"steps": 0, "loader": None, "evaluate": None}
    try:
        lengths = {"lengths": [i % 7 + rt.rank * (i == 50) for i in range(100)]}.get(case)
        for x, y in rt.loader(train, global_batch_size=16, shuffle=True, lengths=lengths):
            rt.backward(F.cross_entropy(model(x), y))
            rt.step(optimizer)
            found["steps"] += 1
    except ddpkit.UsageError as exc:
        found["loader"] = str(exc)
    try:
        found["metrics"] = ddpkit.evaluate(model, test, num_classes=3)
    except ddpkit.UsageError as exc:
        found["evaluate"] = str(exc)
    rt.close()
    return found


def loader_made_local_main_first() -> int:
    """``rt.loader`` built inside ``rt.local_main_first()`` (local rank 0 runs the block alone first);
    the steps taken."""
    import torch.nn.functional as F

    rt = ddpkit.init(seed=0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    model = torch.nn.Linear(4, 2)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with rt.local_main_first():
        loader = rt.loader(data, global_batch_size=8)
    steps = 0
    for x, y in loader:
        rt.backward(F.cross_entropy(model(x), y))
        rt.step(optimizer)
        steps += 1
    rt.close()
    return steps


@dataclasses.dataclass
class HfOutput:
    """What a Hugging Face model returns: a dataclass with ``loss`` (None without labels) and ``logits``."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class HfClassifier(torch.nn.Module):
    """A Hugging Face-style sequence classifier: ``model(input_ids=..., attention_mask=..., labels=...)``,
    mean-pooled embeddings with dropout, an output with ``loss`` and ``logits``."""

    def __init__(self, vocab: int = 50, dim: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.dropout = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, input_ids, attention_mask=None, labels=None):  # noqa: ANN001, ANN201
        import torch.nn.functional as F

        hidden = self.embed(input_ids)
        mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask).unsqueeze(-1).to(hidden)
        logits = self.head(self.dropout((hidden * mask).sum(1) / mask.sum(1).clamp(min=1)))
        return HfOutput(None if labels is None else F.cross_entropy(logits, labels), logits)


def hf_encoding(**items: Any) -> Any:
    """``items`` in a stand-in for Hugging Face's ``BatchEncoding``: a ``UserDict`` with attribute access."""
    import collections

    class BatchEncoding(collections.UserDict):
        def __getattr__(self, name: str) -> Any:
            try:
                return self.data[name]
            except KeyError:
                raise AttributeError(name) from None

    return BatchEncoding(items)


def hf_dataset(n: int, seed: int) -> Any:
    """``n`` tokenized samples as a ``datasets.Dataset`` in torch format: input_ids, attention_mask, labels."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (n, 12), generator=g)
    lengths = torch.randint(3, 13, (n,), generator=g)
    mask = (torch.arange(12) < lengths[:, None]).long()
    data = {"input_ids": (ids * mask).tolist(), "attention_mask": mask.tolist(), "labels": (ids[:, 0] % 3).tolist()}
    return datasets.Dataset.from_dict(data).with_format("torch")


def hf_dicts(built: bool = False) -> dict:
    """The Hugging Face loop: a ``datasets.Dataset`` of dicts through ``rt.loader``, ``model(**shard)``
    under ``micro_shards=2``, then ``ddpkit.evaluate`` and ``ddpkit.predict`` of the dict samples.
    ``built``: the script builds its batch itself as a tokenizer does (a ``BatchEncoding``, a
    ``UserDict``) from the loader's tensors and hands that to ``rt.shards``."""
    train, val = hf_dataset(64, 0), hf_dataset(30, 1)  # batches of 5 alike on 1 and 2 processes: the same bits
    rt = ddpkit.init(seed=0)
    torch.manual_seed(0)
    model = HfClassifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = rt.setup(model, optimizer, micro_shards=2)
    loader = rt.loader(train, global_batch_size=16, shuffle=True)
    for _ in rt.epochs(2):
        for batch in loader:
            if built:
                batch = hf_encoding(**{key: value.clone() for key, value in batch.items()})
            for shard in rt.shards(batch):
                rt.backward(model(**shard).loss)
            rt.step(optimizer)
    metrics = ddpkit.evaluate(model, val, num_classes=3, batch_size=5)
    predicted = ddpkit.predict(model, val, batch_size=5, to="all")
    state = {key: value.detach().clone() for key, value in ddpkit._torch.unwrap(model).state_dict().items()}
    rt.close()
    return {"state": state, "metrics": metrics, "predicted": predicted}


def accumulated_by_hand(micro_shards: int | None, k: int = 3, by_hand: bool = True) -> dict:
    """Hugging Face's accumulation written by hand: ``rt.backward(loss / k)`` on every batch and
    ``rt.step`` every ``k`` batches (``by_hand=False``: ``rt.accumulate(model, k)`` instead); float64
    with BatchNorm and dropout. The weights."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(48, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (48,), generator=g)
    )
    rt = ddpkit.init(seed=0)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3)
    ).double()
    setup = {"micro_shards": micro_shards} if micro_shards else {}
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9), **setup)
    loader = rt.loader(data, global_batch_size=8, shuffle=True)  # 6 batches: 2 groups of 3
    for _ in rt.epochs(2):
        for i, (x, y) in enumerate(loader):
            with contextlib.nullcontext() if by_hand else rt.accumulate(model, k):
                for xs, ys in rt.shards(x, y) if micro_shards else [(x, y)]:
                    rt.backward(F.cross_entropy(model(xs), ys) / (k if by_hand else 1))
                if not by_hand or (i + 1) % k == 0:
                    rt.step(optimizer)
    state = {key: value.detach().clone() for key, value in ddpkit._torch.unwrap(model).state_dict().items()}
    rt.close()
    return {"state": state, "steps": rt.global_step}


class PairBatch(typing.NamedTuple):
    """A collate_fn's batch as a namedtuple."""

    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class ClassBatch:
    """A collate_fn's batch as a dataclass, with a value for the whole batch."""

    x: torch.Tensor
    y: torch.Tensor
    source: str = "train"


def _pair_data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    xs, ys = torch.randn(n, 10, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,), generator=g)
    return [(xs[i], ys[i]) for i in range(n)]


def collate_pairs(samples: list) -> PairBatch:
    return PairBatch(torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples]))


def batch_kinds(kind: str) -> dict:
    """``micro_shards=2`` over batches a ``collate_fn`` makes as a namedtuple (``kind="namedtuple"``:
    the loader's batch handed to ``rt.shards`` whole) or a dataclass the script builds from it
    (``"dataclass"``: not the loader's object, so the shards are cut from it); then ``evaluate`` and
    ``predict`` given the loaders themselves. The weights, metrics and predictions."""
    import torch.nn.functional as F

    rt = ddpkit.init(seed=1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 4))
    model, optimizer = rt.setup(net.double(), torch.optim.SGD(net.parameters(), lr=0.1), micro_shards=2)
    loader = rt.loader(_pair_data(64), global_batch_size=16, shuffle=True, collate_fn=collate_pairs)
    for _ in rt.epochs(2):
        for batch in loader:
            given = batch if kind == "namedtuple" else ClassBatch(batch.x * 1.0, batch.y + 0)
            for shard in rt.shards(given):
                assert type(shard) is type(given) and len(shard.x) <= 8
                rt.backward(F.cross_entropy(model(shard.x), shard.y))
            rt.step(optimizer)
    val = rt.loader(_pair_data(30), global_batch_size=6, collate_fn=collate_pairs)
    metrics = ddpkit.evaluate(model, val, num_classes=4, batch_size=3)  # forwards alike on 1 and 2 processes
    predicted = ddpkit.predict(model, val, batch_size=3, to="all")
    state = {key: value.detach().clone() for key, value in ddpkit._torch.unwrap(model).state_dict().items()}
    rt.close()
    return {"state": state, "metrics": metrics, "predicted": predicted}


class _Rows(torch.utils.data.Dataset):
    """101 samples (64 features, a class of 10): rows whose outputs depend on the batch they are in."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(101, 64, generator=generator)
        self.y = torch.randint(0, 10, (101,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class _RowStream(torch.utils.data.IterableDataset):
    """:class:`_Rows` as a plain stream."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        rows = _Rows()
        return iter([rows[i] for i in range(len(rows))])


def _row_shard(shard: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shard ``shard`` of :class:`_Rows` in shards of 20 (the last of 1)."""
    rows = _Rows()
    yield from (rows[i] for i in range(shard * 20, min(len(rows), (shard + 1) * 20)))


def _one_hot_squares(outputs: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """A regression's loss on class targets: the squared distance of the outputs to the one-hot rows."""
    return F.mse_loss(outputs, F.one_hot(targets, outputs.shape[1]).to(outputs.dtype), reduction=reduction)


def evaluated_alike(batch_size: int | None) -> dict:
    """Under ``micro_shards=4``: ``evaluate`` and ``predict`` of a dataset, a plain stream, a
    ``ddpkit.Shards`` and an ``rt.loader`` (its batch then a micro-shard's), with ``batch_size`` (None:
    the default, or the loader's). Rank 0's metrics (the loss included) and predictions, and the loss
    alone of targets scored as values (no ``num_classes``)."""
    rt = ddpkit.init(seed=1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    model, _ = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1), micro_shards=4)
    kinds = {
        "map": _Rows(),
        "stream": _RowStream(),
        "shards": ddpkit.Shards(list(range(6)), _row_shard, lengths=[20] * 5 + [1], cache=False),
        "loader": rt.loader(_Rows(), global_batch_size=40),
    }
    found = {}
    for kind, data in kinds.items():
        metrics = ddpkit.evaluate(model, data, num_classes=10, batch_size=batch_size)
        found[kind] = {"metrics": metrics, "predicted": ddpkit.predict(model, data, batch_size=batch_size)}
        found[kind]["values"] = ddpkit.evaluate(model, data, loss_fn=_one_hot_squares, batch_size=batch_size)
    rt.close()
    return found


class _Listed(torch.utils.data.Dataset):
    """File names in the order this process lists them (``os.listdir`` order differs between hosts)."""

    def __init__(self, order: torch.Tensor) -> None:
        self.files = [f"/data/img_{int(i):05d}.png" for i in order]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(float(index))


class _CifarLike(torch.utils.data.Dataset):
    """torchvision's CIFAR layout: ``data`` a numpy array, ``targets`` a list, here in this rank's own order."""

    def __init__(self, order: torch.Tensor) -> None:
        generator = torch.Generator().manual_seed(0)
        self.data = torch.randn(200, 3, 4, 4, generator=generator).numpy()[order.numpy()]
        self.targets = [int(t) for t in torch.randint(0, 10, (200,), generator=generator)[order]]

    def __len__(self) -> int:
        return len(self.data)


def datasets_in_each_ranks_order() -> dict:
    """The same samples in each rank's own order, drawn after ``rt.setup``: a ``TensorDataset``, a list of
    files, CIFAR's arrays. The message ``rt.loader`` refused each with."""
    rt = ddpkit.init(seed=1)
    rt.setup(torch.nn.Linear(2, 2))
    rows = torch.randn(100, 16, generator=torch.Generator().manual_seed(0))
    made = {
        "tensors": lambda: torch.utils.data.TensorDataset(rows[torch.randperm(100)]),
        "files": lambda: _Listed(torch.randperm(500)),
        "arrays": lambda: _CifarLike(torch.randperm(200)),
    }
    found = {}
    for kind, make in made.items():
        try:
            rt.loader(make(), global_batch_size=10)
        except ddpkit.errors.UsageError as refused:
            found[kind] = str(refused)
    rt.close()
    return found


def copies_on_uneven_ranks(batch_size: int) -> dict:
    """Copies whose forwards ran a collective (an ``AveragedModel`` of a DDP model that broadcasts its
    buffers at its first forward, one of a model whose BatchNorm statistics sync lazily at each),
    evaluated and predicted where the ranks hold different numbers of batches (40 samples in batches
    of 16: 2 and 1; of 64: 1 and none)."""
    import torch.nn.functional as F
    from torch.optim.swa_utils import AveragedModel

    rt = ddpkit.init(seed=1)
    torch.manual_seed(0)
    broadcasting, _ = rt.setup(_Counting().double(), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    lazy_net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3))
    lazy, optimizer = rt.setup(lazy_net.double(), torch.optim.SGD(lazy_net.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(40, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (40,), generator=g)
    )
    for x, y in rt.loader(data, global_batch_size=8):
        rt.backward(F.cross_entropy(lazy(x), y))  # (each rank's statistics apart, averaged lazily)
        rt.step(optimizer)
    found = {}
    for name, model in {"broadcasting": broadcasting, "lazy": lazy}.items():
        copied = AveragedModel(model)
        found[name] = {
            "metrics": ddpkit.evaluate(copied, data, num_classes=3, batch_size=batch_size),
            "predicted": ddpkit.predict(copied, data, batch_size=batch_size),
        }
    rt.close()
    return found


def _listed_rows(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """A collate the samples need: their features are lists (torch's default would transpose them)."""
    return torch.tensor([s[0] for s in samples], dtype=torch.float64), torch.tensor([s[1] for s in samples])


def uneven_ranks(directory: str) -> dict:
    """40 samples in one batch of 64, so rank 1 reads none: ``evaluate`` with a torchmetrics metric whose
    states are lists (AUROC), ``predict`` with the ``collate_fn`` the samples need, ``predict_to_file``
    of an ``rt.loader`` with it. Rank 0's results and the file's rows."""
    import os

    import numpy as np
    from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

    os.makedirs(directory, exist_ok=True)
    rt = ddpkit.init(seed=1)
    torch.manual_seed(0)
    model = rt.setup(torch.nn.Linear(8, 3).double())
    g = torch.Generator().manual_seed(2)
    features, labels = torch.randn(40, 8, generator=g, dtype=torch.float64), torch.arange(40) % 3
    data = [(features[i].tolist(), int(labels[i])) for i in range(40)]
    given = {"auroc": MulticlassAUROC(num_classes=3), "accuracy": MulticlassAccuracy(num_classes=3)}  # lists, counts
    metrics = ddpkit.evaluate(model, data, num_classes=3, batch_size=64, collate_fn=_listed_rows, extra_metrics=given)
    predicted = ddpkit.predict(model, data, batch_size=64, collate_fn=_listed_rows)
    loader = rt.loader(data, global_batch_size=64, collate_fn=_listed_rows)
    written = ddpkit.predict_to_file(model, loader, f"{directory}/out.npy")
    rows = np.load(written).tolist() if written is not None else None
    strict = None
    try:  # a list-state metric of the script's that refuses zero rows: every rank says so
        ddpkit.evaluate(
            model,
            data,
            num_classes=3,
            batch_size=64,
            collate_fn=_listed_rows,
            extra_metrics={"strict": _strict_metric()},
        )
    except ddpkit.UsageError as refused:
        strict = str(refused)
    rt.close()
    return {"metrics": metrics, "predicted": predicted, "rows": rows, "strict": strict}


def _strict_metric() -> Any:
    """A torchmetrics metric whose state is a list and whose update refuses zero rows."""
    import torchmetrics

    class Strict(torchmetrics.Metric):
        def __init__(self) -> None:
            super().__init__()
            self.add_state("rows", default=[], dist_reduce_fx="cat")

        def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
            if not len(preds):
                raise ValueError("no rows")
            self.rows.append(preds)

        def compute(self) -> torch.Tensor:
            return torchmetrics.utilities.dim_zero_cat(self.rows).sum()

    return Strict()


def mixup_numpy(micro_shards: int = 2, outside: bool = False) -> dict:
    """Mixup drawn as scripts draw it, inside ``rt.shards``: its weight from numpy's global generator, its
    pairing from torch's, a coin from ``random``'s; and a numpy draw outside the shards after the loop.
    ``outside``: the weight drawn for the batch before its shards instead (timm's Mixup draws one a batch),
    a torch draw beside it, a shift of the inputs drawn after ``rt.setup``, and after each epoch a
    validation pass with dropout on through ``rt.loader`` outside the shards, whose draws follow the
    rank's rows."""
    import random

    import numpy as np

    with ddpkit.init(seed=0) as rt:
        generator = torch.Generator().manual_seed(3)
        data = torch.utils.data.TensorDataset(torch.randn(48, 6, generator=generator), torch.arange(48) % 3)
        val = rt.loader(torch.utils.data.TensorDataset(torch.randn(12, 6, generator=generator)), global_batch_size=4)
        net = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3)
        )
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1), micro_shards=micro_shards)
        np.random.seed(7)  # the script's own seeding, after which its draws outside the shards go on
        shift = torch.randn(6) if outside else torch.zeros(6)  # drawn after rt.setup: rank 0's stream on each
        loader = rt.loader(data, global_batch_size=16, shuffle=True)
        for _ in rt.epochs(2 if outside else 1):
            for x, y in loader:
                batch_lam = float(np.random.beta(0.4, 0.4)) * float(torch.rand(()))
                for xs, ys in rt.shards(x, y):
                    lam = batch_lam if outside else float(np.random.beta(0.4, 0.4))
                    lam = lam if random.random() < 0.9 else 1.0
                    perm = torch.randperm(len(xs))
                    out = model(lam * xs + (1 - lam) * xs[perm] + shift)
                    rt.backward(lam * F.cross_entropy(out, ys) + (1 - lam) * F.cross_entropy(out, ys[perm]))
                rt.step(optimizer)
            if outside:
                with torch.no_grad():
                    for (v,) in val:
                        model(v)  # dropout on: as many draws as this rank has rows
        weights = {name: tensor.clone() for name, tensor in net.state_dict().items()}
        return {"weights": weights, "after": float(np.random.rand())}


def class_weighted(counted: bool) -> dict:
    """A 3-class MLP trained on a class-weighted cross-entropy (weights 0.2, 1, 3), whose mean divides by
    its samples' weights: ``counted`` passes that sum as the backward's count (a float)."""
    with ddpkit.init(seed=0) as rt:
        generator = torch.Generator().manual_seed(3)
        x = torch.randn(96, 6, generator=generator)
        data = torch.utils.data.TensorDataset(x, (torch.rand(96, generator=generator) * 3).long().clamp(max=2))
        weight = torch.tensor([0.2, 1.0, 3.0])
        net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for _ in rt.epochs(2):
            for xs, ys in rt.loader(data, global_batch_size=16, shuffle=True):
                loss = F.cross_entropy(model(xs), ys, weight=weight)
                rt.backward(loss, count=weight[ys].sum()) if counted else rt.backward(loss)
                rt.step(optimizer)
        return {"weights": {name: tensor.clone() for name, tensor in net.state_dict().items()}}


def summed_loss(as_mean: bool) -> dict:
    """pytorch/examples' VAE reduces its loss by a sum; ``as_mean`` divides it by the batch's samples and
    multiplies SGD's learning rate by the global batch (16): the same steps, on any world size."""
    with ddpkit.init(seed=0) as rt:
        generator = torch.Generator().manual_seed(2)
        data = torch.utils.data.TensorDataset(torch.rand(64, 12, generator=generator))
        net = torch.nn.Sequential(torch.nn.Linear(12, 4), torch.nn.ReLU(), torch.nn.Linear(4, 12))
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=1e-3 * (16 if as_mean else 1)))
        for _ in rt.epochs(2):
            for (x,) in rt.loader(data, global_batch_size=16, shuffle=True):
                loss = F.binary_cross_entropy_with_logits(model(x), x, reduction="sum")
                rt.backward(loss / len(x) if as_mean else loss)
                rt.step(optimizer)
        return {"weights": {name: tensor.clone() for name, tensor in net.state_dict().items()}}


def gathered_loss(where: str) -> dict:
    """A contrastive loss (CLIP's, SimCLR's) over embeddings gathered from every rank, as open_clip
    gathers them, under micro_shards=2: ``where`` the gather runs, "loss" (``torch.distributed.nn.all_gather``,
    gradients through it), "keys" (MoCo's ``concat_all_gather``: no gradient) or "after" (a logged sum of
    the shards' losses, reduced once after the shard loop). The refusal's text, or the step count and sum."""
    import torch.distributed as dist
    import torch.distributed.nn

    def gather(z: torch.Tensor) -> torch.Tensor:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return z
        if where == "keys":
            with torch.no_grad():
                parts = [torch.zeros_like(z) for _ in range(dist.get_world_size())]
                dist.all_gather(parts, z)
            return torch.cat(parts)
        return torch.cat(torch.distributed.nn.all_gather(z))

    with ddpkit.init(seed=0) as rt:
        generator = torch.Generator().manual_seed(3)
        a = torch.randn(32, 6, generator=generator)
        data = torch.utils.data.TensorDataset(a, a + 0.1 * torch.randn(32, 6, generator=generator))
        net = torch.nn.Linear(6, 8)
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1), micro_shards=2)
        summed = 0.0
        try:
            for x, y in rt.loader(data, global_batch_size=8):
                step_sum = torch.zeros((), dtype=torch.float64)
                for xs, ys in rt.shards(x, y):
                    zx, zy = F.normalize(model(xs), dim=-1), F.normalize(model(ys), dim=-1)
                    keys = zy if where == "after" else gather(zy)
                    logits = zx @ keys.t() / 0.1
                    labels = torch.arange(len(zx)) + (rt.rank * len(zx) if len(keys) > len(zx) else 0)
                    loss = F.cross_entropy(logits, labels)
                    rt.backward(loss)
                    step_sum += loss.detach().double() * len(xs)
                rt.step(optimizer)
                if dist.is_initialized():
                    dist.all_reduce(step_sum)  # torch's own collective, after the shard loop
                summed += float(step_sum)
        except ddpkit.UsageError as refused:
            return {"refused": str(refused), "steps": rt.global_step}
        return {"steps": rt.global_step, "summed": summed, "weight": net.weight.detach().clone()}


def collective_sequences(drop_api: bool = False) -> list:
    """``ddpkit._torch.collective_sequence()`` before and after each kind of call on the default group of
    a 2-process gloo job (and on a group of the script's own, which it does not count); ``drop_api``: the
    exception it raises where the group has no sequence number API."""
    import torch.distributed as dist
    import torch.distributed.nn

    with ddpkit.init() as rt:
        if drop_api:
            original = torch.distributed.ProcessGroup._get_sequence_number_for_group
            del torch.distributed.ProcessGroup._get_sequence_number_for_group
            try:
                ddpkit._torch.collective_sequence()
            except ddpkit._torch.PrivateApiChanged as changed:
                return [str(changed)]
            finally:
                torch.distributed.ProcessGroup._get_sequence_number_for_group = original
            return []
        seen = [ddpkit._torch.collective_sequence()]
        tensor = torch.ones(2)
        dist.all_reduce(tensor)
        seen.append(ddpkit._torch.collective_sequence())
        dist.all_gather([torch.zeros(2), torch.zeros(2)], tensor)
        seen.append(ddpkit._torch.collective_sequence())
        torch.distributed.nn.all_gather(tensor.requires_grad_())
        seen.append(ddpkit._torch.collective_sequence())
        dist.send(tensor.detach(), 1) if rt.rank == 0 else dist.recv(tensor.detach(), 0)
        seen.append(ddpkit._torch.collective_sequence())
        own = dist.new_group([0, 1])
        dist.all_reduce(tensor.detach(), group=own)
        seen.append(ddpkit._torch.collective_sequence())
        return seen


def logged_losses(out_dir: str) -> dict:
    """``rt.log({"loss": ..., "lr": ...})`` after each step over 97 samples in global batches of 48 (on 2
    processes the last batch's one sample is rank 0's: rank 1's mean loss is NaN), then a value of each
    rank's own after the pass. What rt.log returned, and the rows of metrics.jsonl."""
    import json
    import pathlib

    with ddpkit.init(seed=0, out_dir=out_dir, trackers=()) as rt:
        generator = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(
            torch.randn(97, 8, generator=generator), torch.randint(0, 3, (97,), generator=generator)
        )
        net = torch.nn.Linear(8, 3).double()
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        returned = []
        for x, y in rt.loader(data, global_batch_size=48):
            loss = F.cross_entropy(model(x.double()), y)
            rt.backward(loss)
            rt.step(optimizer)
            returned.append(rt.log({"loss": loss.item(), "lr": 0.1 / 3}))
        returned.append(rt.log({"rank": float(rt.rank)}))
        main = rt.is_main
    written = (pathlib.Path(out_dir) / "metrics.jsonl").read_text().splitlines() if main else []
    return {"returned": returned, "rows": [json.loads(line) for line in written]}


def _masking_collate(items: list) -> tuple[torch.Tensor, torch.Tensor]:
    """A language model's collate as Hugging Face's DataCollatorForLanguageModeling draws it (a mask of
    15% of the inputs from torch's global generator), with a scale from numpy's, as timm's mixup draws."""
    import numpy as np

    x = torch.stack([item[0] for item in items])
    y = torch.stack([item[1] for item in items])
    masked = torch.bernoulli(torch.full(x.shape, 0.15)).bool()
    return x.masked_fill(masked, 0.0) * float(np.random.uniform(0.9, 1.1)), y


def drawing_collate(
    kind: str, num_workers: int, micro_shards: int | None, checkpoint_dir: str | None = None, stop: int = 0
) -> dict | None:
    """Two epochs of 6 steps whose collate_fn draws; a checkpoint every 2 steps, and ``stop``: leave after
    that step as a killed run would (None back). ``kind``: "map" (a TensorDataset) or "stream" (a plain
    IterableDataset, whose pieces a worker collates)."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 6, generator=generator), torch.randint(0, 3, (48,), generator=generator)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            yield from zip(x, y)

    data = Stream() if kind == "stream" else torch.utils.data.TensorDataset(x, y)
    with ddpkit.init(seed=0, checkpoint_dir=checkpoint_dir, resume="auto" if checkpoint_dir else None) as rt:
        net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1), micro_shards=micro_shards)
        loader = rt.loader(data, global_batch_size=8, collate_fn=_masking_collate, num_workers=num_workers)
        state = {"model": model, "optimizer": optimizer}
        rt.resume(state)
        for _ in rt.epochs(2):
            for inputs, targets in loader:
                for xs, ys in rt.shards(inputs, targets) if micro_shards else [(inputs, targets)]:
                    rt.backward(F.cross_entropy(model(xs), ys))
                rt.step(optimizer)
                if checkpoint_dir and rt.global_step % 2 == 0:
                    rt.checkpoint(state, blocking=True)
                if rt.global_step == stop:
                    return None
        return {"weights": {name: tensor.clone() for name, tensor in net.state_dict().items()}}


class _Augmented(torch.utils.data.Dataset):
    """A test set read with test-time augmentation: noise from torch's global generator on each read."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(37, 8, generator=generator), torch.randint(0, 3, (37,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + 0.5 * torch.randn(8), self.y[index]


def evaluated_augmented(num_workers: int) -> dict:
    """``ddpkit.evaluate`` and ``ddpkit.predict`` of an augmented test set in batches of 4 (both ranks read)."""
    with ddpkit.init(seed=0) as rt:
        torch.manual_seed(0)
        model = rt.setup(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)))
        metrics = ddpkit.evaluate(model, _Augmented(), num_classes=3, batch_size=4, num_workers=num_workers)
        return {"metrics": metrics, "predicted": ddpkit.predict(model, _Augmented(), batch_size=4, to="all")}
