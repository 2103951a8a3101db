"""What a job shows while it runs: a progress bar of long work (tqdm on rank 0, silent elsewhere
and when not on a terminal), and whole lines printed once (``rt.print``).
"""

from __future__ import annotations

import builtins
import io
import sys
from typing import Any

import torch


class Progress:
    """A tqdm bar on rank 0 that stays silent elsewhere and when stderr is not a terminal.

    Logs of batch jobs stay clean: no carriage-return noise in files, no bar per rank.

    Args:
        total: Number of updates expected, or None when unknown.
        enabled: False on non-zero ranks.
        desc: Label in front of the bar.
        unit: What one update counts (``"samples"`` makes tqdm show samples/s).
    """

    def __init__(self, total: int | None, *, enabled: bool, desc: str = "", unit: str = "it"):
        self._bar: Any = None
        if not (enabled and _stderr_is_tty()):
            return
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)

    @property
    def active(self) -> bool:
        """True when a bar is actually being drawn."""
        return self._bar is not None

    def update(self, n: int = 1, **postfix: Any) -> None:
        """Advance by ``n`` and show ``postfix`` (e.g. ``loss=0.31``) after the bar."""
        if self._bar is None:
            return
        if postfix:
            self._bar.set_postfix({k: _postfix_value(v) for k, v in postfix.items()}, refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        """Finish the bar; safe to call twice."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def print_line(*args: Any, prefix: str | None = None, **kwargs: Any) -> None:
    """``print`` as one ``write`` of the whole line (``prefix`` first), flushed unless ``flush=False``.

    Lines printed by several ranks onto one shared pipe then do not interleave mid-line (with
    ``PYTHONUNBUFFERED`` the builtin ``print`` writes the text and its newline separately).
    """
    if prefix is not None:
        args = (prefix, *args)
    stream = kwargs.pop("file", None) or sys.stdout
    flush = kwargs.pop("flush", True)
    line = io.StringIO()
    builtins.print(*args, file=line, **kwargs)
    stream.write(line.getvalue())
    if flush:
        stream.flush()


def _postfix_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def _stderr_is_tty() -> bool:
    try:
        return bool(sys.stderr is not None and sys.stderr.isatty())
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False
