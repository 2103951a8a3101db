"""Reading DCP checkpoints without running code: DCP's reader and load planners, unpickling safely.

torch's DCP unpickles in two places while it loads: ``FileSystemReader.read_metadata`` runs
``pickle.load`` on ``.metadata``, and ``DefaultLoadPlanner.load_bytes`` runs
``torch.load(weights_only=False)`` on each non-tensor value of the ``.distcp`` files (an
optimizer's ``lr``, ``betas``, ...). Either would call whatever a crafted file names; a manifest
whose checksums match proves only that the files are the ones their writer meant. Here:

- :class:`Reader` reads ``.metadata`` with :class:`MetadataUnpickler`, which builds only what
  DCP metadata is made of (:data:`METADATA_GLOBALS` and torch's dtypes);
- the planners read the non-tensor values with ``torch.load(weights_only=True)``
  (:func:`ddpkit.checkpoint.safe.safe_load`); DCP reads tensors with ``weights_only=True`` itself;
- :func:`check_sizes` refuses metadata that declares more than the files hold (a tensor larger
  than its bytes, items outside their file or overlapping, a stream transform, a tensor's record
  compressed) before DCP allocates anything from it.

Anything else is refused before it is called, in one line naming the file and what it wanted
(:class:`ddpkit.errors.UnsafeCheckpoint`). Importing this module imports
``torch.distributed.checkpoint`` (most of a second): :mod:`ddpkit.checkpoint.dcp` imports it when it
loads.
"""

from __future__ import annotations

import functools
import io
import math
import os
import pickle
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata

from ddpkit import _bounds, _torch
from ddpkit.checkpoint.safe import safe_load
from ddpkit.errors import DamagedCheckpoint, DdpkitError, UnsafeCheckpoint, one_line, refused

_METADATA = "torch.distributed.checkpoint.metadata"

METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_METADATA, "Metadata"),
        (_METADATA, "StorageMeta"),
        (_METADATA, "MetadataIndex"),
        (_METADATA, "TensorStorageMetadata"),
        (_METADATA, "BytesStorageMetadata"),
        (_METADATA, "ChunkStorageMetadata"),
        (_METADATA, "TensorProperties"),
        (_METADATA, "_MEM_FORMAT_ENCODING"),  # TensorProperties' memory format, an Enum
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # where each item lies in which file
        ("torch", "Size"),  # sizes and chunk offsets
        ("torch.serialization", "_get_layout"),  # a torch.layout pickles as _get_layout("torch.strided")
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id, the directory written
        ("pathlib._local", "PosixPath"),  # the same, pickled by Python 3.13
    }
)
"""The ``(module, name)`` globals DCP metadata is made of, found by logging what the metadata of real
checkpoints (models, AdamW + scheduler, one process and sharded on two) asks for; a dtype pickles
as ``("torch", "float32")`` and the like (:data:`DTYPE_NAMES`). A test writes a checkpoint with
this torch and fails, naming the global, when torch starts to need another one."""

DTYPE_NAMES: frozenset[str] = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))
"""``torch.<name>`` attributes that are dtypes: a dtype is a value, not callable."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata with the globals of :data:`METADATA_GLOBALS` and torch's dtypes only.

    ``find_class`` is how a pickle reaches any callable (``GLOBAL``, ``STACK_GLOBAL`` and the
    extension registry all go through it), so a file that names anything else, ``posix.system``
    or ``builtins.eval`` or a method (``pathlib.Path.touch``), is refused before it is called.
    """

    def __init__(self, file: BinaryIO, where: Any):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        """The global ``module.name`` if metadata is made of it; else :class:`UnsafeCheckpoint`."""
        if (module, name) in METADATA_GLOBALS or (module == "torch" and name in DTYPE_NAMES):
            return super().find_class(module, name)
        raise refused(self.where, _python3_name(module, name))


def _python3_name(module: str, name: str) -> str:
    """``module.name`` as Python 3 calls it: pickles of protocol 0-2 may say ``__builtin__.eval``."""
    import _compat_pickle  # the table pickle itself maps Python 2 names with

    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"


def load_metadata(file: BinaryIO, where: Any) -> Metadata:
    """Unpickle DCP metadata from ``file`` (named ``where`` in messages) with :class:`MetadataUnpickler`.

    Raises:
        UnsafeCheckpoint: the file wants a global that metadata is not made of.
        DdpkitError: it unpickles to something that is not DCP metadata.
    """
    metadata = MetadataUnpickler(file, where).load()
    if not isinstance(metadata, Metadata):
        raise DamagedCheckpoint(f"checkpoint {where} is not DCP metadata (it holds a {type(metadata).__name__})")
    return metadata


class Reader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``.metadata`` goes through :class:`MetadataUnpickler`.

    It reads ``.metadata`` once: ddpkit reads it first (:func:`read_metadata`), DCP then gets
    the same object.
    """

    def __init__(self, path: str | Path, *args: Any, **kwargs: Any):
        super().__init__(path, *args, **kwargs)
        self._ddpkit_metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """As ``FileSystemReader.reset`` (a new load id, perhaps another checkpoint): read again."""
        super().reset(checkpoint_id)
        self._ddpkit_metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """What ``FileSystemReader.read_metadata`` of torch 2.13 does, unpickling with the allowlist.

        ``rank`` (a keyword) reads the rank-local ``__RANK.metadata`` that DCP falls back to.
        """
        rank = kwargs.get("rank")
        if rank is None and self._ddpkit_metadata is not None:
            return self._ddpkit_metadata
        path = _torch.dcp_metadata_path(self, rank)
        with self.fs.create_stream(path, "rb") as handle:
            # torch types the stream as io.IOBase; opened "rb", it is a binary file
            metadata = load_metadata(handle, path)  # type: ignore[arg-type]
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        if rank is None:
            self._ddpkit_metadata = metadata
        return metadata


class _PlainValues:
    """Part of a load planner: DCP's non-tensor values read with ``torch.load(weights_only=True)``.

    The value loaded safely is pickled again and handed to torch's own ``load_bytes``, which puts
    it where it belongs in the (flattened or nested) state dict. torch unpickles that without
    ``weights_only``, but it is what was pickled here from tensors and plain containers: nothing
    of the file reaches torch's unpickler.
    """

    def __init__(self, reader: Reader, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.reader = reader

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        file = Path(self.reader.path) / _torch.dcp_item_file(self.reader, read_item.storage_index)
        # on the host: a tensor among the values was saved on its rank's GPU, which this host may not have
        loaded = safe_load(value, f"{file} (entry {read_item.dest_index.fqn})", map_location="cpu")
        plain = io.BytesIO()
        torch.save(loaded, plain)
        plain.seek(0)
        super().load_bytes(read_item, plain)  # type: ignore[misc]


class Planner(_PlainValues, DefaultLoadPlanner):
    """DCP's default load planner (into a template state dict, resharding), reading values safely."""


@functools.cache
def _rebuilding_planner() -> type:
    # subclassing a class a function returns (torch's private planner, looked up at run time)
    class RebuildingPlanner(_PlainValues, _torch.dcp_rebuilding_planner()):  # type: ignore[misc]
        """DCP's planner that rebuilds the whole state dict from the metadata, reading values safely."""

    return RebuildingPlanner


def read_metadata(reader: Reader) -> Metadata:
    """The metadata of ``reader``'s checkpoint, read before DCP asks for it.

    DCP catches an error of its own metadata read, logs it with a traceback and tries the
    rank-local file; read first, a refusal or damage is one line and every rank raises it
    before any collective.

    Raises:
        UnsafeCheckpoint: ``.metadata`` wants a global that metadata is not made of.
        DdpkitError: ``.metadata`` is missing or damaged.
    """
    path, file = Path(reader.path), _torch.dcp_metadata_path(reader)
    try:
        metadata = reader.read_metadata()
    except DdpkitError:
        raise
    except FileNotFoundError:
        raise DamagedCheckpoint(
            f"checkpoint {path} has no {Path(file).name}: it is not a complete DCP checkpoint"
        ) from None
    except Exception as exc:
        said = one_line(str(exc)) or "no message"
        raise DamagedCheckpoint(
            f"checkpoint {file} cannot be read ({type(exc).__name__}: {said}); it is damaged"
        ) from None
    check_sizes(path, metadata)
    return metadata


def check_sizes(path: Path, metadata: Metadata) -> None:
    """Refuse in one line metadata that declares more bytes than the checkpoint's files hold.

    Every item lies inside a file of the checkpoint, no two overlap, none names a stream transform
    (a decompression), every tensor chunk declares no more bytes than its item holds, and each
    tensor item is a ``torch.save`` archive whose records are stored and as large as they declare.

    Raises:
        UnsafeCheckpoint: any of these does not hold.
    """

    def refuse(what: str) -> UnsafeCheckpoint:
        return UnsafeCheckpoint(
            f"checkpoint {path}: {what}; ddpkit refuses to load it (it declares more memory than its files hold)"
        )

    root = path.resolve()
    spans: dict[Path, list[tuple[int, int]]] = {}
    for index, info in metadata.storage_data.items():
        file = (root / str(info.relative_path)).resolve()
        if file.parent != root or not file.is_file():
            raise refuse(f"item {index.fqn} lies in {info.relative_path}, not a file of the checkpoint")
        if getattr(info, "transform_descriptors", None):
            raise refuse(f"item {index.fqn} is stored through {list(info.transform_descriptors)}")
        if info.offset < 0 or info.length < 0 or info.offset + info.length > file.stat().st_size:
            raise refuse(
                f"item {index.fqn} spans bytes {info.offset}-{info.offset + info.length} of "
                f"{file.name} ({file.stat().st_size} bytes)"
            )
        spans.setdefault(file, []).append((info.offset, info.offset + info.length))
    for file, pieces in spans.items():
        pieces.sort()
        if any(start < end for (_, end), (start, _) in zip(pieces, pieces[1:])):
            raise refuse(f"two items overlap in {file.name}")
    handles: dict[str, BinaryIO] = {}
    try:
        for fqn, item in metadata.state_dict_metadata.items():
            for chunk in getattr(item, "chunks", None) or ():
                info = metadata.storage_data.get(MetadataIndex(fqn, chunk.offsets))
                if info is None:
                    raise refuse(f"tensor {fqn} has a chunk with no item")
                tensor = cast(TensorStorageMetadata, item)  # it has chunks: a tensor's (bytes have none)
                declared = math.prod(chunk.sizes) * tensor.properties.dtype.itemsize
                if declared > info.length:
                    raise refuse(f"tensor {fqn} declares {declared} bytes in an item of {info.length}")
                name = str(info.relative_path)
                handle = handles.get(name) or handles.setdefault(name, open(root / name, "rb"))
                try:
                    # a readable, seekable file: what check needs of an IO[bytes]
                    _bounds.check(cast(IO[bytes], _Slice(handle, info.offset, info.length)), fqn)
                except _bounds.Disproportionate as exc:
                    raise refuse(f"tensor {exc}") from None
    finally:
        for handle in handles.values():
            handle.close()


class _Slice(io.RawIOBase):
    """Bytes ``offset`` to ``offset + length`` of an open file, as a file of their own (for ``zipfile``)."""

    def __init__(self, handle: BinaryIO, offset: int, length: int) -> None:
        super().__init__()
        self._handle, self._offset, self._length, self._at = handle, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, position: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._at, os.SEEK_END: self._length}[whence]
        self._at = min(max(0, base + position), self._length)
        return self._at

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self._length - self._at)
        self._handle.seek(self._offset + self._at)
        data = self._handle.read(count)
        buffer[: len(data)] = data
        self._at += len(data)
        return len(data)


def load(path: Path, template: dict[str, Any]) -> None:
    """``dcp.load(template)`` from ``path`` (every rank calls it; DCP reshards), unpickling safely.

    Raises:
        UnsafeCheckpoint: a file of the checkpoint wants something beyond plain data, on any rank.
        DdpkitError: ``.metadata`` is missing or damaged.
        BaseException: DCP's own errors otherwise (``CheckpointException`` is a BaseException).
    """
    import torch.distributed.checkpoint as dcp

    reader = Reader(path)
    read_metadata(reader)
    try:
        dcp.load(template, storage_reader=reader, planner=Planner(reader))
    except BaseException as exc:
        _raise_refusal(exc)
        raise


def load_whole(path: Path) -> dict[str, Any]:
    """Everything DCP holds in ``path``, rebuilt in this process alone (no template, no process group).

    What ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` rebuilds, in memory.

    Raises:
        UnsafeCheckpoint: a file of the checkpoint wants something beyond plain data.
        DdpkitError: ``.metadata`` is missing or damaged.
        BaseException: DCP's own errors otherwise.
    """
    reader = Reader(path)
    read_metadata(reader)
    whole: dict[str, Any] = {}
    try:
        _torch.dcp_load_in_one_process(whole, reader, _rebuilding_planner()(reader))
    except BaseException as exc:
        _raise_refusal(exc)
        raise
    return whole


def _raise_refusal(exc: BaseException) -> None:
    """Raise the :class:`UnsafeCheckpoint` that DCP's ``exc`` carries (it gathers each rank's error)."""
    for failure in getattr(exc, "failures", {}).values():  # CheckpointException: rank -> (error, trace)
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, UnsafeCheckpoint):
            raise error from None
