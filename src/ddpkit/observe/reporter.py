"""What a person sees of a run while it trains: the metrics files, the trackers' rows, the hang watchdog.

``rt.log`` writes through :meth:`Reporter.write` (rank 0), ``rt.heartbeat`` and the loaders' probes
reach the watchdog through :meth:`Reporter.beat` and :meth:`Reporter.watch`, and ``rt.close`` ends
them all with :meth:`Reporter.close`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ddpkit.observe.metrics import MetricsLogger
from ddpkit.observe.watchdog import Watchdog


class Reporter:
    """The metrics logger (made at the first row), the trackers' runs and the watchdog of one run.

    Args:
        out_dir: where metrics go (None: nowhere).
        trackers: the trackers named to ``ddpkit.init`` (None: the default, TensorBoard where it loads).
        watchdog: the hang watchdog, or None.
    """

    def __init__(self, out_dir: Path | None, trackers: tuple[str, ...] | None, watchdog: Watchdog | None) -> None:
        self.out_dir, self.trackers, self.watchdog = out_dir, trackers, watchdog
        self.logger: MetricsLogger | None = None

    def write(self, values: Mapping[str, float], step: int, *, resumed: Any, tracking: Any) -> None:
        """Write one row at ``step`` (rank 0); ``resumed`` is the loop state's (source, step) of a resume.

        Rows after the step a run resumed from belong to work a crash undid; a fresh run (nothing
        loaded) starts its files anew.

        Args:
            values: the metrics by name.
            step: the optimizer step they belong to.
            resumed: the loop state's (checkpoint, step) of a resume, or (None, None).
            tracking: the run's trackers (W&B, MLflow), which get the row too, or None.
        """
        if self.out_dir is None:
            return
        if self.logger is None:
            source, resumed_step = resumed
            self.logger = MetricsLogger(
                self.out_dir,
                resume=source is not None,
                resume_step=resumed_step,
                tensorboard=self.trackers is None or "tensorboard" in self.trackers,
            )
        self.logger.log(dict(values), step=step)
        if tracking is not None:
            tracking.log({"step": step, **values})

    def beat(self, step: int, phase: str) -> None:
        """This rank made progress and is now in ``phase`` (nothing without a watchdog)."""
        if self.watchdog is not None:
            self.watchdog.beat(step, phase)

    def watch(self, probe: Callable[[], int]) -> None:
        """Count a rise of ``probe()`` (samples a loader's workers read) as progress."""
        if self.watchdog is not None:
            self.watchdog.add_probe(probe)

    def plot_loss(self) -> Path | None:
        """Draw ``out_dir``/loss.png from the logged losses (None where nothing was logged)."""
        return self.logger.plot_loss() if self.logger is not None else None

    def close(self, *, failed: bool = False) -> None:
        """Stop the watchdog and flush the metrics files; ``failed``: the script raised."""
        if self.watchdog is not None:
            self.watchdog.stop(failed=failed)
            self.watchdog = None
        if self.logger is not None:
            self.logger.close()


__all__ = ["Reporter"]
