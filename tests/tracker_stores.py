"""Read back what each tracker stored, through its own API or files, for the tracker tests.

- MLflow: ``MlflowClient.search_runs`` and ``get_metric_history``.
- W&B offline: the ``run-<id>.wandb`` files, records in W&B's log format (LevelDB's log layout with
  a ``:W&B`` header), each a ``wandb.proto.wandb_internal_pb2.Record``.
- TensorBoard: its ``EventAccumulator``, which applies ``purge_step``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK = 32768
_HEADER = 7


def mlflow_runs(out: Path) -> list[dict]:
    """Every MLflow run of ``out/mlflow.db``: id, name, status, params and each metric's history."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    runs = []
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id]):
            history = {
                key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
                for key in run.data.metrics
            }
            runs.append(
                {
                    "id": run.info.run_id,
                    "name": run.info.run_name,
                    "status": run.info.status,
                    "params": dict(run.data.params),
                    "history": history,
                }
            )
    return runs


def _wandb_records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B log"
    records, chunks, offset = [], [], _HEADER
    while offset + _HEADER <= len(data):
        left = _BLOCK - offset % _BLOCK
        if left < _HEADER:  # the block's tail is padding
            offset += left
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + _HEADER])
        if kind == 0 and length == 0:
            offset += left
            continue
        body = data[offset + _HEADER : offset + _HEADER + length]
        offset += _HEADER + length
        if kind == 1:  # FULL
            records.append(body)
        elif kind == 2:  # FIRST
            chunks = [body]
        elif kind == 3:  # MIDDLE
            chunks.append(body)
        elif kind == 4:  # LAST
            records.append(b"".join(chunks + [body]))
    return records


def wandb_runs(out: Path) -> list[dict]:
    """Every offline W&B run directory under ``out/wandb``: its run id and history rows, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for path in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        run_id, rows, exited = None, [], False
        for raw in _wandb_records(path):
            record = pb.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "exit":
                exited = True
            if kind == "run":
                run_id = record.run.run_id
            elif kind == "history":
                row = {}
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    row[key] = json.loads(item.value_json)
                rows.append(row)
        runs.append({"id": run_id, "dir": path.parent.name, "rows": rows, "exited": exited})
    return runs


def wandb_runs_settled(out: Path, timeout: float = 30.0) -> list[dict]:
    """:func:`wandb_runs` once W&B's service has written them: in this process, ``finish`` can
    return before the service's writer has flushed the run file (it writes every
    ``WANDB_FLUSH_S``; on a loaded machine later), so read until every run file holds its exit
    record, for at most ``timeout`` seconds. A process that exits waits for the service itself;
    tests of finished subprocesses read :func:`wandb_runs` at once."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        runs = wandb_runs(out)
        if runs and all(run["exited"] for run in runs) or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


def wandb_history(runs: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of ``key`` over the runs' rows, in the order they were written."""
    return [(row["_step"], row[key]) for run in runs for row in run["rows"] if key in row]


def tensorboard_history(out: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of scalar ``key`` as TensorBoard shows it (purged steps gone)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(event.step, event.value) for event in acc.Scalars(key)]
