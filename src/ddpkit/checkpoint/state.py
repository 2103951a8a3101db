"""The user's part of a checkpoint, in either format: state dicts going in, checked loads coming out."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from ddpkit._torch import unwrap
from ddpkit.errors import DdpkitError, UsageError, one_line


def user_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict()`` of each object that has one; plain values as they are."""
    return {key: unwrap(value).state_dict() if hasattr(value, "state_dict") else value for key, value in state.items()}


def restore_user_state(state: MutableMapping[str, Any], saved: Mapping[str, Any], path: Any) -> None:
    """Load each saved entry into ``state``; models are checked key by key and shape by shape."""
    missing = [key for key in state if key not in saved]
    if missing:
        raise DdpkitError(
            f"checkpoint {path} has no entry for {', '.join(map(repr, missing))}; "
            f"it holds {', '.join(map(repr, saved)) or 'nothing'}: pass a state with those keys"
        )
    for key, target in state.items():
        if hasattr(target, "load_state_dict"):
            obj = unwrap(target)
            if isinstance(obj, torch.nn.Module):
                check_model_state(obj, saved[key], f"checkpoint {path} ({key!r})")
            try:
                obj.load_state_dict(saved[key])
            except UsageError:  # a ValueError too: ddpkit's own objects say what is wrong
                raise
            except (ValueError, KeyError, RuntimeError) as exc:
                raise DdpkitError(f"checkpoint {path}: cannot load {key!r}: {one_line(str(exc), 200)}") from None
        else:
            state[key] = saved[key]


def check_model_state(model: torch.nn.Module, saved: Mapping[str, Any], where: str) -> None:
    """Raise a DdpkitError naming missing/unexpected keys and shape mismatches."""
    if not isinstance(saved, Mapping):
        raise DdpkitError(f"{where} does not hold a model state dict")
    expected = model.state_dict()
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    shapes = [
        f"{k} {tuple(saved[k].shape)} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in saved and hasattr(saved[k], "shape") and tuple(saved[k].shape) != tuple(v.shape)
    ]
    problems = []
    for label, items in (
        ("missing keys", missing),
        ("unexpected keys", unexpected),
        ("shape mismatches (checkpoint vs model)", shapes),
    ):
        if items:
            shown = ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")
            problems.append(f"{label}: {shown}")
    if problems:
        raise DdpkitError(
            f"{where} is for another model: " + "; ".join(problems) + "; build the model the checkpoint was saved from"
        )
