"""Random states captured and restored: torch, CUDA, numpy and python, as a checkpoint holds them.

A base module (it imports nothing of ddpkit). Every state is made of tensors and plain values,
so a checkpoint holding it loads with ``torch.load(weights_only=True)``; numpy's state tuple
(:func:`numpy_state`) is also how PowerSGD's generator is saved (:mod:`ddpkit.parallel.compression`).
"""

from __future__ import annotations

import random
from typing import Any, Mapping

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch identically (the same initial weights on every rank)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch, CUDA, numpy, python) as tensors and plain values."""
    state = {
        "torch": torch.get_rng_state(),
        "numpy": numpy_state(np.random.get_state()),
        "python": _to_lists(random.getstate()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(numpy_state_tuple(state["numpy"]))
    random.setstate(_to_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
