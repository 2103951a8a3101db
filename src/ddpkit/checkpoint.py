"""Checkpoints: atomic rank-0 save, verified safe load, and the state for an exact resume.

A checkpoint is one ``torch.save`` file holding only tensors and plain containers, so it
loads with ``torch.load(weights_only=True)`` and never unpickles arbitrary objects:

    {"format": "ddpkit-checkpoint", "version": 2, "ddpkit_version": "...",
     "user": {name: state_dict or plain value, ...},
     "ddpkit": {"loop", "epoch", "step", "rng", "world_size", "precision", "config",
                "accumulated_grads" (only inside an accumulation group)}}

Beside it, ``NAME.sha256`` records the size and checksum written, so a torn or corrupted
file is recognised before it is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Mapping, MutableMapping

import numpy as np
import torch

from ddpkit.errors import DdpkitError, UnsafeCheckpoint, one_line, refused

FORMAT = "ddpkit-checkpoint"
VERSION = 2   # 2: the loop state ("loop") replaced the list of loader positions
_STEP_NAME = re.compile(r"^ckpt-step(\d+)\.pt$")


# -- what goes in -----------------------------------------------------------------------

def unwrap(obj: Any) -> Any:
    """The module inside DDP / DataParallel / ``torch.compile``, so checkpoints hold plain names."""
    while isinstance(obj, torch.nn.Module):
        inner = getattr(obj, "_orig_mod", None) if hasattr(obj, "_orig_mod") else getattr(obj, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return obj
        obj = inner
    return obj


def user_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict()`` of each object that has one; plain values as they are."""
    return {key: unwrap(value).state_dict() if hasattr(value, "state_dict") else value
            for key, value in state.items()}


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


# -- writing ------------------------------------------------------------------------------

def write(path: str | os.PathLike, payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` atomically: temp file, fsync, checksum file, rename, fsync the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            torch.save(dict(payload), handle)
            handle.flush()
            os.fsync(handle.fileno())
        digest, size = _digest(tmp)
        record = {"sha256": digest, "size": size}
        # A kill between the two renames leaves the old data beside the new record: the
        # record vouches for the file it replaces too, until the new data is in place.
        previous = _read_record(path) if path.exists() else None
        if previous:
            record["previous"] = {"sha256": previous.get("sha256"), "size": previous.get("size")}
        _write_small(_sum_path(path), json.dumps(record))
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        if previous:
            _write_small(_sum_path(path), json.dumps({"sha256": digest, "size": size}))
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(_sum_path(path).read_text())
    except (OSError, ValueError):
        return None


def _write_small(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path) -> tuple[str, int]:
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            sha.update(chunk)
            size += len(chunk)
    return sha.hexdigest(), size


def _sum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def step_path(directory: str | os.PathLike, step: int) -> Path:
    """The name of the checkpoint for ``step`` inside a checkpoint directory."""
    return Path(directory) / f"ckpt-step{step:08d}.pt"


def prune(directory: str | os.PathLike, keep: int) -> None:
    """Keep the newest ``keep`` step checkpoints of ``directory`` (with their checksum files).

    Also sweeps what killed saves left: temp files of writers no longer alive, and checksum
    records whose checkpoint was never renamed into place.
    """
    directory = Path(directory)
    found = sorted(_step_checkpoints(directory))
    for _, path in found[:-keep] if keep > 0 else []:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            continue
        path.unlink(missing_ok=True)
        _sum_path(path).unlink(missing_ok=True)
    for path in directory.iterdir():
        temp = _TEMP_NAME.match(path.name)
        if temp and int(temp.group(1)) != os.getpid() and not _alive(int(temp.group(1))):
            path.unlink(missing_ok=True)
        elif path.name.endswith(".pt.sha256") and _STEP_NAME.match(path.name[:-7]) \
                and not path.with_name(path.name[:-7]).exists():
            path.unlink(missing_ok=True)


_TEMP_NAME = re.compile(r"^\.ckpt-step\d+\.pt(?:\.sha256)?\.tmp-(\d+)$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _step_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    from ddpkit.dcp import STEP_DIR     # sharded (strategy="fsdp") checkpoints are step directories

    return [(int(m.group(1)), p) for p in directory.iterdir()
            if (m := _STEP_NAME.match(p.name)) or (p.is_dir() and (m := STEP_DIR.match(p.name)))]


# -- reading ------------------------------------------------------------------------------

_EARLIER = "resume from an earlier checkpoint (a directory with resume='auto' or --resume auto skips damaged ones)"


def verify(path: str | os.PathLike) -> None:
    """Check size and checksum against what was recorded when the file was written.

    Raises:
        DdpkitError: missing, truncated or corrupted file.
    """
    path = Path(path)
    if path.is_dir():
        from ddpkit import dcp

        dcp.verify(path)
        return
    if not path.is_file():
        raise DdpkitError(f"checkpoint {path} does not exist; give a checkpoint file, or its directory for the newest")
    record_path = _sum_path(path)
    if not record_path.is_file():
        return  # written by something else (e.g. torch.save by hand): rely on torch.load's checks
    try:
        record = json.loads(record_path.read_text())
    except ValueError:
        raise DdpkitError(f"checkpoint {path}: its checksum file {record_path.name} is damaged; delete it to "
                          "load the checkpoint unchecked, or " + _EARLIER) from None
    digest, size = _digest(path)
    previous = record.get("previous") or {}
    if (digest, size) == (previous.get("sha256"), previous.get("size")):
        return   # a save to this path was cut short before its rename: the old file is intact
    if size != record.get("size"):
        raise DdpkitError(f"checkpoint {path} is truncated: {size} bytes of {record.get('size')} written; " + _EARLIER)
    if digest != record.get("sha256"):
        raise DdpkitError(f"checkpoint {path} is corrupted: its checksum does not match the one written; " + _EARLIER)


def read(path: str | os.PathLike, map_location: Any = "cpu", *, verified: bool = False) -> dict[str, Any]:
    """Verify and load a ddpkit checkpoint with ``weights_only=True``.

    Args:
        verified: the caller just verified ``path`` (as :func:`latest` does): skip hashing
            the whole file again.

    Raises:
        DdpkitError: corrupt, not a ddpkit checkpoint, from a newer ddpkit, or holding
            objects that would need arbitrary unpickling.
    """
    if Path(path).is_dir():            # a sharded (strategy="fsdp") checkpoint, consolidated here
        from ddpkit import dcp

        return dcp.read_consolidated(Path(path), verified=verified)
    if not verified:
        verify(path)
    try:
        payload = safe_load(path, path, map_location=map_location)
    except UnsafeCheckpoint:
        raise
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, ...
        raise DdpkitError(f"checkpoint {path} cannot be read ({_reason(exc)}); {_DAMAGED}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise DdpkitError(f"{path} is not a ddpkit checkpoint (no '{FORMAT}' header)")
    if int(payload.get("version", 0)) > VERSION:
        raise DdpkitError(
            f"checkpoint {path} was written by a newer ddpkit ({payload.get('ddpkit_version')}, "
            f"format {payload['version']}); upgrade ddpkit to read it"
        )
    return payload


_DAMAGED = "it is damaged or not a checkpoint"


def safe_load(source: Any, where: Any, *, map_location: Any = "cpu") -> Any:
    """``torch.load(source, weights_only=True)``: tensors and plain containers, nothing that runs code.

    A file that wants any other global is refused before it is called, with one line naming
    ``where`` (the file, for messages) and the global: torch's own refusal spans many lines of
    advice on how to load the file anyway.

    Raises:
        UnsafeCheckpoint: the file asks for something beyond plain data.
        Exception: whatever ``torch.load`` raises for a damaged file, unchanged.
    """
    try:
        return torch.load(source, map_location=map_location, weights_only=True)
    except Exception as exc:
        refusal = unsafe_refusal(exc, where)
        if refusal is not None:
            raise refusal from None
        raise


def unsafe_refusal(exc: BaseException, where: Any) -> UnsafeCheckpoint | None:
    """The :class:`UnsafeCheckpoint` that torch's ``weights_only`` error ``exc`` amounts to, if it is one.

    torch names the global in ``Unsupported global: GLOBAL getattr was not an allowed global``
    (builtins without their module) or ``unsupported GLOBAL posix.system whose module posix is
    blocked``; its other refusals (``Can only build ...``, ``Trying to call reduce ...``) name a
    class or function instead.
    """
    text = str(exc)
    found = re.search(r"GLOBAL (\S+?)(?: was not an allowed global| whose module )", text)
    if found:
        wanted = found.group(1)
        return refused(where, wanted if "." in wanted else f"builtins.{wanted}")
    unsafe = re.search(r"^.*(Can only (?:build|create new object)|Trying to call reduce|"
                       r"unsupported class).*$", text, re.IGNORECASE | re.MULTILINE)
    if unsafe:
        return refused(where, None, unsafe.group(0))
    return None


def _reason(exc: BaseException) -> str:
    """What torch's load error says is wrong, on one line (not its advice about weights_only)."""
    advice = ("weights_only", "weights only", "torch.load", "please file an issue")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if not any(word in line.lower() for word in advice)]
    return one_line((useful or lines or [type(exc).__name__])[0])


def latest(directory: str | os.PathLike) -> Path | None:
    """The newest step checkpoint in ``directory`` that verifies, or None."""
    import warnings

    for _, path in sorted(_step_checkpoints(Path(directory)), reverse=True):
        try:
            verify(path)
        except DdpkitError as exc:
            warnings.warn(f"skipping {exc}", stacklevel=2)
            continue
        return path
    return None


def restore_user_state(state: MutableMapping[str, Any], saved: Mapping[str, Any], path: Any) -> None:
    """Load each saved entry into ``state``; models are checked key by key and shape by shape."""
    missing = [key for key in state if key not in saved]
    if missing:
        raise DdpkitError(f"checkpoint {path} has no entry for {', '.join(map(repr, missing))}; "
                          f"it holds {', '.join(map(repr, saved)) or 'nothing'}: pass a state with those keys")
    for key, target in state.items():
        if hasattr(target, "load_state_dict"):
            obj = unwrap(target)
            if isinstance(obj, torch.nn.Module):
                check_model_state(obj, saved[key], f"checkpoint {path} ({key!r})")
            try:
                obj.load_state_dict(saved[key])
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
    shapes = [f"{k} {tuple(saved[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
              if k in saved and hasattr(saved[k], "shape") and tuple(saved[k].shape) != tuple(v.shape)]
    problems = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected),
                         ("shape mismatches (checkpoint vs model)", shapes)):
        if items:
            shown = ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")
            problems.append(f"{label}: {shown}")
    if problems:
        raise DdpkitError(f"{where} is for another model: " + "; ".join(problems)
                          + "; build the model the checkpoint was saved from")
