"""Loops that read a loader pass after pass without ``rt.epochs``, for tests/test_passes.py:
``for epoch in range(n)`` and the step-based loop of nanoGPT and Hugging Face's ``max_steps``
(``next(it)``, a new ``iter(loader)`` at its end). Importable, so ``ddpkit.launch`` can spawn them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ddpkit


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randn(40, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (40,), generator=g)
    )


def step_based(checkpoint_dir: str, max_steps: int, stop_at: int | None = None) -> dict:
    """Train ``max_steps`` steps on 5 batches a pass with ``micro_shards=2`` (the same bits on any
    number of processes), checkpointing every 3 steps with ``resume="auto"``; ``stop_at``: return
    after a checkpoint of that step (a crash). The weights, and the sum of each batch read."""
    rt = ddpkit.init(seed=0, checkpoint_dir=checkpoint_dir, resume="auto")
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 3)
    ).double()
    model, optimizer = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2), micro_shards=2)
    loader = rt.loader(_data(), global_batch_size=8, shuffle=True)
    state = {"model": model, "optimizer": optimizer}
    rt.resume(state)
    step, seen = rt.global_step, []
    batches = iter(loader)
    while step < max_steps:
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        seen.append(float(x.sum()))
        for xs, ys in rt.shards(x, y):
            rt.backward(F.cross_entropy(model(xs), ys))
        rt.step(optimizer)
        step += 1
        if step % 3 == 0 or step == stop_at:
            rt.checkpoint(state, blocking=True)
        if step == stop_at:
            rt.close()
            return {"stopped": step}
    weights = {k: v.detach().clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
    rt.close()
    return {"weights": weights, "seen": seen, "step": step}


def zipped(checkpoint_dir: str, driven: bool, stop_at: int | None = None, shorter_second: bool = False) -> dict:
    """Semi-supervised training on ``zip(labeled, unlabeled)`` (6 and 10 batches a pass) for 3 epochs,
    under ``rt.epochs`` (``driven``) or ``range``, with ``micro_shards=2``; ``stop_at``: checkpoint that
    step and return; ``shorter_second``: ``zip(unlabeled, labeled)``, so each epoch ends at the
    unlabeled loader's 7th batch, when the labeled one runs out. The weights, the steps, and the first
    batch each loader handed out in each epoch."""
    g = torch.Generator().manual_seed(0)
    labeled = torch.utils.data.TensorDataset(
        torch.randn(24, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (24,), generator=g)
    )
    unlabeled = torch.utils.data.TensorDataset(torch.randn(40, 8, generator=g, dtype=torch.float64))
    rt = ddpkit.init(seed=0, checkpoint_dir=checkpoint_dir, resume="auto")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1), micro_shards=2)
    first = rt.loader(labeled, global_batch_size=4, shuffle=True, name="labeled")
    second = rt.loader(unlabeled, global_batch_size=4, shuffle=True, name="unlabeled")
    state = {"model": model, "optimizer": optimizer}
    rt.resume(state)
    firsts = []
    for _ in rt.epochs(3) if driven else range(rt.global_step // len(first), 3):  # 6 steps an epoch
        pairs = ((a, b) for (b, a) in zip(second, first)) if shorter_second else zip(first, second)
        for i, ((x, y), (u,)) in enumerate(pairs):
            if i == 0:
                firsts.append((x.tolist(), u.tolist()))
            for xs, ys, us in rt.shards(x, y, u):
                pseudo = model(us).detach().argmax(-1)  # pseudo-labels of the unlabeled shard
                rt.backward(F.cross_entropy(model(xs), ys) + 0.1 * F.cross_entropy(model(us), pseudo))
            rt.step(optimizer)
            if rt.global_step == stop_at:
                rt.checkpoint(state, blocking=True)
                rt.close()
                return {"stopped": stop_at}
    weights = {k: v.detach().clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
    rt.close()
    return {"weights": weights, "firsts": firsts, "step": rt.global_step}


def validation_iterator(
    checkpoint_dir: str, stop_after_epoch: int | None = None, stop_at_step: int | None = None
) -> dict:
    """Under ``rt.epochs``, a validation loss on one batch after every step from an iterator kept across
    steps (2 batches, a new ``iter(val)`` when it runs out), and a checkpoint at each epoch's end;
    ``stop_after_epoch``: return after that epoch's checkpoint; ``stop_at_step``: checkpoint that step
    (mid-epoch) and return. The weights, and the validation losses."""
    data = _data()
    val = torch.utils.data.TensorDataset(data.tensors[0][:12] + 1, data.tensors[1][:12])
    rt = ddpkit.init(seed=0, checkpoint_dir=checkpoint_dir, resume="auto")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1), micro_shards=2)
    train = rt.loader(data, global_batch_size=8, shuffle=True)
    held = rt.loader(val, global_batch_size=8)
    state = {"model": model, "optimizer": optimizer}
    rt.resume(state)
    losses, batches = [], iter(held)
    for epoch in rt.epochs(3):
        for x, y in train:
            for xs, ys in rt.shards(x, y):
                rt.backward(F.cross_entropy(model(xs), ys))
            rt.step(optimizer)
            try:
                vx, vy = next(batches)
            except StopIteration:
                batches = iter(held)
                vx, vy = next(batches)
            with torch.no_grad():
                losses.append(float(F.cross_entropy(model(vx), vy)))
            if rt.global_step == stop_at_step:
                rt.checkpoint(state, blocking=True)
                rt.close()
                return {"stopped": stop_at_step}
        rt.checkpoint(state, blocking=True)
        if epoch == stop_after_epoch:
            rt.close()
            return {"stopped": epoch}
    weights = {k: v.detach().clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
    rt.close()
    return {"weights": weights, "losses": losses, "steps": rt.global_step}


def weighed_beside() -> dict:
    """Three trainings (float64, SGD, 2 epochs) beside a validation loader of 51 samples read through
    ``rt.loader``, whose last batch of 3 splits 2 and 1 over two processes: ``"top"`` reads it at the top of
    every other body of a training loader of 41 samples in batches of 12 (the last, 5, splits 3 and 2);
    ``"own"`` trains 4 steps an epoch on batches of the script's own, split by rank, each after a whole pass
    of it; ``"left"`` the same after a pass left by ``break``. Each rank's loss must weigh by the batch it
    trains, not by the validation loader's last. The weights of each."""
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(41, 8, generator=g, dtype=torch.float64), torch.arange(41) % 3)
    val = torch.utils.data.TensorDataset(torch.randn(51, 8, generator=g, dtype=torch.float64), torch.arange(51) % 3)
    found = {}
    for kind in ("top", "own", "left"):
        rt = ddpkit.init(seed=0)
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.5))
        train = rt.loader(data, global_batch_size=12, shuffle=True)
        held = rt.loader(val, global_batch_size=16)
        for _epoch in rt.epochs(2):
            batches = train if kind == "top" else [data[i * 10 : i * 10 + 10] for i in range(4)]
            for i, (x, y) in enumerate(batches):
                if kind != "top":
                    x, y = x[rt.rank :: rt.world_size], y[rt.rank :: rt.world_size]
                if kind != "top" or i % 2 == 0:
                    with torch.no_grad():
                        for j, (vx, _vy) in enumerate(held):
                            model(vx)
                            if kind == "left" and j == 3:
                                break  # its last batch, of 3 samples, and the pass left
                rt.backward(F.cross_entropy(model(x), y))
                rt.step(optimizer)
        found[kind] = {k: v.detach().clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
        rt.close()
    return found
