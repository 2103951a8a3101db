"""Training functions for tests/test_compression.py (importable, so ddpkit.launch can spawn them)."""

from __future__ import annotations

import hashlib
import warnings

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.recipes.datasets import load_dataset

GLOBAL_BATCH, EPOCHS = 60, 2  # divides 1, 2 and 3 processes; digits: 24 steps per epoch


def wide_mlp() -> torch.nn.Module:
    """An MLP for digits whose hidden matrices PowerSGD compresses (64K elements and more; the
    recipes' ``mlp`` has none: its matrices travel whole)."""
    return torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(64, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


def digest(model: torch.nn.Module) -> str:
    found = hashlib.sha256()
    for key, value in ddpkit._torch.unwrap(model).state_dict().items():
        found.update(key.encode() + value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return found.hexdigest()


def mlp_on_digits(
    compression: str | None, mode: str = "full", checkpoint: str = "", stop_at: int = 17, start: int = 5
) -> dict:
    """An MLP on digits with ``grad_compression``; ``mode`` "stop" saves after ``stop_at`` steps,
    "resume" loads ``checkpoint`` first (before setup, as scripts that build the model late do)."""
    rt = ddpkit.init(seed=0)
    train, test = load_dataset("digits", "train"), load_dataset("digits", "test")
    torch.manual_seed(0)
    model = wide_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(
        model, optimizer, grad_compression=compression, powersgd_start=start, bucket_cap_mb=0.05
    )  # several buckets in flight
    state = {"model": model, "optimizer": optimizer}
    caught = []
    if mode == "resume":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rt.load(checkpoint, state)
    loader = rt.loader(train.dataset, global_batch_size=GLOBAL_BATCH, shuffle=True)
    compressor = getattr(rt._run.entries[0].mode, "compressor", None) or getattr(
        rt._run.entries[0].mode, "syncer", None
    )
    for _ in rt.epochs(EPOCHS):
        for inputs, targets in loader:
            rt.backward(F.cross_entropy(model(inputs), targets))
            rt.step(optimizer)
            if mode == "stop" and rt.global_step == stop_at:
                rt.save(checkpoint, state)
                return {"step": rt.global_step}
    metrics = ddpkit.evaluate(model, test.dataset, num_classes=10)
    return {
        "digest": digest(model),
        "accuracy": metrics["accuracy"],
        "steps": rt.global_step,
        "payload_bytes": None if compressor is None else compressor.payload_bytes,
        "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "iter": getattr(getattr(compressor, "state", None), "iter", None),
        "warnings": [str(w.message) for w in caught],
    }


def each_compression(choices: list) -> dict:
    """Every choice of ``choices`` trained from the same start in one process group (one launch)."""
    rt = ddpkit.init(seed=0)
    train, test = load_dataset("digits", "train"), load_dataset("digits", "test")
    found = {}
    for choice in choices:
        torch.manual_seed(0)
        model = wide_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = rt.setup(model, optimizer, grad_compression=choice, powersgd_start=5, bucket_cap_mb=0.05)
        loader = rt.loader(train.dataset, global_batch_size=GLOBAL_BATCH, shuffle=True, name=str(choice))
        steps = 0
        for epoch in range(EPOCHS):
            loader.set_epoch(epoch)
            for inputs, targets in loader:
                rt.backward(F.cross_entropy(model(inputs), targets))
                rt.step(optimizer)
                steps += 1
        compressor = getattr(rt._run.entries[-1].mode, "compressor", None) or getattr(
            rt._run.entries[-1].mode, "syncer", None
        )
        found[str(choice)] = {
            "digest": digest(model),
            "steps": steps,
            "accuracy": ddpkit.evaluate(model, test.dataset, num_classes=10)["accuracy"],
            "payload_bytes": None if compressor is None else compressor.payload_bytes,
            "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "iter": getattr(getattr(compressor, "state", None), "iter", None),
        }
    return found
