"""Which rank of a failed job failed first, and how to say so in one line: a rank that failed because a peer died first is never the root cause when another exists."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

# Errors a rank raises because a peer died first: never the root cause when another exists.
_SECONDARY = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote worker crashing",
    "sigterm",
    "signal 15",
)


def root_failure(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The failure that most likely caused the others: not a peer-loss error, earliest, lowest rank."""

    def key(item: tuple[int, Any]) -> tuple[bool, int, int]:
        rank, failure = item
        return is_secondary(failure_text(failure)), int(getattr(failure, "timestamp", 0) or 0), rank

    return min(failures.items(), key=key)


def is_secondary(text: str) -> bool:
    """Whether a failure's text says it followed a peer's (a lost connection, a timed-out collective)."""
    return any(word in text.lower() for word in _SECONDARY)


def failure_text(failure: Any) -> str:
    """A worker failure's message, with SIGTERM named where the agent stopped it."""
    text = str(getattr(failure, "message", "") or "")
    code = getattr(failure, "exitcode", None)
    if code == -15:
        text += " SIGTERM"
    return text


def describe(failure: Any) -> str:
    """How a worker ended, in words: ``killed by SIGKILL`` or ``exit code 3``."""
    code = getattr(failure, "exitcode", None)
    if code is not None and code < 0:
        import signal

        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


__all__ = ["describe", "is_secondary", "root_failure"]
