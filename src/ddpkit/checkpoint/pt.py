"""Single-file checkpoints: atomic rank-0 save and verified safe load of one ``.pt`` file.

A checkpoint is one ``torch.save`` file holding only tensors and plain containers, so it
loads with ``torch.load(weights_only=True)`` and never unpickles arbitrary objects:

    {"format": "ddpkit-checkpoint", "version": 2, "ddpkit_version": "...",
     "user": {name: state_dict or plain value, ...},
     "ddpkit": {"loop", "epoch", "step", "rng", "world_size", "precision", "config",
                "accumulated_grads" (only inside an accumulation group)},
     name: the same state_dict or value, for each entry of "user" not named as one of the above}

The user's entries are at the top level too (the same tensors, stored once), so a script that
reads the file itself, ``torch.load(path)["model"]``, gets what ``torch.save({"model": ...})``
would have given it.

Beside it, ``NAME.sha256`` records the size and checksum written, so a torn or corrupted
file is recognised before it is read. A directory (a sharded checkpoint) is not read here:
:func:`ddpkit.checkpoint.read` and :func:`ddpkit.checkpoint.verify` choose the format.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ddpkit._files import digest, fsync_dir, sum_path, temp_path, write_text_atomic
from ddpkit.checkpoint.safe import reason, safe_load
from ddpkit.errors import DamagedCheckpoint, DdpkitError, UnsafeCheckpoint

FORMAT = "ddpkit-checkpoint"
VERSION = 2  # 2: the loop state ("loop") replaced the list of loader positions


# -- writing ------------------------------------------------------------------------------


def write(path: str | os.PathLike, payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` atomically: temp file, fsync, checksum file, rename, fsync the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as handle:
            torch.save(dict(payload), handle)
            handle.flush()
            os.fsync(handle.fileno())
        sha, size = digest(tmp)
        record = {"sha256": sha, "size": size}
        # A kill between the two renames leaves the old data beside the new record: the
        # record vouches for the file it replaces too, until the new data is in place.
        previous = _read_record(path) if path.exists() else None
        if previous:
            record["previous"] = {"sha256": previous.get("sha256"), "size": previous.get("size")}
        write_text_atomic(sum_path(path), json.dumps(record))
        os.replace(tmp, path)
        fsync_dir(path.parent)
        if previous:
            write_text_atomic(sum_path(path), json.dumps({"sha256": sha, "size": size}))
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(sum_path(path).read_text())
    except (OSError, ValueError):
        return None


# -- reading ------------------------------------------------------------------------------

_EARLIER = "resume from an earlier checkpoint (a directory with resume='auto' or --resume auto skips damaged ones)"


def verify(path: str | os.PathLike) -> None:
    """Check size and checksum against what was recorded when the file was written.

    Raises:
        DdpkitError: missing, truncated or corrupted file.
    """
    path = Path(path)
    if not path.is_file():
        raise DamagedCheckpoint(
            f"checkpoint {path} does not exist; give a checkpoint file, or its directory for the newest"
        )
    record_path = sum_path(path)
    if not record_path.is_file():
        return  # written by something else (e.g. torch.save by hand): rely on torch.load's checks
    try:
        record = json.loads(record_path.read_text())
    except ValueError:
        raise DamagedCheckpoint(
            f"checkpoint {path}: its checksum file {record_path.name} is damaged; delete it to "
            "load the checkpoint unchecked, or " + _EARLIER
        ) from None
    sha, size = digest(path)
    previous = record.get("previous") or {}
    if (sha, size) == (previous.get("sha256"), previous.get("size")):
        return  # a save to this path was cut short before its rename: the old file is intact
    if size != record.get("size"):
        raise DamagedCheckpoint(
            f"checkpoint {path} is truncated: {size} bytes of {record.get('size')} written; " + _EARLIER
        )
    if sha != record.get("sha256"):
        raise DamagedCheckpoint(
            f"checkpoint {path} is corrupted: its checksum does not match the one written; " + _EARLIER
        )


def read(path: str | os.PathLike, map_location: Any = "cpu", *, verified: bool = False) -> dict[str, Any]:
    """Verify and load a single-file ddpkit checkpoint with ``weights_only=True``.

    Args:
        verified: the caller just verified ``path`` (as :func:`ddpkit.checkpoint.latest` does):
            skip hashing the whole file again.

    Raises:
        DdpkitError: corrupt, not a ddpkit checkpoint, from a newer ddpkit, or holding
            objects that would need arbitrary unpickling.
    """
    if not verified:
        verify(path)
    try:
        payload = safe_load(path, path, map_location=map_location)
    except UnsafeCheckpoint:
        raise
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, ...
        raise DamagedCheckpoint(f"checkpoint {path} cannot be read ({reason(exc)}); {_DAMAGED}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise DamagedCheckpoint(f"{path} is not a ddpkit checkpoint (no '{FORMAT}' header)")
    if int(payload.get("version", 0)) > VERSION:
        raise DdpkitError(
            f"checkpoint {path} was written by a newer ddpkit ({payload.get('ddpkit_version')}, "
            f"format {payload['version']}); upgrade ddpkit to read it"
        )
    return payload


_DAMAGED = "it is damaged or not a checkpoint"
