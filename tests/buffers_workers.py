"""Training functions for tests/test_buffers.py (importable, so ddpkit.launch can spawn them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.parallel import lazy_buffers


class Toy(torch.utils.data.Dataset):
    def __init__(self, length: int = 48):
        generator = torch.Generator().manual_seed(5)
        self.x = torch.randn(length, 6, generator=generator) * 3 + 1
        self.y = torch.randint(0, 3, (length,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


def _model(extra_buffer: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    if extra_buffer:
        model.register_buffer("scale", torch.ones(1))
    return model


def _stats(model: torch.nn.Module) -> dict:
    inner = ddpkit._torch.unwrap(model)
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def train_bn(
    mode: str = "full",
    checkpoint: str = "",
    stop_at: int = 5,
    sync_bn: bool = False,
    extra_buffer: bool = False,
    freeze_at: int | None = None,
) -> dict:
    """Two epochs of a BatchNorm model; "stop" saves after ``stop_at`` steps, "resume" loads first,
    "save" saves at ``stop_at`` and goes on. ``freeze_at``: BatchNorm in eval mode from that step."""
    rt = ddpkit.init(seed=0)
    model = _model(extra_buffer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer, sync_batchnorm=sync_bn)
    state = {"model": model, "optimizer": optimizer}
    if mode == "resume":
        rt.load(checkpoint, state)
    loader = rt.loader(Toy(), global_batch_size=8, shuffle=True)
    seen = {
        "lazy": lazy_buffers.of(model) is not None,
        "broadcast": getattr(model, "broadcast_buffers", getattr(model, "forward_sync_buffers", None)),
    }
    for _ in rt.epochs(2):
        for inputs, targets in loader:
            if freeze_at is not None and rt.global_step == freeze_at:
                ddpkit._torch.unwrap(model)[1].eval()
                seen["own_before_freeze"] = _stats(model)["1.running_mean"]
            rt.backward(F.cross_entropy(model(inputs), targets))
            rt.step(optimizer)
            if freeze_at is not None and rt.global_step == freeze_at + 1:
                seen["after_frozen_step"] = _stats(model)["1.running_mean"]
            if mode in ("stop", "save") and rt.global_step == stop_at:
                before = _stats(model)
                rt.save(checkpoint, state)
                assert all(torch.equal(before[k], v) for k, v in _stats(model).items()), "save changed the run"
                if mode == "stop":
                    return {"own": before}
    seen["own"] = _stats(model)
    seen["eval"] = ddpkit.evaluate(model, Toy(), num_classes=3)
    seen["after"] = _stats(model)
    if freeze_at is not None:
        # one rank alone trains a BatchNorm layer through model.module: the ranks disagree on
        # what is dirty, and the next average must still meet (not hang) and cover that layer
        inner = ddpkit._torch.unwrap(model)
        inner.train()
        if rt.rank == 0:
            inner(Toy().x[:8])
        rt.save(checkpoint, state)
        ddpkit.sync_buffers(model)
        seen["after_one_rank"] = _stats(model)
    return seen
