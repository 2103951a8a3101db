"""MetricsLogger's files and Progress's silence."""

from __future__ import annotations

import csv
import io
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

from ddpkit._files import atomic_path
from ddpkit.errors import UsageError
from ddpkit.observe import metrics as tracking
from ddpkit.observe.metrics import MetricsLogger
from ddpkit.observe.progress import Progress

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _csv(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


def test_rows_reach_jsonl_and_csv(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log({"train_loss": torch.tensor(0.75), "lr": 0.1}, step=1)
        log.log({"train_loss": 0.5, "lr": 0.05}, step=2)
    expected = [{"step": 1, "train_loss": 0.75, "lr": 0.1}, {"step": 2, "train_loss": 0.5, "lr": 0.05}]
    assert log.rows == expected
    assert _jsonl(tmp_path / "metrics.jsonl") == expected
    assert type(_jsonl(tmp_path / "metrics.jsonl")[0]["train_loss"]) is float
    header, rows = _csv(tmp_path / "metrics.csv")
    assert header == ["step", "train_loss", "lr"]
    assert [{k: float(v) for k, v in r.items()} for r in rows] == expected


def test_new_key_widens_csv_header_with_empty_earlier_cells(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log({"train_loss": 1.0}, step=1)
        log.log({"train_loss": 0.9}, step=2)
        log.log({"train_loss": 0.8, "test_loss": 0.85, "test_accuracy": 0.7}, step=3)
        log.log({"train_loss": 0.7}, step=4)
    header, rows = _csv(tmp_path / "metrics.csv")
    assert header == ["step", "train_loss", "test_loss", "test_accuracy"]
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"]
    assert rows[0]["test_loss"] == "" and rows[1]["test_accuracy"] == ""
    assert rows[2]["test_loss"] == "0.85" and rows[3]["test_loss"] == ""
    assert not list(tmp_path.glob(".*.tmp")), "atomic rewrite left a temp file behind"


def test_disabled_logger_writes_nothing(tmp_path):
    out = tmp_path / "run"
    with MetricsLogger(out, enabled=False) as log:
        log.log({"train_loss": 1.0}, step=1)
        assert log.plot_loss() is None
    assert log.rows == []
    assert not out.exists()


def test_tensorboard_event_file_is_written(tmp_path):
    with MetricsLogger(tmp_path) as log:
        log.log({"train_loss": 0.5}, step=1)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0


def test_missing_tensorboard_warns_once_and_logging_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now fails
    monkeypatch.setattr(tracking, "_TB_WARNED", False)
    with pytest.warns(UserWarning, match="TensorBoard"):
        first = MetricsLogger(tmp_path / "a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = MetricsLogger(tmp_path / "b")
    for log in (first, second):
        log.log({"train_loss": 0.5}, step=1)
        log.close()
        assert _jsonl(log.jsonl_path) == [{"step": 1, "train_loss": 0.5}]
        assert not (log.out_dir / "tensorboard").exists()


def test_plot_loss_writes_a_png(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        assert log.plot_loss() is None  # nothing logged yet
        for step in range(1, 6):
            log.log({"train_loss": 1.0 / step}, step=step)
        log.log({"test_loss": 0.4}, step=5)
        path = log.plot_loss()
    assert path == tmp_path / "loss.png"
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 5000


def test_plot_loss_none_without_loss_keys(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log({"lr": 0.1}, step=1)
        assert log.plot_loss() is None
    assert not (tmp_path / "loss.png").exists()


def test_resume_keeps_earlier_rows_and_fresh_start_truncates(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log({"train_loss": 1.0}, step=1)
    with MetricsLogger(tmp_path, tensorboard=False, resume=True) as log:
        assert log.rows == [{"step": 1, "train_loss": 1.0}]
        log.log({"train_loss": 0.5, "test_loss": 0.6}, step=2)
    assert [r["step"] for r in _jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    header, rows = _csv(tmp_path / "metrics.csv")
    assert header == ["step", "train_loss", "test_loss"] and len(rows) == 2
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        assert log.rows == []
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert _csv(tmp_path / "metrics.csv") == (["step"], [])


def test_resume_drops_a_torn_last_line_with_a_warning(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train_loss": 1.0}\n{"step": 2, "tra')
    with pytest.warns(UserWarning, match="1 unreadable"):
        log = MetricsLogger(tmp_path, tensorboard=False, resume=True)
    log.log({"train_loss": 0.5}, step=2)
    log.close()
    assert _jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "train_loss": 1.0}, {"step": 2, "train_loss": 0.5}]


@pytest.mark.parametrize(
    "metrics, step",
    [
        ({"loss": "high"}, 1),
        ({"loss": torch.ones(2)}, 1),
        ({"step": 1.0}, 1),
        ({"loss": 1.0}, 1.5),
    ],
)
def test_bad_values_are_usage_errors(tmp_path, metrics, step):
    with MetricsLogger(tmp_path, tensorboard=False) as log, pytest.raises(UsageError):
        log.log(metrics, step=step)


def test_log_after_close_is_a_usage_error(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    log.close()
    log.close()
    with pytest.raises(UsageError, match="closed"):
        log.log({"loss": 1.0}, step=1)


def test_atomic_path_keeps_old_file_on_failure(tmp_path):
    target = tmp_path / "report.md"
    target.write_text("good")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("garb")
        raise RuntimeError("render failed")
    assert target.read_text() == "good"
    assert list(tmp_path.iterdir()) == [target]


def test_atomic_path_writes_a_file_with_the_modes_of_any_new_file(tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        with atomic_path(tmp_path / "sub" / "summary.json") as tmp:
            tmp.write_text("{}")
    finally:
        os.umask(old)
    made = tmp_path / "sub" / "summary.json"
    assert made.read_text() == "{}" and stat.S_IMODE(made.stat().st_mode) == 0o644  # not mkstemp's 0600
    assert sorted(p.name for p in made.parent.iterdir()) == ["summary.json"]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("enabled", [False, True])  # True: capfd's stderr is not a TTY
def test_progress_is_silent_when_disabled_or_not_a_tty(capfd, enabled):
    with Progress(10, enabled=enabled, desc="train") as bar:
        for _ in range(10):
            bar.update(1, loss=0.5)
        assert not bar.active
    assert capfd.readouterr() == ("", "")


def test_progress_draws_on_a_tty(monkeypatch):
    fake = _Tty()
    monkeypatch.setattr(sys, "stderr", fake)
    with Progress(4, enabled=True, desc="train", unit="samples") as bar:
        assert bar.active
        bar.update(2, loss=torch.tensor(0.25))
        bar.update(2, loss=0.125)
    text = fake.getvalue()
    assert "train" in text and "4/4" in text and "loss=0.125" in text
    monkeypatch.setattr(sys, "stderr", _Tty())
    with Progress(4, enabled=False) as bar:
        bar.update(4)
    assert sys.stderr.getvalue() == ""


def test_resume_drops_rows_a_crash_undid(tmp_path):
    from ddpkit.observe.metrics import MetricsLogger

    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in (10, 20, 30):
            logger.log({"loss": step / 10}, step=step)
    with MetricsLogger(tmp_path, tensorboard=False, resume=True, resume_step=20) as logger:
        assert [r["step"] for r in logger.rows] == [10, 20]
        logger.log({"loss": 2.5}, step=25)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [__import__("json").loads(line)["step"] for line in lines] == [10, 20, 25]
    assert (tmp_path / "metrics.csv").read_text().splitlines()[1:] == ["10,1.0", "20,2.0", "25,2.5"]


@pytest.mark.timeout(120)
def test_a_batchs_loss_logs_as_one_processs_mean_over_the_global_batch_on_two(tmp_path):
    """rt.log's mean of each rank's batch loss: on 2 processes a short last batch whose one sample is rank
    0's logged NaN (rank 1's mean of no sample), and batches split unevenly logged a mean of means. Each
    rank's value now weighs by its samples of the batch in hand: the rows are one process's (float64, to
    rounding); a value the same on every rank logs as it is; after the pass each rank counts the same."""
    import ddpkit
    import workers

    one = workers.logged_losses(str(tmp_path / "one"))
    two = ddpkit.launch(workers.logged_losses, nprocs=2, args=(str(tmp_path / "two"),))
    assert two[0]["returned"] == two[1]["returned"]  # every rank is handed the values written
    for a, b in zip(one["returned"][:-1], two[0]["returned"][:-1]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-12) and a["lr"] == b["lr"] == 0.1 / 3
    assert two[0]["returned"][-1] == {"rank": 0.5}
    assert [row["loss"] for row in two[0]["rows"] if "loss" in row] == [r["loss"] for r in two[0]["returned"][:-1]]
