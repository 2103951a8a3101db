"""Files written so that a kill at any moment leaves the old one or the new one: names, fsync, checksums.

A base module (it imports nothing of ddpkit): every file ddpkit writes goes through it, the
checkpoint formats (:mod:`ddpkit.checkpoint.pt`, :mod:`ddpkit.checkpoint.dcp`) through
:func:`temp_path`, everything else (metrics, predictions, summaries, reports, caches) through
:func:`atomic_path`. A file or directory is written under
:func:`temp_path`, fsynced, renamed into place with ``os.replace`` and its directory fsynced;
:func:`digest` is the size and SHA-256 that a checksum record (:func:`sum_path`) or a manifest
keeps of what was written.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


def temp_path(path: Path, token: str | int | None = None) -> Path:
    """``.NAME.tmp-TOKEN`` beside ``path``: where it is written before its rename (token: this pid)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid() if token is None else token}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block succeeds, fsync it and move it into place.

    Readers never see a half-written file, a failure leaves the old file untouched, and once the
    block returns the new file and its name are on the disk (the file and its directory fsynced).
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh(final)
    try:
        yield Path(tmp)
        fsync_file(Path(tmp))
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(final.parent)


def _fresh(final: Path) -> Path:
    """A new empty ``.NAME.RANDOM.tmp`` beside ``final``, its mode from the umask like any new file."""
    for _ in range(100):
        tmp = final.with_name(f".{final.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"no free temporary name beside {final}")


def sum_path(path: Path) -> Path:
    """``NAME.sha256`` beside ``path``: the size and checksum recorded when it was written."""
    return path.with_name(path.name + ".sha256")


def write_text_atomic(path: Path, text: str) -> None:
    """Write a small text file: temp file, fsync, rename (the directory is left to the caller)."""
    tmp = temp_path(path)
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def fsync_file(path: Path) -> None:
    """Flush a file written by someone else (DCP's shards) to the disk."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(directory: Path) -> None:
    """Flush ``directory``'s entries (a rename into it) to the disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def digest(path: Path) -> tuple[str, int]:
    """The SHA-256 (hex) and the size in bytes of the file ``path``."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            sha.update(chunk)
            size += len(chunk)
    return sha.hexdigest(), size
