"""Loading a checkpoint's pickles without running code: ``torch.load(weights_only=True)``, refusals in one line.

Both formats read through here: the single ``.pt`` file (:mod:`ddpkit.checkpoint.pt`), and a
sharded checkpoint's ``ddpkit.pt`` and the non-tensor values of its ``.distcp`` files
(:mod:`ddpkit.checkpoint.dcp`, :mod:`ddpkit.checkpoint.dcp_reader`).
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch

from ddpkit import _bounds
from ddpkit.errors import UnsafeCheckpoint, one_line, refused, refused_global


def safe_load(source: Any, where: Any, *, map_location: Any = "cpu") -> Any:
    """``torch.load(source, weights_only=True)``: tensors and plain containers, nothing that runs code,
    and no more memory than the file's own bytes.

    A file that wants any other global is refused before it is called, with one line naming
    ``where`` (the file, for messages) and the global: torch's own refusal spans many lines of
    advice on how to load the file anyway. A file that declares more bytes than it holds (a
    compressed record, a storage larger than its record) is refused before anything is allocated
    (:func:`bounded`).

    Raises:
        UnsafeCheckpoint: the file asks for something beyond plain data, or for more memory than it holds.
        Exception: whatever ``torch.load`` raises for a damaged file, unchanged.
    """
    bounded(source, where)
    try:
        with warnings.catch_warnings():  # torch's advice on a file it cannot read: the error says it
            warnings.simplefilter("ignore")
            return torch.load(source, map_location=map_location, weights_only=True)
    except Exception as exc:
        refusal = unsafe_refusal(exc, where)
        if refusal is not None:
            raise refusal from None
        raise


def bounded(source: Any, where: Any) -> None:
    """Refuse ``source`` (a path, an open binary file or bytes) in one line if it declares more bytes than it holds.

    Raises:
        UnsafeCheckpoint: see :func:`ddpkit._bounds.check`.
    """
    try:
        _bounds.check(source, where)
    except _bounds.Disproportionate as exc:
        raise UnsafeCheckpoint(f"checkpoint {exc}; ddpkit refuses to load it") from None


def unsafe_refusal(exc: BaseException, where: Any) -> UnsafeCheckpoint | None:
    """The :class:`UnsafeCheckpoint` that torch's ``weights_only`` error ``exc`` amounts to, if it is one.

    Most name a global (:func:`ddpkit.errors.refused_global`); torch's other refusals (``Can only build ...``, ``Trying to call reduce ...``) name a
    class or function instead.
    """
    text = str(exc)
    wanted = refused_global(exc)
    if wanted:
        return refused(where, wanted)
    unsafe = re.search(
        r"^.*(Can only (?:build|create new object)|Trying to call reduce|"
        r"unsupported class).*$",
        text,
        re.IGNORECASE | re.MULTILINE,
    )
    if unsafe:
        return refused(where, None, unsafe.group(0))
    return None


def reason(exc: BaseException) -> str:
    """What torch's load error says is wrong, on one line (not its advice about weights_only)."""
    advice = ("weights_only", "weights only", "torch.load", "please file an issue")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if not any(word in line.lower() for word in advice)]
    return one_line((useful or lines or [type(exc).__name__])[0])
