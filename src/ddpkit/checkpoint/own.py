"""ddpkit's own part of a checkpoint, checked whole before anything of it is restored.

The file loads ``weights_only``, so nothing in it runs; but a crafted or hand-edited file could still
hold a field of another shape (a step of three elements, a loader position that is a string), which
would end a resume in a traceback from deep inside the restore, after part of the state had changed.
:func:`check` refuses such a file in one line that names the field, before the restore begins.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ddpkit import rng
from ddpkit.errors import DamagedCheckpoint

_EARLIER = "it was not written so by ddpkit; resume from an earlier checkpoint, or start afresh"


class _Malformed(Exception):
    def __init__(self, field: str, wanted: str, value: Any) -> None:
        super().__init__(f"{field}: expected {wanted}, found {_show(value)}")


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


def check(own: Any, where: str | Path) -> dict[str, Any]:
    """``own`` (a checkpoint's ``payload["ddpkit"]``), refused in one line unless it has the shape ddpkit writes.

    Raises:
        DamagedCheckpoint: a field is missing, of another type, or out of range.
    """
    try:
        _check(own)
    except _Malformed as exc:
        raise DamagedCheckpoint(f"checkpoint {where} holds a malformed ddpkit state ({exc}); {_EARLIER}") from None
    return own


def _check(own: Any) -> None:
    _dict(own, "ddpkit")
    if "user" in own:  # a sharded checkpoint's plain entries
        _dict(own["user"], "ddpkit.user")
    world = own.get("world_size", 1)
    _int(world, "ddpkit.world_size", least=1)
    loop = _dict(own.get("loop"), "ddpkit.loop")
    _check_loop(loop)
    ranks = _list(own.get("rng"), "ddpkit.rng", length=world)
    for rank, state in enumerate(ranks):
        _check_rng(state, f"ddpkit.rng[{rank}]")
    precision = _dict(own.get("precision"), "ddpkit.precision")
    _kind(precision.get("precision"), str, "ddpkit.precision.precision", "a name")
    scaler = precision.get("scaler")
    if scaler:
        _dict(scaler, "ddpkit.precision.scaler")
        for key in _SCALER:  # what GradScaler.load_state_dict reads
            _kind(scaler.get(key), (int, float), f"ddpkit.precision.scaler[{key!r}]", "a number")
    for field, each in (("accumulated_grads", _grads), ("compression", _per_model), ("buffers", _per_model)):
        if own.get(field) is not None:
            for rank, part in enumerate(_list(own[field], f"ddpkit.{field}", length=world)):
                each(part, f"ddpkit.{field}[{rank}]")
    trackers = own.get("trackers")
    if trackers is not None:
        _dict(trackers, "ddpkit.trackers")
        for index, row in enumerate(_list(trackers.get("rows", []), "ddpkit.trackers.rows")):
            _int(_dict(row, f"ddpkit.trackers.rows[{index}]").get("step"), f"ddpkit.trackers.rows[{index}].step")


def _check_loop(loop: Mapping[str, Any]) -> None:
    _int(loop.get("step"), "ddpkit.loop.step")
    _int(loop.get("epoch"), "ddpkit.loop.epoch")
    _bool(loop.get("epoch_done"), "ddpkit.loop.epoch_done")
    _int(loop.get("micro_step", 0), "ddpkit.loop.micro_step")
    _bool(loop.get("driven", True), "ddpkit.loop.driven")
    _int(loop.get("stage", 0), "ddpkit.loop.stage")
    _bool(loop.get("stage_left", False), "ddpkit.loop.stage_left")
    _bool(loop.get("epoch_begun", False), "ddpkit.loop.epoch_begun")
    if _int(loop.get("stage_start", 0), "ddpkit.loop.stage_start") > loop["epoch"]:
        raise _Malformed("ddpkit.loop.stage_start", "an epoch no later than ddpkit.loop.epoch", loop["stage_start"])
    group = _list(loop.get("group", []), "ddpkit.loop.group")
    if group:
        if len(group) != 2:
            raise _Malformed("ddpkit.loop.group", "[size, weight] or []", group)
        _int(group[0], "ddpkit.loop.group[0]", least=1)
        _kind(group[1], (int, float), "ddpkit.loop.group[1]", "a number")
    not_bitwise = loop.get("not_bitwise")
    if not_bitwise:
        _kind(not_bitwise, str, "ddpkit.loop.not_bitwise", "a reason")
    for key, value in _dict(loop.get("passes", {}), "ddpkit.loop.passes").items():
        _kind(key, str, "ddpkit.loop.passes", "loader names")
        _int(value, f"ddpkit.loop.passes[{key!r}]")
    for key, record in _dict(loop.get("loaders"), "ddpkit.loop.loaders").items():
        _kind(key, str, "ddpkit.loop.loaders", "loader names")
        _check_position(_dict(record, f"ddpkit.loop.loaders[{key!r}]"), f"ddpkit.loop.loaders[{key!r}]")


def _check_position(record: Mapping[str, Any], field: str) -> None:
    _int(record.get("epoch"), f"{field}.epoch")
    _int(record.get("position"), f"{field}.position")
    _bool(record.get("finished"), f"{field}.finished")
    for flag in ("ran_out", "pass_trained"):
        if flag in record:
            _bool(record[flag], f"{field}.{flag}")
    for number in ("began", "pass_epoch"):
        if record.get(number) is not None:
            _int(record[number], f"{field}.{number}")
    signature = _dict(record.get("signature"), f"{field}.signature")
    _int(signature.get("global_batch_size"), f"{field}.signature.global_batch_size", least=1)
    _kind(signature.get("seed"), int, f"{field}.signature.seed", "a whole number")
    if signature.get("length") is not None:
        _int(signature["length"], f"{field}.signature.length")


_SCALER = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _per_model(part: Any, field: str) -> None:
    """A rank's part per set-up model: a dict or None each (compression states, BatchNorm statistics)."""
    for index, entry in enumerate(_list(part, field)):
        if entry is not None:
            _dict(entry, f"{field}[{index}]")


def _grads(part: Any, field: str) -> None:
    """A rank's part-accumulated gradients: per model, per parameter, a tensor or None."""
    for index, grads in enumerate(_list(part, field)):
        for number, grad in enumerate(_list(grads, f"{field}[{index}]")):
            if grad is not None:
                _kind(grad, torch.Tensor, f"{field}[{index}][{number}]", "a tensor")


def _check_rng(state: Any, field: str) -> None:
    _dict(state, field)
    try:
        rng.check_state(state)
    except ValueError as exc:
        raise _Malformed(f"{field}.{exc}", "a generator's state", state.get(str(exc))) from None


# -- shapes -------------------------------------------------------------------------------------


def _kind(value: Any, kind: type | tuple[type, ...], field: str, wanted: str) -> Any:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise _Malformed(field, wanted, value)
    return value


def _int(value: Any, field: str, *, least: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise _Malformed(field, f"a whole number of at least {least}", value)
    return value


def _bool(value: Any, field: str) -> bool:
    return _kind(value, bool, field, "True or False")


def _dict(value: Any, field: str) -> Mapping[str, Any]:
    return _kind(value, dict, field, "a dict")


def _list(value: Any, field: str, *, length: int | None = None) -> list[Any]:
    found = _kind(value, (list, tuple), field, "a list" if length is None else f"a list of {length}, one per process")
    if length is not None and len(found) != length:
        raise _Malformed(field, f"a list of {length}, one per process", value)
    return list(found)
