"""A checkpoint directory's step checkpoints: their names, which exist, and pruning the old ones.

A run that saves into a directory writes one checkpoint a step, ``ckpt-stepNNNNNNNN.pt`` (a
single file, :mod:`ddpkit.checkpoint.pt`) or ``ckpt-stepNNNNNNNN/`` (a sharded step directory,
:mod:`ddpkit.checkpoint.dcp`); both formats name and prune their steps here. Which of them is
the newest complete one is :func:`ddpkit.checkpoint.latest`, which verifies in either format.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ddpkit._files import sum_path

STEP_FILE = re.compile(r"^ckpt-step(\d+)\.pt$")
"""The name of a single-file step checkpoint; group 1 is the step."""

STEP_DIR = re.compile(r"^ckpt-step(\d+)$")
"""The name of a sharded (``strategy="fsdp"``) step checkpoint, a directory; group 1 is the step."""

_TEMP_NAME = re.compile(r"^\.ckpt-step\d+\.pt(?:\.sha256)?\.tmp-(\d+)$")

_WRITTEN = re.compile(r"^(?:ckpt-step\d+(?:\.pt(?:\.sha256)?)?|\.ckpt-step\d+(?:\.pt(?:\.sha256)?)?\.tmp-[^/]+)$")


def run_written(name: str) -> bool:
    """Whether ``name`` in a checkpoint directory is one a run's saves write: a step checkpoint (file
    or directory), its ``.sha256`` record, or what a killed save left (``.ckpt-step….tmp-…``)."""
    return bool(_WRITTEN.match(name))


def step_path(directory: str | os.PathLike, step: int) -> Path:
    """The name of the checkpoint for ``step`` inside a checkpoint directory."""
    return Path(directory) / f"ckpt-step{step:08d}.pt"


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    """The name of the sharded checkpoint (a directory) for ``step`` inside a checkpoint directory."""
    return Path(directory) / f"ckpt-step{step:08d}"


def step_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of each step checkpoint in ``directory``, files and step directories, unordered."""
    if not directory.is_dir():
        return []
    return [
        (int(m.group(1)), p)
        for p in directory.iterdir()
        if (m := STEP_FILE.match(p.name)) or (p.is_dir() and (m := STEP_DIR.match(p.name)))
    ]


def prune(directory: str | os.PathLike, keep: int) -> None:
    """Keep the newest ``keep`` step checkpoints of ``directory`` (with their checksum files).

    Also sweeps what killed saves left: temp files of writers no longer alive, and checksum
    records whose checkpoint was never renamed into place.
    """
    directory = Path(directory)
    found = sorted(step_checkpoints(directory))
    for _, path in found[:-keep] if keep > 0 else []:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            continue
        path.unlink(missing_ok=True)
        sum_path(path).unlink(missing_ok=True)
    for path in directory.iterdir():
        temp = _TEMP_NAME.match(path.name)
        if temp and int(temp.group(1)) != os.getpid() and not _alive(int(temp.group(1))):
            path.unlink(missing_ok=True)
        elif (
            path.name.endswith(".pt.sha256")
            and STEP_FILE.match(path.name[:-7])
            and not path.with_name(path.name[:-7]).exists()
        ):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
