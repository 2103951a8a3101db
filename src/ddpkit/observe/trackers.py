"""Experiment trackers: Weights & Biases, MLflow and TensorBoard, one run however often it stops.

``ddpkit.init(trackers=("tensorboard", "wandb", "mlflow"))`` sends every row of ``rt.log`` to
each tracker named, from global rank 0 only, through the tracker's own library. What makes it one
experiment across crashes, ``--max-restarts``, SLURM requeues and ``--resume``:

- **One run.** Each tracker's run id is saved in every checkpoint. A run that loads a checkpoint
  continues those runs (W&B ``resume="allow"`` with the saved id, MLflow ``start_run(run_id)``);
  it never opens a second one.
- **Every step once.** W&B and MLflow cannot take back a value once sent (W&B refuses steps below
  its last; MLflow keeps both values of a step). So, in a run that checkpoints, ddpkit sends them
  a row only once a checkpoint that covers its step is on disk, and the rest when the run ends.
  A crash loses no row they hold, and the resumed attempt sends the steps after the checkpoint
  for the first time. The rows of the checkpoint's own step wait for the next checkpoint (a row
  logged after ``rt.checkpoint`` in the same step joins them): the checkpoint holds them, so the
  attempt that resumes from it sends them. W&B gets each step as one committed row, and writes
  its run file every :data:`WANDB_FLUSH_S` seconds (W&B's ``x_transaction_log_flush_interval``,
  15 s by default; ddpkit sets this unless ``WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL`` does): rows
  sent less than that before a host dies can be missing from W&B. Their charts run up to one
  checkpoint behind ``metrics.jsonl`` and TensorBoard. A run with no ``checkpoint_dir`` sends rows
  at once until its first ``rt.save``.
- TensorBoard and ddpkit's ``metrics.jsonl``/``metrics.csv`` are written at once and rewound on
  resume (TensorBoard's ``purge_step``; the JSONL and CSV drop the rows after the checkpoint).

A tracker that is unknown, not installed, or cannot start (an MLflow URI that does not open, W&B
online without credentials) is refused in one line at ``init`` (:func:`problem`). One that fails
later warns once and is left out; the local files still hold everything.

Example:
    >>> names("wandb,mlflow")
    ('wandb', 'mlflow')
    >>> names(())
    ()
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ddpkit.errors import one_line, warn
from ddpkit.observe.tracker_setup import DEFAULT, NAMES, REMOTE, _quiet_mlflow, mlflow_uri, names, problem, run_config

WANDB_FLUSH_S = 0.5
"""How often W&B writes a run's rows to its run file (W&B's own default is 15 s, and a process
killed in between loses them)."""
PROJECT = "ddpkit"
"""The W&B project and MLflow experiment, unless ``WANDB_PROJECT``/``MLFLOW_EXPERIMENT_NAME`` say another."""


class Remote:
    """The W&B and MLflow runs of one experiment, on global rank 0 (see the module's text).

    Args:
        chosen: the trackers named in ``init`` (only those in :data:`REMOTE` are handled here).
        out_dir: where W&B's files and the default MLflow store go.
        run_name: the run's display name in both trackers.
        config: the run's params (:func:`run_config`).
        deferred: hold rows until a checkpoint covers them (a run with a ``checkpoint_dir``).
    """

    def __init__(
        self,
        chosen: Sequence[str],
        out_dir: str | os.PathLike,
        *,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        deferred: bool = False,
    ) -> None:
        self.chosen = tuple(name for name in chosen if name in REMOTE)
        self.out_dir = Path(out_dir)
        self.run_name = run_name
        self.config = dict(config or {})
        self.deferred = deferred
        self.ids: dict[str, str] = {}  # tracker -> its run id, once known
        self.resumed = False
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.RLock()  # the checkpoint writer's thread sends rows too (saved)
        self._open: dict[str, Any] = {}  # tracker -> its run (W&B) or client (MLflow)
        self._failed: set[str] = set()
        self._closed = False
        self.outcome: Any = lambda: "FINISHED"
        """Called at exit for how the run ended (the runtime sets it: ``"FAILED"`` after an uncaught exception)."""
        if "wandb" in self.chosen:
            self.ids["wandb"] = uuid.uuid4().hex[:12]  # chosen now: checkpoints hold it from the start

    @property
    def active(self) -> bool:
        """Whether any W&B or MLflow tracker is named."""
        return bool(self.chosen)

    # -- rows --------------------------------------------------------------------------
    def log(self, row: Mapping[str, Any]) -> None:
        """Queue ``row`` (``step`` and metrics); sent now unless the run defers to its checkpoints."""
        if not self.active:
            return
        with self._lock:
            self._pending.append(dict(row))
            if not self.deferred:
                self._send(lambda row: True)

    def saving(self) -> None:
        """A checkpoint is being written in the background: rows wait for checkpoints from now on."""
        with self._lock:
            self.deferred = True

    def saved(self, step: int) -> None:
        """A checkpoint of ``step`` is on disk: send every row before it, and defer from now on.

        The rows of ``step`` itself wait (the checkpoint holds them, :meth:`state_dict`): a row
        logged after the save in the same step still joins them, and each step goes out whole.
        Called on the checkpoint writer's thread for a background save, as soon as the file is in
        place, so a kill after that loses no row the checkpoint does not hold."""
        if not self.active:
            return
        with self._lock:
            self.deferred = True
            self._send(lambda row: row["step"] < step)

    def state_dict(self, step: int) -> dict[str, Any]:
        """What a checkpoint of ``step`` keeps: the run ids (opening the runs whose id only the
        tracker can give, MLflow) and, under ``"rows"``, the queued rows of ``step``, which the
        trackers get only after the save (:meth:`saved`)."""
        if not self.active:
            return {}
        with self._lock:
            for name in self.chosen:
                if name not in self._failed:
                    self._opened(name)
            return {**self.ids, "rows": [dict(row) for row in self._pending if row["step"] == step]}

    def load_state_dict(self, state: Mapping[str, Any] | None, step: int) -> None:
        """Continue the runs of a loaded checkpoint at ``step``: later queued rows belong to undone
        work, and the checkpoint's own rows of ``step`` are queued again unless this process still
        holds them."""
        self.resumed = True
        state = dict(state or {})
        held = state.pop("rows", None) or []
        with self._lock:
            self._pending = [row for row in self._pending if row["step"] <= step]
            if not any(row["step"] == step for row in self._pending):
                self._pending += [dict(row) for row in held if row.get("step") == step]
        for name, run_id in state.items():
            if name not in self.chosen:
                continue
            if name in self._open and self.ids.get(name) != run_id:
                warn(
                    f"tracker {name!r}: a run was opened before the checkpoint was loaded; "
                    "load before the first save to continue the checkpoint's run"
                )
                continue
            self.ids[name] = str(run_id)

    def close(self, outcome: str = "FINISHED") -> None:
        """End the runs: W&B ``finish``, MLflow's status ``outcome``.

        ``"FINISHED"`` (the script ended) sends every queued row first. ``"FAILED"`` (an uncaught
        exception) and ``"KILLED"`` (preempted) keep the queued rows back in a run that defers:
        the attempt that resumes from the last checkpoint sends that checkpoint's rows and logs
        the later steps again.
        """
        if not self.active or self._closed:
            return
        self._closed = True
        with self._lock:
            if outcome == "FINISHED" or not self.deferred:
                self._send(lambda row: True)
        for name in list(self._open):
            self._call(name, self._finish, name, outcome)
        self._open.clear()

    # -- the trackers -------------------------------------------------------------------
    def _send(self, due: Any) -> None:
        ready = [row for row in self._pending if due(row)]
        if not ready:
            return
        self._pending = [row for row in self._pending if not due(row)]
        for name in self.chosen:
            if name not in self._failed:
                self._call(name, self._write, name, ready)

    def _call(self, name: str, fn: Any, *args: Any) -> None:
        """Call ``fn``; a failure warns once, and the tracker is left out for the rest of the run."""
        try:
            fn(*args)
        except Exception as exc:
            self._failed.add(name)
            self._open.pop(name, None)
            warn(
                f"tracker {name!r} failed ({one_line(str(exc), 160)}); it gets no more rows in this run, "
                "metrics.jsonl and metrics.csv still hold every row"
            )

    def _opened(self, name: str) -> Any:
        if name not in self._open:
            try:
                self._open[name] = self._start_wandb() if name == "wandb" else self._start_mlflow()
            except Exception as exc:
                self._failed.add(name)
                warn(
                    f"tracker {name!r} could not start ({one_line(str(exc), 160)}); "
                    "metrics.jsonl and metrics.csv hold every row"
                )
                return None
        return self._open[name]

    def _start_wandb(self) -> Any:
        import atexit

        import wandb

        self.out_dir.mkdir(parents=True, exist_ok=True)
        settings = {}
        if "WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL" not in os.environ:
            settings["x_transaction_log_flush_interval"] = WANDB_FLUSH_S
        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            id=self.ids["wandb"],
            resume="allow",
            name=self.run_name,
            dir=str(self.out_dir),
            config=self.config,
            allow_val_change=True,
            reinit="create_new",
            mode=os.environ.get("WANDB_MODE") or None,
            settings=wandb.Settings(**settings) if settings else None,
        )
        # wandb tears its service down at exit; registered after its hook, this ends our run first
        atexit.register(lambda: self.close(self.outcome()))
        return run

    def _start_mlflow(self) -> Any:
        from mlflow.tracking import MlflowClient

        _quiet_mlflow()
        client = MlflowClient(tracking_uri=mlflow_uri(self.out_dir))
        run_id = self.ids.get("mlflow")
        if run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
            found = client.get_experiment_by_name(name)
            experiment = found.experiment_id if found is not None else client.create_experiment(name)
            run_id = client.create_run(experiment, run_name=self.run_name).info.run_id
            self.ids["mlflow"] = run_id
        else:
            client.update_run(run_id, status="RUNNING")
        self._mlflow_params(client, run_id)
        return client

    def _mlflow_params(self, client: Any, run_id: str) -> None:
        """Log the params a resumed run does not hold yet; MLflow's params cannot change once set."""
        from mlflow.entities import Param

        held = client.get_run(run_id).data.params
        changed = [k for k, v in self.config.items() if k in held and held[k] != _param(v)]
        if changed:
            warn(
                f"tracker 'mlflow': params {', '.join(changed[:5])} differ from the run's first attempt; "
                "MLflow keeps the first values"
            )
        params = [Param(k, _param(v)) for k, v in self.config.items() if k not in held]
        for start in range(0, len(params), 100):
            client.log_batch(run_id, params=params[start : start + 100])

    def _write(self, name: str, rows: list[dict[str, Any]]) -> None:
        handle = self._opened(name)
        if handle is None:
            return
        if name == "wandb":
            # one W&B row a step; a deferred run commits each at once (every row of a step before
            # the checkpoint's is queued by then), so a process killed later cannot lose it
            merged: dict[int, dict[str, Any]] = {}
            for row in rows:
                merged.setdefault(row["step"], {}).update((k, v) for k, v in row.items() if k != "step")
            for step, values in merged.items():
                handle.log(values, step=step, commit=True if self.deferred else None)
        else:
            import time

            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            metrics = [Metric(k, float(v), now, row["step"]) for row in rows for k, v in row.items() if k != "step"]
            for start in range(0, len(metrics), 1000):
                handle.log_batch(self.ids["mlflow"], metrics=metrics[start : start + 1000])

    def _finish(self, name: str, outcome: str) -> None:
        handle = self._open[name]
        if name == "wandb":
            handle.finish(exit_code=0 if outcome == "FINISHED" else 1)
        else:
            handle.set_terminated(self.ids["mlflow"], status=outcome)


def _param(value: Any) -> str:
    return str(value)[:6000]


__all__ = ["DEFAULT", "NAMES", "REMOTE", "WANDB_FLUSH_S", "Remote", "mlflow_uri", "names", "problem", "run_config"]
