"""The user's part of a checkpoint, in either format: state dicts going in, checked loads coming out."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

from ddpkit._torch import load_pre_hook, plain_name, unwrap, wrapper_segments
from ddpkit.errors import DdpkitError, UsageError, one_line


def user_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict()`` of each object that has one (a module's in plain names, the wrappers inside it
    left out: :func:`ddpkit._torch.wrapper_segments`); plain values as they are."""
    return {key: _state_of(value) if hasattr(value, "state_dict") else value for key, value in state.items()}


def _state_of(value: Any) -> Any:
    obj = unwrap(value)
    state = obj.state_dict()
    if not isinstance(obj, torch.nn.Module):
        return state
    segments = wrapper_segments(obj)
    return _renamed(state, lambda name: plain_name(name, segments)) if segments else state


def _in_own_names(model: torch.nn.Module, saved: Any) -> Any:
    """A saved module state in ``model``'s own names (its wrappers' segments put back), where it was
    saved in plain ones."""
    segments = wrapper_segments(model)
    if not segments or not isinstance(saved, Mapping):
        return saved
    inner = unwrap(model)
    own = {plain_name(name, segments): name for name, _ in inner.named_modules()}  # (their versions)
    own.update({plain_name(key, segments): key for key in inner.state_dict()})
    return _renamed(saved, lambda name: own.get(name, name))


_WRAPPERS = ("module.", "_orig_mod.")  # what DDP and torch.compile put before the names of what they wrap


def load_any_wrapping(model: torch.nn.Module) -> None:
    """Let the set-up ``model`` load a state dict saved by hand with any wrapping of it.

    ``torch.save(model.state_dict(), path)`` on rank 0 names the entries ``module.0.weight`` on 2
    processes (DDP's) and ``0.weight`` on one, and ``model.load_state_dict(torch.load(path))`` then
    fails on the other number of processes. Through this hook an entry the model would not take is
    renamed to the one it would, if the names differ by wrappers only: DDP's ``module.``, compile's
    ``_orig_mod.``. Nothing is renamed onto an entry the file holds already, nor loaded that the
    model's own names would not take anyway.
    """
    renaming = _AnyWrapping(model)
    load_pre_hook(model, renaming)
    model.register_load_state_dict_post_hook(renaming.undo)


class _AnyWrapping:
    def __init__(self, model: torch.nn.Module) -> None:
        inner = unwrap(model)
        self.path = next(name for name, sub in model.named_modules() if sub is inner)  # "" or "module", ...
        self.inner = inner
        self.moved: list[tuple[dict[str, Any], str, str]] = []  # the caller's _metadata renamed, to put back

    def undo(self, model: torch.nn.Module, incompatible: Any) -> None:
        """Put the caller's ``_metadata`` back as it was (torch reads that very dict, so it is renamed in place)."""
        for metadata, name, renamed in reversed(self.moved):
            metadata[name] = metadata.pop(renamed)
        self.moved = []

    def _own(self, plain: str) -> str:
        return f"{self.path}.{plain}" if self.path and plain else self.path or plain

    def __call__(self, model: torch.nn.Module, state: Any, prefix: str, *_: Any) -> None:
        if prefix:  # loaded as a part of another module: that one's names
            return
        plain_keys = set(self.inner.state_dict())
        own_keys = {self._own(key) for key in plain_keys}
        modules = {name for name, _ in self.inner.named_modules()}
        for key in [k for k in state if k not in own_keys]:
            plain = _unwrapped(key, plain_keys)
            if plain is not None and self._own(plain) not in state:
                state[self._own(plain)] = state.pop(key)
        metadata = getattr(state, "_metadata", None)  # each module's version, looked up by its name
        if isinstance(metadata, dict):
            for name in list(metadata):
                plain = _unwrapped(name, modules)
                if plain is not None and self._own(plain) not in metadata:
                    metadata[self._own(plain)] = metadata.pop(name)
                    self.moved.append((metadata, name, self._own(plain)))


def _unwrapped(name: str, plain: set[str]) -> str | None:
    """``name`` without the wrappers' segments before it, if that is one of the ``plain`` names."""
    while name not in plain:
        wrapper = next((w for w in _WRAPPERS if name.startswith(w)), None)
        if wrapper is None:
            return None
        name = name[len(wrapper) :]
    return name


def _renamed(state: Mapping[str, Any], rename: Callable[[str], str]) -> OrderedDict[str, Any]:
    """``state`` with its keys renamed, and the modules' versions torch keeps beside them (``_metadata``)."""
    out: OrderedDict[str, Any] = OrderedDict((rename(key), value) for key, value in state.items())
    metadata = getattr(state, "_metadata", None)
    if isinstance(metadata, Mapping):
        out._metadata = OrderedDict((rename(key), value) for key, value in metadata.items())  # type: ignore[attr-defined]
    return out


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
            entry = saved[key]
            if isinstance(obj, torch.nn.Module):
                entry = _in_own_names(obj, entry)
                check_model_state(obj, entry, f"checkpoint {path} ({key!r})")
            try:
                obj.load_state_dict(entry)
            except UsageError:  # a ValueError too: ddpkit's own objects say what is wrong
                raise
            except (ValueError, KeyError, RuntimeError) as exc:
                raise DdpkitError(f"checkpoint {path}: cannot load {key!r}: {one_line(str(exc), 200)}") from None
        elif isinstance(target, torch.Tensor) and isinstance(saved[key], torch.Tensor):
            state[key] = _into(target, saved[key])
        else:
            state[key] = saved[key]


def _into(target: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
    """A plain tensor entry restored: copied into the run's own tensor where the shapes agree, so the
    script's variable and an optimizer holding it (a learned loss weight) see the resumed values, on
    the device it was on (a file loads on the host); else ``saved`` on that device, a leaf as it was
    loaded (a ``Parameter`` stays one)."""
    if target.shape == saved.shape and not target.is_meta:
        with torch.no_grad():
            target.copy_(saved)
        return target
    moved = saved.detach().to(target.device)
    if isinstance(saved, torch.nn.Parameter):
        return torch.nn.Parameter(moved, requires_grad=saved.requires_grad)
    return moved.requires_grad_(saved.requires_grad)


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
