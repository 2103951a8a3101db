"""Loading a checkpoint's pickles without running code: ``torch.load(weights_only=True)``, refusals in one line.

Both formats read through here: the single ``.pt`` file (:mod:`ddpkit.checkpoint.pt`), and a
sharded checkpoint's ``ddpkit.pt`` and the non-tensor values of its ``.distcp`` files
(:mod:`ddpkit.checkpoint.dcp`, :mod:`ddpkit.checkpoint.dcp_reader`).
"""

from __future__ import annotations

import io
import re
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from ddpkit import _bounds
from ddpkit.errors import UnsafeCheckpoint, UsageError, one_line, refused, refused_global


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


_HINTS = {
    "numpy": "a numpy value: store float(x), x.tolist() or torch.from_numpy(x)",
    "collections.deque": "a deque: store list(d)",
    "collections.defaultdict": "a defaultdict: store dict(d)",
    "pathlib": "a path: store str(p)",
    "builtins.range": "a range: store list(r), or its bounds",
    "builtins.slice": "a slice: store its bounds",
}


def check_loadable(entries: Mapping[str, Any]) -> None:
    """Refuse in one line what :func:`unloadable` finds.

    Raises:
        UsageError: naming the entry and what it holds that the load would refuse, or why it cannot be pickled.
    """
    problem = unloadable(entries)
    if problem is not None:
        raise UsageError(problem)


def unloadable(entries: Mapping[str, Any]) -> str | None:
    """Why a checkpoint could hold an entry of the state but not give it back (None: it gives all back).

    ddpkit loads checkpoints with ``torch.load(weights_only=True)``, which refuses a numpy value
    (``np.float64`` from a metric, an array), a ``deque``, a path, ... So such a save used to succeed,
    and the run failed only when it was resumed, after the crash it was saved for.

    What is tried is the entry's shape with each tensor left out: pickled, then read back as a
    checkpoint is (tensors are always taken). Where the script allowed more with
    ``torch.serialization.add_safe_globals``, that is taken here as on load.
    """
    for key, value in entries.items():
        buffer = io.BytesIO()
        try:
            torch.save(_without_tensors(value), buffer)
        except Exception as exc:  # noqa: BLE001 - pickle raises PicklingError, AttributeError, TypeError, ...
            return (
                f"a checkpoint cannot hold state[{key!r}] ({one_line(str(exc), 160)}); keep numbers, strings, "
                "tensors, and lists, tuples and dicts of them in a checkpoint's state"
            )
        buffer.seek(0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.load(buffer, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - what the load of the checkpoint would raise
            wanted = refused_global(exc)
            hint = next((h for prefix, h in _HINTS.items() if wanted and wanted.startswith(prefix)), None)
            holds = f"holds {wanted}" if wanted else f"holds what a checkpoint is not made of ({reason(exc)})"
            return (
                f"a checkpoint cannot hold state[{key!r}]: it {holds}, which ddpkit's load (torch.load with "
                "weights_only=True, which runs no code) would refuse, so the run could not resume from this "
                f"checkpoint; {'it is ' + hint if hint else 'store plain values (numbers, strings, tensors, lists, dicts)'}"
            )
    return None


def _without_tensors(value: Any) -> Any:
    """``value`` without the tensors inside its plain containers (a tensor always loads): a dict's entry
    of a tensor under a name or a number is left out (a state dict's all), another tensor is None."""
    if isinstance(value, torch.Tensor):
        return None
    kind = type(value)
    if kind in (dict, OrderedDict):  # (a state dict's _metadata, torch's own plain versions, is left out)
        return kind(
            (k, _without_tensors(v))
            for k, v in value.items()
            if not (isinstance(v, torch.Tensor) and type(k) in (str, int))
        )
    if kind in (list, tuple):
        return kind(_without_tensors(v) for v in value)
    return value
