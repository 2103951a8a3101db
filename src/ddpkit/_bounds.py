"""Memory bounded by the bytes: a ``torch.save`` file checked before ``torch.load`` allocates anything.

``torch.load(weights_only=True)`` runs no code, but it trusts the sizes a file declares. A record
of the zip archive may be deflated (4 MB of compressed zeros inflate to 4 GiB), and the pickle
declares each storage's element count, which older torch allocates before it reads the record.
:func:`check` reads only the archive's directory and its pickle (never a storage) and refuses a
file in which anything declares more bytes than the file holds:

- every record is stored, not compressed (``torch.save`` never compresses), and the records
  together are no larger than the file;
- every storage the pickle names lies in a record of its own at least as large as it declares;
- the file is torch's zip format: the legacy format (torch < 1.6) declares each storage's size
  in a header and torch allocates it before reading, so it cannot be bounded here.

Nothing of the pickle is called: :class:`_Declared` builds every global as an inert stand-in and
records what each persistent id (``("storage", type, key, location, numel)``) declares.

Example:
    >>> import io, torch
    >>> buffer = io.BytesIO()
    >>> torch.save({"w": torch.zeros(3)}, buffer)
    >>> check(buffer, "w.pt")
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import zipfile
from typing import IO, Any

_ITEMSIZE = {
    "Double": 8,
    "Float": 4,
    "Half": 2,
    "BFloat16": 2,
    "Long": 8,
    "Int": 4,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
    "ComplexDouble": 16,
    "ComplexFloat": 8,
    "QInt8": 1,
    "QUInt8": 1,
    "QInt32": 4,
    "QUInt4x2": 1,
    "QUInt2x4": 1,
    "Untyped": 1,
    "Float8_e5m2": 1,
    "Float8_e4m3fn": 1,
    "Float8_e5m2fnuz": 1,
    "Float8_e4m3fnuz": 1,
    "UInt16": 2,
    "UInt32": 4,
    "UInt64": 8,
}
"""Bytes per element of each ``torch.<Name>Storage`` a pickle may name."""


class Disproportionate(ValueError):
    """A file declares more bytes than it holds (or cannot be bounded): one line naming it and what it declares."""


class _Stand:
    """An inert stand-in for any global a pickle names: building, calling or filling it does nothing."""

    name = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Stand:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Stand:
        return _Stand()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _Declared(pickle.Unpickler):
    """Reads a torch pickle with every global inert, keeping each storage's ``(key, declared bytes)``."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.storages: dict[str, int] = {}

    def find_class(self, module: str, name: str) -> Any:
        return type("Stand", (_Stand,), {"name": f"{module}.{name}"})

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise Disproportionate(f"an unexpected persistent id {str(pid)[:60]!r}")
        _, kind, key, _, numel = pid
        if not isinstance(numel, int) or numel < 0:
            raise Disproportionate(f"storage {key!r} declares {numel!r} elements")
        self.storages[str(key)] = max(self.storages.get(str(key), 0), numel * _itemsize(getattr(kind, "name", "")))
        return _Stand()


def _itemsize(name: str) -> int:
    """Bytes per element of the storage class (``torch.FloatStorage``) or dtype (``torch.float32``) named;
    1 where torch names something this module does not know (the bound is then the element count)."""
    short = name[len("torch.") :] if name.startswith("torch.") else ""
    if short.endswith("Storage") and short[: -len("Storage")] in _ITEMSIZE:
        return _ITEMSIZE[short[: -len("Storage")]]
    import torch

    dtype = getattr(torch, short, None) if short else None
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 1


_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def _legacy(head: bytes) -> bool:
    """Whether ``head`` starts a file of torch's legacy format: a pickle of its magic number first."""
    try:
        for opcode, argument, _ in pickletools.genops(io.BytesIO(head)):
            if opcode.name not in ("PROTO", "FRAME"):
                return argument == _LEGACY_MAGIC
    except Exception:  # noqa: BLE001 - not a pickle at all
        return False
    return False


def check(source: str | os.PathLike | IO[bytes] | bytes, where: Any) -> None:
    """Refuse ``source`` (a path, an open binary file or bytes) if it declares more than it holds.

    Reads the zip directory and the pickle only. ``where`` names the file in the message.

    Raises:
        Disproportionate: a compressed record, records larger than the file, a storage larger
            than its record, a legacy-format file, or an archive that is not torch's.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(bytes(source))
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as handle:
            _check_open(handle, where)
        return
    position = source.tell()
    try:
        _check_open(source, where)
    finally:
        source.seek(position)


def _check_open(handle: IO[bytes], where: Any) -> None:
    handle.seek(0, os.SEEK_END)
    total = handle.tell()
    handle.seek(0)
    head = handle.read(64)
    handle.seek(0)
    if not zipfile.is_zipfile(handle):
        if _legacy(head):
            raise Disproportionate(
                f"{where} is in torch's legacy format (torch.save before 1.6, or "
                "_use_new_zipfile_serialization=False), whose storages torch allocates before "
                "reading them; load it with torch.load yourself and save it again"
            )
        return  # a damaged archive, or not a torch file at all: torch.load says which, allocating nothing
    handle.seek(0)
    try:
        archive = zipfile.ZipFile(handle)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise Disproportionate(f"{where} is a damaged archive ({exc})") from None
    with archive:
        records = {info.filename: info for info in archive.infolist()}
        for info in records.values():
            if info.compress_type != zipfile.ZIP_STORED:
                raise Disproportionate(
                    f"{where}: record {info.filename} is compressed ({info.file_size} bytes "
                    f"from {info.compress_size}); torch.save never compresses, so this file "
                    "was made to take more memory than it holds"
                )
        stored = sum(info.file_size for info in records.values())
        if stored > total:
            raise Disproportionate(f"{where}: its records declare {stored} bytes in a file of {total}")
        pickles = [name for name in records if name.endswith("/data.pkl") or name == "data.pkl"]
        if len(pickles) != 1:
            raise Disproportionate(f"{where} is not a torch.save archive (no single data.pkl record)")
        prefix = pickles[0][: -len("data.pkl")]
        reader = _Declared(archive.read(pickles[0]))
        try:
            reader.load()
        except Disproportionate as exc:
            raise Disproportionate(f"{where}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a damaged pickle fails in many ways; torch says the rest
            raise Disproportionate(f"{where}: its pickle is damaged ({type(exc).__name__})") from None
        for key, declared in reader.storages.items():
            record = records.get(f"{prefix}data/{key}")
            if record is None:
                raise Disproportionate(f"{where}: storage {key} has no record")
            if declared > record.file_size:
                raise Disproportionate(
                    f"{where}: storage {key} declares {declared} bytes in a record of {record.file_size}"
                )


__all__ = ["Disproportionate", "check"]
