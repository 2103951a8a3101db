"""WebDataset-format ``.tar`` shards, read with the standard library.

A WebDataset shard is a plain tar file; consecutive members that share a *key* (the path up to
the first dot of the file name) form one sample, and the rest of the name is the field:
``000017.jpg`` and ``000017.cls`` are the fields ``jpg`` and ``cls`` of sample ``000017``.

ddpkit reads them with :mod:`tarfile` rather than the ``webdataset`` package: the format needs
nothing more, ``tarfile`` can step over members without reading their data (so a reader that
starts mid-shard, or counts a shard, reads only headers), and ``webdataset``'s own pipeline
splits shards by node and worker itself, which is the job ``Shards`` does here.

Example:
    >>> def read(path, start=0):                                       # doctest: +SKIP
    ...     for sample in ddpkit.read_tar(path, start):
    ...         yield decode_image(sample["jpg"]), int(sample["cls"])
    >>> shards = ddpkit.Shards(sorted(glob.glob("train-*.tar")), read)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator
from typing import Any


def _split(name: str) -> tuple[str, str]:
    folder, _, base = name.rpartition("/")
    stem, dot, field = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), (field if dot else "")


def read_tar(path: str | os.PathLike, start: int = 0) -> Iterator[dict[str, Any]]:
    """The samples of one WebDataset ``.tar`` shard from sample ``start`` on.

    Each sample is a dict of its fields' bytes, plus ``__key__`` (its key) and ``__url__`` (the
    shard). Members whose names start with ``.`` or ``_`` in their file name, and members that
    are not regular files, are left out, as WebDataset does. Skipped samples are stepped over
    without reading their data.
    """
    path = os.fspath(path)
    index, key, sample = 0, None, None
    with tarfile.open(path, mode="r:*") as archive:
        for member in archive:
            if not member.isfile():
                continue
            name_key, field = _split(member.name)
            base = member.name.rpartition("/")[2]
            if not field or base.startswith((".", "_")):
                continue
            if name_key != key:
                if sample is not None:
                    yield sample
                if key is not None:
                    index += 1
                key = name_key
                sample = {"__key__": key, "__url__": path} if index >= start else None
            if sample is not None:
                handle = archive.extractfile(member)
                sample[field] = handle.read() if handle is not None else b""
        if sample is not None:
            yield sample
