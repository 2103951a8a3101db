"""Checkpoints: atomic save, verified safe load, and the state for an exact resume, in two formats.

A checkpoint is either one file (:mod:`ddpkit.checkpoint.pt`: a ``torch.save`` of tensors and
plain containers beside its ``.sha256`` record, written by rank 0) or, under
``strategy="fsdp"``, a step directory of ``torch.distributed.checkpoint`` shards with a
manifest (:mod:`ddpkit.checkpoint.dcp`). Either loads without unpickling anything beyond plain
data (:mod:`ddpkit.checkpoint.safe`, :mod:`ddpkit.checkpoint.dcp_reader`).

Callers use this package: :func:`read`, :func:`verify` and :func:`latest` choose the format
by what is on disk (a file or a directory); the names of step checkpoints and pruning are
:mod:`ddpkit.checkpoint.steps`, the user's entries :mod:`ddpkit.checkpoint.state` and the
RNG states a checkpoint holds :mod:`ddpkit.rng`, all re-exported here. The two formats do not
import each other.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ddpkit._files import sum_path
from ddpkit.checkpoint import dcp, pt, steps
from ddpkit.checkpoint.pt import FORMAT, VERSION, write
from ddpkit.checkpoint.state import check_model_state, restore_user_state, user_state
from ddpkit.checkpoint.steps import prune, step_dir, step_path
from ddpkit.errors import DdpkitError, UsageError, warn
from ddpkit.rng import rng_state, set_rng_state

__all__ = [
    "FORMAT",
    "VERSION",
    "check_model_state",
    "check_output",
    "latest",
    "prune",
    "read",
    "restore_user_state",
    "rng_state",
    "set_rng_state",
    "step_dir",
    "step_path",
    "user_state",
    "verify",
    "write",
]


def verify(path: str | os.PathLike) -> None:
    """Check size and checksum against what was recorded when the checkpoint was written.

    A file is checked against its ``.sha256`` record, a sharded checkpoint (a directory)
    against its manifest.

    Raises:
        DdpkitError: missing, truncated or corrupted checkpoint.
    """
    path = Path(path)
    if path.is_dir():
        dcp.verify(path)
        return
    pt.verify(path)


def read(path: str | os.PathLike, map_location: Any = "cpu", *, verified: bool = False) -> dict[str, Any]:
    """Verify and load a ddpkit checkpoint with ``weights_only=True``.

    A sharded checkpoint (a directory) is consolidated in this process, in the same shape
    (``{"user": {...}, "ddpkit": {...}}``).

    Args:
        verified: the caller just verified ``path`` (as :func:`latest` does): skip hashing
            the whole file again.

    Raises:
        DdpkitError: corrupt, not a ddpkit checkpoint, from a newer ddpkit, or holding
            objects that would need arbitrary unpickling.
    """
    if Path(path).is_dir():  # a sharded (strategy="fsdp") checkpoint, consolidated here
        return dcp.read_consolidated(Path(path), verified=verified)
    return pt.read(path, map_location, verified=verified)


def latest(directory: str | os.PathLike) -> Path | None:
    """The newest step checkpoint in ``directory`` that verifies, or None."""

    for _, path in sorted(steps.step_checkpoints(Path(directory)), reverse=True):
        try:
            verify(path)
        except DdpkitError as exc:
            warn(f"skipping {exc}")
            continue
        return path
    return None


def check_output(out: Path, *, overwrite: bool, refusal: str, source: Path | None = None) -> None:
    """Refuse an output file (``--out`` of ``ddpkit export`` and ``predict``) that would replace a
    checkpoint (``source``, the one read, however named), its ``.sha256`` record, a file in a sharded
    step directory (made or to be made) or a directory, even with ``--overwrite``; or one that exists
    without it (``refusal``: that line).

    A checkpoint written over (the one being read, given as ``--out`` too) was lost: its record no
    longer matched, and ``--resume auto`` skipped it as damaged.

    Args:
        out: the file the command would write.
        overwrite: ``--overwrite`` was given (an existing ordinary file may be replaced).
        refusal: the command's line for an existing ``out`` without ``--overwrite``.
        source: the checkpoint the command reads, once found (None: not yet).

    Raises:
        UsageError: one line that says what ``out`` is and what to give instead.
    """
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory; give the path of the file to write")
    record = out.name.endswith(".sha256") and out.with_name(out.name[: -len(".sha256")]).exists()
    parent = out.resolve().parent
    if (
        sum_path(out).exists()
        or record
        or steps.STEP_FILE.match(out.name)
        or steps.STEP_DIR.match(parent.name)  # (DCP's step directories are flat)
        or _ddpkit_manifest(parent / dcp.MANIFEST)
        or (source is not None and out.exists() and os.path.samefile(out, source))
    ):
        raise UsageError(
            f"--out {out} is a checkpoint{' record' if record else ''} or lies in one; write elsewhere "
            "(--overwrite never replaces a checkpoint)"
        )
    if out.exists() and not overwrite:
        raise UsageError(refusal)


def _ddpkit_manifest(path: Path) -> bool:
    """Whether ``path`` is the manifest of a ddpkit sharded checkpoint (a project's own manifest.json is not)."""
    try:
        return path.is_file() and json.loads(path.read_text()).get("format") == dcp.FORMAT
    except (OSError, ValueError, AttributeError):
        return False
