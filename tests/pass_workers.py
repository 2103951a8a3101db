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
