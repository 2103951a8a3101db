"""The hang watchdog: who is to blame (pure logic), the runtime's heartbeats, and real hangs."""

from __future__ import annotations

import re
import textwrap
import time

import pytest
import torch

import ddpkit
from ddpkit import cli
from ddpkit.observe.heartbeats import (
    CLOSED,
    EXIT_HANG,
    Heartbeat,
    culprit,
    format_report,
    job_is_hung,
    phase_order,
    seconds_until_hung,
)
from ddpkit.recipes import train as train_recipe
from ddpkit.recipes.config import TrainConfig, validate
from helpers import ddpkit as ddpkit_cli
from helpers import python

NOW = 1_000_000.0
SILENT = 5.0


def beat(rank: int, step: int, phase: str, idle: float = 12.0, *, age: float = 0.5) -> Heartbeat:
    """A heartbeat published ``age`` seconds before NOW by a rank idle for ``idle`` seconds then."""
    return Heartbeat(rank, step, phase, idle, NOW - age, host="node", pid=100 + rank, where=f"f{rank} (x.py:1)")


# -- pure logic: rank, world and heartbeats as plain data ---------------------------------


def test_culprit_is_the_rank_with_the_lowest_step():
    beats = {0: beat(0, 7, "data"), 1: beat(1, 6, "optimizer"), 2: beat(2, 7, "backward")}
    assert culprit(beats, NOW, silent_after=SILENT) == 1


def test_on_equal_steps_the_earliest_phase_is_behind():
    # Rank 1 sleeps after taking its batch; rank 0 went on into backward's all-reduce.
    beats = {0: beat(0, 5, "backward"), 1: beat(1, 5, "data")}
    assert culprit(beats, NOW, silent_after=SILENT) == 1
    # Evaluation and saving happen after the optimizer step that raised global_step.
    beats = {0: beat(0, 5, "backward"), 1: beat(1, 5, "eval"), 2: beat(2, 5, "data")}
    assert culprit(beats, NOW, silent_after=SILENT) == 1
    assert phase_order("my-own-phase") == phase_order("eval")


def test_on_equal_place_the_rank_that_stopped_first_then_the_lowest():
    beats = {0: beat(0, 5, "save", idle=11.0), 1: beat(1, 5, "save", idle=14.0), 2: beat(2, 5, "save", idle=12.0)}
    assert culprit(beats, NOW, silent_after=SILENT) == 1
    beats = {2: beat(2, 5, "save"), 1: beat(1, 5, "save")}
    assert culprit(beats, NOW, silent_after=SILENT) == 1


def test_a_silent_or_missing_heartbeat_is_blamed_before_any_live_rank():
    # Rank 2's watchdog stopped publishing (frozen process): blamed though it is ahead.
    beats = {0: beat(0, 3, "data"), 1: beat(1, 4, "backward"), 2: beat(2, 9, "backward", age=30.0)}
    assert culprit(beats, NOW, silent_after=SILENT) == 2
    beats = {0: beat(0, 3, "data"), 1: None, 2: beat(2, 9, "backward", age=30.0)}
    assert culprit(beats, NOW, silent_after=SILENT) == 2  # silent first, then missing
    assert culprit({0: beat(0, 3, "data"), 1: None}, NOW, silent_after=SILENT) == 1


def test_a_closed_rank_is_never_blamed():
    beats = {0: beat(0, 2, CLOSED), 1: beat(1, 9, "backward")}
    assert culprit(beats, NOW, silent_after=SILENT) == 1


def test_the_job_is_hung_only_when_no_open_rank_made_progress():
    stalled = {0: beat(0, 5, "backward", idle=10.5), 1: beat(1, 5, "data", idle=11.0)}
    assert job_is_hung(stalled, NOW, hang_timeout=10.0)
    # Rank 1 still beats (say its long evaluation): rank 0 waiting for it is no hang.
    alive = {0: beat(0, 5, "backward", idle=30.0), 1: beat(1, 5, "eval", idle=2.0)}
    assert not job_is_hung(alive, NOW, hang_timeout=10.0)
    assert seconds_until_hung(alive, NOW, hang_timeout=10.0) == pytest.approx(7.5)  # 10 - (2 + 0.5)
    # Publishing stopped 9 s ago: idle grows on.
    assert job_is_hung({0: beat(0, 1, "data", idle=2.0, age=9.0)}, NOW, hang_timeout=10.0)
    assert job_is_hung({0: beat(0, 5, "backward", idle=10.5), 1: None}, NOW, hang_timeout=10.0)
    assert job_is_hung({0: beat(0, 5, "backward", idle=10.5), 1: beat(1, 5, CLOSED, idle=0.0)}, NOW, 10.0)
    assert not job_is_hung({0: beat(0, 5, CLOSED, idle=99.0)}, NOW, hang_timeout=10.0)


def test_report_names_the_stuck_rank_and_where_the_others_are():
    beats = {r: beat(r, 5, "backward") for r in range(8)}
    beats[1] = beat(1, 5, "data", idle=12.3)
    beats[6] = None
    text = format_report(beats, 1, NOW, world_size=8, silent_after=SILENT)
    first = text.splitlines()[0]
    assert first.startswith("ddpkit watchdog: rank 1 made no progress for 12.8s at step 5 (phase data) in f1 (x.py:1)")
    assert "ranks 0, 2-5, 7 are at step 5 (backward)" in first and "rank 6 sent no heartbeat" in first
    assert f"exiting with code {EXIT_HANG}" in text
    rows = text.splitlines()[2:]
    assert rows[0] == "  rank 1: step 5, phase data, idle 12.8s, node pid 101, in f1 (x.py:1)  <- stuck"
    assert "  rank 6: no heartbeat" in rows and len(rows) == 8


def test_report_of_a_rank_alone_says_its_peers_are_unknown():
    text = format_report(
        {3: beat(3, 2, "save", age=20.0)}, 3, NOW, world_size=4, silent_after=SILENT, note="store unreachable: refused"
    )
    assert "its heartbeat stopped 20.0s ago" in text
    assert "the other 3 rank(s) are unknown (store unreachable: refused)" in text


def test_heartbeat_round_trips_through_json():
    one = beat(3, 7, "eval")
    assert Heartbeat.from_json(one.to_json().encode()) == one
    assert one.idle_at(NOW + 2.0) == pytest.approx(14.5)


# -- settings and the runtime -------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "10"])
def test_a_bad_hang_timeout_is_a_usage_error(bad):
    with pytest.raises(ddpkit.UsageError, match="hang_timeout must be a number of seconds >= 0"):
        ddpkit.init(hang_timeout=bad)
    assert ddpkit.current() is None


def test_runtime_heartbeats_reach_the_watchdog():
    rt = ddpkit.init(hang_timeout=3600)
    assert (
        rt._settings.hang_timeout == 3600
        and rt._reporter.watchdog is not None
        and rt._reporter.watchdog._thread.is_alive()
    )
    rt.global_step = 4
    rt.heartbeat("eval")
    assert rt._reporter.watchdog._last[:2] == (4, "eval")
    thread = rt._reporter.watchdog._thread
    rt.close()
    assert not thread.is_alive() and rt._reporter.watchdog is None


def test_setup_and_each_evaluation_batch_count_as_progress():
    rt = ddpkit.init(seed=0, hang_timeout=3600)
    dog = rt._reporter.watchdog
    dog.beat(0, "data")
    before = dog._last[2]
    model = rt.setup(torch.nn.Linear(4, 3))
    assert dog._last[1] == "start" and dog._last[2] > before
    rt.global_step = 7
    seen = []
    real_beat = dog.beat
    dog.beat = lambda step, phase: (seen.append((step, phase)), real_beat(step, phase))
    data = torch.utils.data.TensorDataset(torch.randn(10, 4), torch.randint(0, 3, (10,)))
    ddpkit.evaluate(model, data, num_classes=3, batch_size=4)
    assert seen == [(7, "eval")] * 3  # one beat per batch, at the current step
    ddpkit.predict(model, data, batch_size=5)
    assert seen[3:] == [(7, "eval")] * 2
    rt.close()
    seen.clear()
    ddpkit.evaluate(model, data, num_classes=3)  # no watchdog any more: nothing to tell
    assert seen == []


def test_without_hang_timeout_heartbeat_does_nothing():
    rt = ddpkit.init()
    assert rt._reporter.watchdog is None
    rt.heartbeat("eval")


def test_train_flag_reaches_ddpkit_init(monkeypatch, tmp_path):
    config = cli.train.train_config(["--hang-timeout", "2.5", "--out", str(tmp_path / "run")])
    assert config.hang_timeout == 2.5
    assert TrainConfig.from_json(config.to_json()).hang_timeout == 2.5
    validate(TrainConfig(hang_timeout=0.0, out_dir=str(tmp_path / "run")))  # 0: the watchdog off
    with pytest.raises(ddpkit.UsageError, match="--hang-timeout must be a number of seconds >= 0"):
        validate(TrainConfig(hang_timeout=-1.0, out_dir=str(tmp_path / "run")))

    seen = {}

    class Stop(Exception):
        pass

    def fake_init(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(ddpkit, "init", fake_init)
    with pytest.raises(Stop):
        train_recipe.train(config)
    assert seen["hang_timeout"] == 2.5


# -- real hangs ---------------------------------------------------------------------------

SCRIPT = textwrap.dedent('''
    """Rank 1 sleeps forever at step 5 unless --healthy; every step may sleep a little."""
    import sys
    import time

    import torch
    import torch._dynamo     # DDP imports it on first use: seconds on a busy machine, before the clock
    import torch.nn.functional as F

    import ddpkit


    def sleep_forever():
        time.sleep(10**6)


    hang_timeout, pause = float(sys.argv[1]), float(sys.argv[2])
    rt = ddpkit.init(seed=0, hang_timeout=hang_timeout)
    data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randint(0, 2, (256,)))
    model = rt.setup(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = rt.loader(data, global_batch_size=8)
    for epoch in rt.epochs(1):
        for inputs, targets in loader:
            if rt.rank == 1 and rt.global_step == 5 and "--healthy" not in sys.argv:
                sleep_forever()
            time.sleep(pause)
            rt.backward(F.cross_entropy(model(inputs), targets))
            rt.step(optimizer)
    rt.print(f"finished {rt.global_step} steps")
''')


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "hang.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.slow  # 10-16 s: make test-slow keeps make test under 15 minutes
@pytest.mark.timeout(90)
def test_a_rank_sleeping_forever_is_named_and_the_job_fails_fast(script):
    started = time.monotonic()
    result = ddpkit_cli("run", "-n", "2", str(script), "10", "0", timeout=80)
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "ddpkit watchdog: rank 1 made no progress for" in output, output[-3000:]
    stall = float(re.search(r"rank 1 made no progress for ([\d.]+)s", output).group(1))
    assert 10 <= stall < 16, output[-3000:]  # caught soon after hang_timeout, not later
    assert elapsed < 70, f"took {elapsed:.1f}s\n{output[-3000:]}"  # far below the 600 s collective timeout
    assert re.search(r"rank 1 made no progress for [\d.]+s at step 5 \(phase data\)", output)
    assert "rank 0 is at step 5 (backward)" in output
    assert "Python stack of rank 1" in output
    assert re.search(r'File ".*hang\.py", line \d+ in sleep_forever', output)  # faulthandler's stack
    assert output.count("ddpkit watchdog: the job is hung") == 1  # one report
    assert f"rank 1 failed first (exit code {EXIT_HANG})" in result.stderr  # the stuck rank exits first


@pytest.mark.slow  # 19 s
@pytest.mark.timeout(90)
def test_a_healthy_run_longer_than_hang_timeout_finishes(script):
    # 32 steps of at least 0.35 s each: over 11 s of training, beyond an 8 s hang_timeout.
    result = ddpkit_cli("run", "-n", "2", str(script), "8", "0.35", "--healthy", timeout=80)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finished 32 steps" in result.stdout
    assert "ddpkit watchdog" not in result.stdout + result.stderr


@pytest.mark.timeout(60)
def test_a_world_of_one_watches_its_own_main_thread(tmp_path):
    path = tmp_path / "alone.py"
    path.write_text(
        textwrap.dedent("""
        import time
        import ddpkit

        def wait_for_nothing():
            time.sleep(10**6)

        rt = ddpkit.init(hang_timeout=1)
        rt.heartbeat("eval")
        wait_for_nothing()
    """)
    )
    result = python(str(path), timeout=50)
    assert result.returncode == EXIT_HANG, result.stderr[-3000:]
    assert "rank 0 made no progress for" in result.stderr and "at step 0 (phase eval)" in result.stderr
    assert re.search(r'File ".*alone\.py", line \d+ in wait_for_nothing', result.stderr)


def test_the_watching_thread_takes_the_ranks_cuda_device_before_it_reads_anything(monkeypatch):
    """A new thread's CUDA device is GPU 0: the flight recorder's dump (it queries CUDA events) from the
    watchdog's thread made a context on GPU 0 for every rank, hundreds of MB each."""
    import torch

    from ddpkit.observe.watchdog import Watchdog

    taken = []
    monkeypatch.setattr(torch.cuda, "set_device", taken.append)
    dog = Watchdog(None, rank=1, world_size=2, device=torch.device("cuda", 1))
    dog._stop.set()  # one pass of the thread's body: the device first, then nothing to watch
    dog._run()
    assert taken == [torch.device("cuda", 1)]
    taken.clear()
    on_the_host = Watchdog(None, rank=1, world_size=2, device=torch.device("cpu"))
    on_the_host._stop.set()
    on_the_host._run()
    assert taken == []
