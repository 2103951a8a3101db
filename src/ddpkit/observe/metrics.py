"""What rank 0 writes while training: metrics as JSON lines, CSV and TensorBoard.

Every file is flushed after each write so a crash loses nothing already logged, and the
CSV always has a header that covers every column, so it opens in any spreadsheet.

Example:
    >>> import tempfile
    >>> with MetricsLogger(tempfile.mkdtemp(), tensorboard=False) as log:
    ...     log.log({"train_loss": 0.5}, step=1)
    >>> log.rows
    [{'step': 1, 'train_loss': 0.5}]
"""

from __future__ import annotations

import csv
import json
import operator
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from ddpkit._files import atomic_path
from ddpkit.errors import UsageError, warn

Number = int | float
_TB_WARNED = False  # warn about a missing TensorBoard once per process, not once per logger


class MetricsLogger:
    """Append metric rows to ``metrics.jsonl``, ``metrics.csv`` and TensorBoard under ``out_dir``.

    Args:
        out_dir: Folder for the files; created on first use.
        enabled: False on non-zero ranks: every method does nothing and no file is written.
        tensorboard: Also write TensorBoard scalars under ``out_dir/tensorboard``.
        resume: Keep the rows of an existing ``metrics.jsonl`` and append to them, instead
            of starting fresh.
        resume_step: With ``resume``, drop rows logged after this step: they belong to work a
            crash undid, and the resumed run logs them again (TensorBoard purges them too).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        enabled: bool = True,
        tensorboard: bool = True,
        resume: bool = False,
        resume_step: int | None = None,
    ):
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] = []  # metric keys in first-seen order, without "step"
        self._jsonl: IO[str] | None = None
        self._csv: IO[str] | None = None
        self._writer: Any = None
        self._closed = False
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if resume and self.jsonl_path.exists():
            self._rows = _read_jsonl(self.jsonl_path)
            if resume_step is not None:
                self._rows = [row for row in self._rows if row.get("step", 0) <= resume_step]
            for row in self._rows:
                self._columns += [k for k in row if k != "step" and k not in self._columns]
            # Rewrite both files from the rows that parsed, dropping a torn last line.
            _rewrite(self.jsonl_path, "".join(_json_line(r) for r in self._rows))
        else:
            _rewrite(self.jsonl_path, "")
        self._rewrite_csv()
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        if tensorboard:
            # TensorBoard hides the events of steps after the resumed one that an earlier attempt wrote.
            purge = resume_step + 1 if resume and resume_step is not None else None
            self._writer = _summary_writer(self.out_dir / "tensorboard", purge)

    # -- paths and rows -----------------------------------------------------------------
    @property
    def jsonl_path(self) -> Path:
        """``out_dir/metrics.jsonl``: one JSON object a row."""
        return self.out_dir / "metrics.jsonl"

    @property
    def csv_path(self) -> Path:
        """``out_dir/metrics.csv``: one row a step, a column for every key ever logged."""
        return self.out_dir / "metrics.csv"

    @property
    def rows(self) -> list[dict[str, Any]]:
        """Copies of every logged row, oldest first (empty when disabled)."""
        return [dict(row) for row in self._rows]

    # -- writing ------------------------------------------------------------------------
    def log(self, metrics: Mapping[str, Number | torch.Tensor], *, step: int) -> None:
        """Record ``metrics`` at ``step`` in every sink and flush them all.

        Raises:
            UsageError: a value is not a single number, a key is not a string or is
                ``"step"``, ``step`` is not an integer, or the logger is closed.
        """
        if not self.enabled:
            return
        if self._closed:
            raise UsageError(f"MetricsLogger({str(self.out_dir)!r}) is closed; create a new one to log")
        row = {"step": _as_step(step), **{_as_key(k): _as_number(k, v) for k, v in metrics.items()}}
        self._rows.append(row)
        assert self._jsonl is not None
        self._jsonl.write(_json_line(row))
        self._jsonl.flush()
        new_keys = [k for k in row if k != "step" and k not in self._columns]
        if new_keys:
            self._columns += new_keys
            self._rewrite_csv()
        else:
            self._append_csv(row)
        if self._writer is not None:
            for key, value in row.items():
                if key != "step":
                    self._writer.add_scalar(key, value, global_step=row["step"])
            self._writer.flush()

    def _append_csv(self, row: Mapping[str, Any]) -> None:
        if self._csv is None:
            self._csv = open(self.csv_path, "a", encoding="utf-8", newline="")
        csv.DictWriter(self._csv, fieldnames=["step", *self._columns]).writerow(row)
        self._csv.flush()

    def _rewrite_csv(self) -> None:
        """Write the whole CSV again with the current (wider) header; old rows get empty cells."""
        if self._csv is not None:
            self._csv.close()
            self._csv = None
        with atomic_path(self.csv_path) as tmp, open(tmp, "w", encoding="utf-8", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=["step", *self._columns], restval="")
            writer.writeheader()
            writer.writerows(self._rows)

    # -- plotting -----------------------------------------------------------------------
    def plot_loss(
        self, path: str | os.PathLike | None = None, *, keys: Sequence[str] = ("train_loss", "test_loss")
    ) -> Path | None:
        """Draw each of ``keys`` that was logged against step into a PNG (``out_dir/loss.png``).

        Returns:
            The PNG's path, or None when disabled or when none of ``keys`` was ever logged.
        """
        if not self.enabled:
            return None
        series = {k: [(r["step"], r[k]) for r in self._rows if r.get(k) is not None] for k in keys}
        series = {k: points for k, points in series.items() if points}
        if not series:
            return None
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for key, points in series.items():
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o" if len(points) < 30 else None, label=key)
        ax.set_title("Loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(True, alpha=0.3)
        ax.legend()
        target = Path(path) if path is not None else self.out_dir / "loss.png"
        with atomic_path(target) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
        return target

    # -- life ---------------------------------------------------------------------------
    def close(self) -> None:
        """Flush and close every file and the TensorBoard writer; safe to call twice."""
        if self._closed or not self.enabled:
            self._closed = True
            return
        self._closed = True
        for handle in (self._jsonl, self._csv):
            if handle is not None:
                handle.close()
        self._jsonl = self._csv = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- helpers ----------------------------------------------------------------------------
def as_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Each metric as a float: a tensor's mean, or the number itself."""
    return {
        k: float(v.detach().float().mean()) if isinstance(v, torch.Tensor) else float(v) for k, v in metrics.items()
    }


def _as_step(step: Any) -> int:
    if isinstance(step, bool):
        raise UsageError(f"step must be an integer, got {step!r}")
    try:
        return operator.index(step)
    except TypeError:
        raise UsageError(f"step must be an integer, got {type(step).__name__} {step!r}") from None


def _as_key(key: Any) -> str:
    if not isinstance(key, str) or key == "step":
        raise UsageError(f"metric names must be strings other than 'step', got {key!r}")
    return key


def _as_number(key: str, value: Any) -> Number:
    """Turn a tensor, NumPy scalar or bool into a plain int or float JSON and CSV can hold."""
    if not isinstance(value, (int, float)) and hasattr(value, "item"):
        try:
            value = value.item()
        except (RuntimeError, ValueError):
            shape = tuple(getattr(value, "shape", ()))
            raise UsageError(f"metric {key!r} must be a single number, got shape {shape}") from None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    raise UsageError(f"metric {key!r} must be a number, got {type(value).__name__} {value!r}")


def _json_line(row: Mapping[str, Any]) -> str:
    return json.dumps(row) + "\n"


def _rewrite(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of an earlier run; lines that do not parse (a crash mid-write) are skipped, loudly."""
    rows, bad = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        else:
            bad += 1
    if bad:
        warn(f"{path}: skipped {bad} unreadable line(s) while resuming")
    return rows


def _summary_writer(log_dir: Path, purge_step: int | None = None) -> Any:
    """A TensorBoard SummaryWriter, or None (with one warning) when TensorBoard cannot load."""
    global _TB_WARNED
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception as exc:  # ImportError, or a broken protobuf/tensorboard install
        if not _TB_WARNED:
            _TB_WARNED = True
            warn(
                f"TensorBoard logging is off ({exc}); install it with "
                "`pip install tensorboard` or `pip install ddpkit[train]`"
            )
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


__all__ = ["MetricsLogger", "as_floats"]
