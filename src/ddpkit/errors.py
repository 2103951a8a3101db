"""Errors that ddpkit reports to users as one clear line instead of a traceback, and warnings
that point at the user's own line."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from types import FrameType

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PASSED = (_PACKAGE, os.path.join(os.path.dirname(os.__file__), "contextlib.py"))


EXIT_MISMATCH = 123
"""Exit code of every rank of a job whose ranks called different collectives (a collective mismatch)."""
EXIT_HANG = 124
"""Exit code of every rank of a job the hang watchdog found hung (as ``timeout(1)``)."""


class DdpkitError(Exception):
    """A problem the user can fix; the CLI prints its message alone and exits with ``exit_code``."""

    exit_code = 1


class UsageError(DdpkitError, ValueError):
    """Bad flags, paths or values given by the user (exit code 2, like argparse); a ``ValueError``,
    as Python's own refusals of bad values are."""

    exit_code = 2


class UnsafeCheckpoint(UsageError):
    """A checkpoint file that asks to unpickle something beyond plain data: it could run code.

    Raised before anything it names is called. A usage error (exit code 2): the file is the
    user's input, and the fix is another file.
    """


class DamagedCheckpoint(UsageError):
    """A checkpoint that is missing, truncated, corrupted or not a checkpoint (exit code 2: the fix is
    another file, or an earlier checkpoint)."""


def refused(where: object, wanted: str | None, detail: str = "") -> UnsafeCheckpoint:
    """The one-line :class:`UnsafeCheckpoint` for file ``where``, which wanted the global ``wanted``.

    ``wanted`` is ``module.name`` (``posix.system``); None when the unpickler said something
    else (``detail``, its own words).
    """
    if wanted:
        return UnsafeCheckpoint(
            f"checkpoint {where} wants {wanted}, which is not among what a checkpoint is "
            "made of; ddpkit refuses to unpickle it (it could run code)"
        )
    said = f" ({one_line(detail)})" if detail else ""
    return UnsafeCheckpoint(
        f"checkpoint {where} holds objects that are not plain tensors or containers{said}; "
        "ddpkit refuses to unpickle them (they could run code)"
    )


def refused_global(exc: BaseException) -> str | None:
    """The global (``module.name``) that torch's ``weights_only`` refusal ``exc`` names, or None.

    torch names it in ``Unsupported global: GLOBAL getattr was not an allowed global`` (builtins
    without their module) or ``unsupported GLOBAL posix.system whose module posix is blocked``.
    """
    import re

    found = re.search(r"GLOBAL (\S+?)(?: was not an allowed global| whose module )", str(exc))
    if not found:
        return None
    wanted = found.group(1)
    return wanted if "." in wanted else f"builtins.{wanted}"


def one_line(text: str, budget: int = 160) -> str:
    """``text`` on one line, shortened only between whole sentences.

    Newlines and runs of spaces become one space. Text longer than ``budget`` characters keeps
    as many whole sentences from its start as fit, and at least the first sentence whatever
    its length: an error message is never cut inside a sentence.
    """
    import re

    flat = " ".join(text.split())
    if len(flat) <= budget:
        return flat
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z])", flat)
    kept = sentences[0]
    for sentence in sentences[1:]:
        if len(kept) + 1 + len(sentence) > budget:
            break
        kept += " " + sentence
    return kept


def called_from_user_code(depth: int = 2) -> bool:
    """Whether the frame ``depth`` levels above the caller is outside ddpkit: a script's own line."""
    return not sys._getframe(depth).f_code.co_filename.startswith(_PASSED)


_NOT_THE_USERS: list[tuple[str, ...]] = []


def _not_the_users() -> tuple[str, ...]:
    """ddpkit's, the standard library's (runpy) and torch's directories; kept once torch is imported."""
    if _NOT_THE_USERS:
        return _NOT_THE_USERS[0]
    skipped = _PASSED[:1] + (os.path.dirname(os.__file__) + os.sep,)
    torch = sys.modules.get("torch")
    if torch is None or not getattr(torch, "__file__", None):
        return skipped
    _NOT_THE_USERS.append((*skipped, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep))
    return _NOT_THE_USERS[0]


def user_line(frame: FrameType | None = None) -> str:
    """``path:line`` of the innermost frame outside ddpkit, torch and the standard library ("" if none):
    the line of the user's script that led to the call (or to ``frame``, another thread's)."""
    return _first_users(_outward(sys._getframe(1) if frame is None else frame))


def _outward(frame: FrameType | None) -> Iterator[tuple[str, int]]:
    """``(path, line)`` of ``frame`` and its callers, innermost first, read as they are asked for."""
    while frame is not None:
        yield frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back


def raised_at(error: BaseException) -> str:
    """``path:line`` of the innermost frame of ``error``'s traceback in the user's code ("" if none):
    the line of the user's script that the error came through (see :func:`user_line`)."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    return _first_users(reversed(frames))


def _first_users(frames: Iterable[tuple[str, int]]) -> str:
    """The first of ``frames`` (innermost first) in the user's code, as ``path:line``."""
    skipped = _not_the_users()
    for name, line in frames:
        if not name.startswith(skipped) and not name.startswith("<"):
            try:
                shown = os.path.relpath(name)
            except ValueError:
                shown = name
            return f"{name if shown.startswith('..') else shown}:{line}"
    return ""


def warn(message: str, category: type[Warning] = UserWarning, *, past_torch: bool = False) -> None:
    """``warnings.warn`` attributed to the first caller outside ddpkit: the user's line.

    However deep inside ddpkit the warning is raised (``rt.setup`` -> wrap -> replicate), it
    names the script's line that led there, as a library's warning should; and a warning
    filter keyed on the user's module works.
    """
    skipped = _not_the_users() if past_torch else _PASSED  # past_torch: raised from a hook torch calls
    level, frame = 2, sys._getframe(1)  # level 2: the caller of warn
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


_TRANSLATORS: list[Callable[[BaseException], DdpkitError | None]] = []


def translate_uncaught(translator: Callable[[BaseException], DdpkitError | None]) -> None:
    """Have an uncaught exception that ``translator`` recognises reported as the :class:`DdpkitError` it returns.

    ``translator(exc)`` returns a :class:`DdpkitError` for an exception it knows (torch's own, raised
    in the user's code because of a setting ddpkit made), else None. ddpkit's excepthook asks
    each translator once; registering one twice keeps one.
    """
    if translator not in _TRANSLATORS:
        _TRANSLATORS.append(translator)


_FAILURE_NOTES: list[Callable[[BaseException], None]] = []


def note_failures(note: Callable[[BaseException], None]) -> Callable[[], None]:
    """Have ``note(exc)`` called where :func:`ddpkit.launch`'s children catch what their function raised
    (to send it to the parent), before Python's excepthook could see it; returns the undo. A script's
    own excepthook calls what it needs itself.
    """
    _FAILURE_NOTES.append(note)
    return lambda: _FAILURE_NOTES.remove(note) if note in _FAILURE_NOTES else None


def script_failed(exc: BaseException) -> None:
    """The script ends by ``exc``: tell every note of :func:`note_failures`."""
    for note in list(_FAILURE_NOTES):
        note(exc)


def translated(exc: BaseException) -> DdpkitError | None:
    """What a translator registered by :func:`translate_uncaught` makes of ``exc`` (None: nothing)."""
    for translator in _TRANSLATORS:
        found = translator(exc)
        if found is not None:
            return found
    return None
