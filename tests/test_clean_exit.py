"""Finished jobs exit 0, every time: workers end through ddpkit.entry, without interpreter teardown.

A gloo job that finished can abort at exit (SIGABRT, "terminate called without an active
exception") in torch's own teardown, a few runs in twenty on a loaded machine (BENCHMARKS.md).
The repeated runs below allow no failure; the others check that ending early keeps what
python's exit does: the exit status, atexit handlers, threads, files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import ddpkit
from helpers import clean_env, kill_tree, python
from helpers import ddpkit as ddpkit_cli

# What the script under test does at the end, by its first argument.
_ENDINGS = """
import atexit, json, sys, threading, time
print(json.dumps({"name": __name__, "argv": sys.argv[1:], "file": __file__, "path0": sys.path[0]}))
log = open(sys.argv[2], "w")
log.write("left open, never flushed\\n")
atexit.register(lambda: print("atexit handler ran", flush=True))
atexit.register(lambda: open(sys.argv[2] + ".atexit", "w").write("written at exit\\n"))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
ending = sys.argv[1]
if ending == "exit3":
    sys.exit(3)
if ending == "raise":
    raise ValueError("the script failed")
if ending == "text":
    raise SystemExit("a message instead of a code")
if ending == "usage":
    import ddpkit
    ddpkit.init()            # installs ddpkit's excepthook (importing ddpkit changes nothing)
    raise ddpkit.UsageError("one clear line")
"""


@pytest.fixture
def busy_core():
    """A process spinning on a core while the test runs, as another job would on a shared machine."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        yield proc
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=30)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(  # (exit3 and text: make test-slow; the other three cover each way out)
    "ending, code",
    [
        ("end", 0),
        pytest.param("exit3", 3, marks=pytest.mark.slow),
        ("raise", 1),
        pytest.param("text", 1, marks=pytest.mark.slow),
        ("usage", 2),
    ],
)
def test_entry_ends_a_script_as_python_does(tmp_path, ending, code):
    script = tmp_path / "endings.py"
    script.write_text(_ENDINGS)
    results = {}
    for how, prefix in (("python", []), ("entry", ["-m", "ddpkit.entry"])):
        log = tmp_path / f"{how}.log"
        result = python(*prefix, str(script), ending, str(log), timeout=90)
        first, *rest = result.stdout.splitlines()
        results[how] = (
            result.returncode,
            json.loads(first),
            sorted(rest),
            log.read_text(),
            (tmp_path / f"{how}.log.atexit").read_text(),
            _last_line(result.stderr),
        )
        assert result.returncode == code, result.stderr
    python_run, entry_run = results["python"], results["entry"]
    assert entry_run[1]["name"] == "__main__" and entry_run[1]["path0"] == str(tmp_path)
    assert entry_run[1]["file"] == python_run[1]["file"] == str(script)
    assert entry_run[1]["argv"][0] == python_run[1]["argv"][0] == ending
    if ending == "usage":
        # ddpkit's excepthook (errors.py) ends the process itself, under python too: what it
        # does not wait for (threads, files left open) must simply be the same under both.
        assert "atexit handler ran" in entry_run[2] and entry_run[4] == "written at exit\n"
        assert entry_run[3] == python_run[3]
    else:
        assert entry_run[2] == python_run[2] == ["atexit handler ran", "thread finished"]
        assert entry_run[3] == python_run[3] == "left open, never flushed\n"
        assert entry_run[4] == python_run[4] == "written at exit\n"
    assert entry_run[5] == python_run[5]  # the exception's last line, or the message


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip() and "Warning" not in line]
    return lines[-1] if lines else ""


@pytest.mark.timeout(120)
def test_entry_traceback_starts_in_the_script(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("def inner():\n    raise KeyError('deep')\n\ninner()\n")
    result = python("-m", "ddpkit.entry", str(script), timeout=90)
    assert result.returncode == 1
    frames = [line for line in result.stderr.splitlines() if line.lstrip().startswith("File ")]
    assert [f.split(",")[0].strip() for f in frames] == [f'File "{script}"'] * 2  # <module>, inner
    assert "KeyError: 'deep'" in result.stderr


@pytest.mark.timeout(120)
def test_entry_runs_a_module_with_its_arguments(tmp_path):
    (tmp_path / "endmod.py").write_text(_ENDINGS)
    log = tmp_path / "mod.log"
    result = python("-m", "ddpkit.entry", "-m", "endmod", "exit3", str(log), timeout=90, cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    info = json.loads(result.stdout.splitlines()[0])
    assert info["name"] == "__main__" and info["file"] == str(tmp_path / "endmod.py")
    assert info["argv"] == ["exit3", str(log)] and "atexit handler ran" in result.stdout
    assert log.read_text() == "left open, never flushed\n"


@pytest.mark.slow  # 10-16 s: make test-slow keeps make test under 15 minutes
@pytest.mark.timeout(180)
def test_ddpkit_run_keeps_exit_codes_and_exit_handlers(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(
        textwrap.dedent("""
        import atexit, sys
        import ddpkit
        rt = ddpkit.init()
        out = open(f"{sys.argv[1]}.rank{rt.rank}", "w")
        out.write("rank file\\n")
        # one write per line: the builtin print writes text and newline apart, so two ranks'
        # lines on one unbuffered pipe can interleave mid-line (CI saw exactly that)
        atexit.register(lambda: (sys.stdout.write(f"handler of rank {rt.rank}\\n"), sys.stdout.flush()))
        rt.barrier()
        if sys.argv[2] == "exit3" and rt.rank == 1:
            sys.exit(3)
        if sys.argv[2] == "raise" and rt.rank == 1:
            raise ValueError("rank 1 gives up")
        if sys.argv[2] == "raise" and rt.rank == 0:
            raise ddpkit.UsageError("give --lr a number")
    """)
    )
    ok = ddpkit_cli("run", "-n", "2", str(script), str(tmp_path / "ok"), "end", timeout=150)
    assert ok.returncode == 0, ok.stderr
    assert sorted(line for line in ok.stdout.splitlines() if "handler" in line) == [
        "handler of rank 0",
        "handler of rank 1",
    ]
    assert [(tmp_path / f"ok.rank{r}").read_text() for r in (0, 1)] == ["rank file\n"] * 2
    exit3 = ddpkit_cli("run", "-n", "2", str(script), str(tmp_path / "e3"), "exit3", timeout=150)
    assert exit3.returncode == 1 and "rank 1 failed first (exit code 3)" in exit3.stderr, exit3.stderr
    raised = ddpkit_cli("run", "-n", "2", str(script), str(tmp_path / "rs"), "raise", timeout=150)
    # Both ranks fail at once: 1 when the agent sees rank 1's ValueError exit; 2 when it stops rank 1
    # (SIGTERM) before that exit, so rank 0's usage error is the only one it saw (CI saw both).
    assert raised.returncode in (1, 2) and "failed first (exit code " in raised.stderr, raised.stderr
    assert "ValueError: rank 1 gives up" in raised.stderr
    # torch's init_process_group buffers stderr around the excepthook; ddpkit's one line gets out anyway
    assert "[rank0]: ddpkit: error: give --lr a number" in raised.stderr


def note_at_exit(directory: str) -> int:
    """A child of ddpkit.launch that registers an exit handler writing a file (module level: spawn)."""
    import atexit
    from pathlib import Path

    rt = ddpkit.init()
    atexit.register(lambda rank=rt.rank: (Path(directory) / f"rank{rank}.atexit").write_text("done"))
    rt.barrier()
    return rt.rank


def return_a_lock():
    import threading

    return threading.Lock()


@pytest.mark.timeout(120)
def test_launch_children_run_exit_handlers_before_launch_returns(tmp_path):
    results = ddpkit.launch(note_at_exit, nprocs=2, args=(str(tmp_path),))
    assert results == {0: 0, 1: 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.atexit", "rank1.atexit"]


@pytest.mark.timeout(120)
def test_launch_refuses_a_return_value_that_cannot_travel_back():
    with pytest.raises(ddpkit.LaunchError, match="cannot be sent back to the parent process"):
        ddpkit.launch(return_a_lock, nprocs=2)


TRAIN = """
import torch
import ddpkit

rt = ddpkit.init(seed=0)
model = torch.nn.Linear(8, 2)
data = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randint(0, 2, (96,)))
model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for features, labels in rt.loader(data, global_batch_size=24):
    loss = torch.nn.functional.cross_entropy(model(features), labels)
    rt.backward(loss)
    rt.step(optimizer)
rt.print("trained", rt.global_step)
"""


def _repeat_ddp_runs(tmp_path, runs: int) -> None:
    script = tmp_path / "tiny_ddp.py"
    script.write_text(TRAIN)
    failures = []
    for i in range(runs):
        result = ddpkit_cli("run", "-n", "3", str(script), timeout=240)
        if result.returncode != 0 or "trained 4" not in result.stdout:
            failures.append(f"run {i}: exit {result.returncode}\n{result.stderr[-1500:]}")
    assert failures == [], "\n\n".join(failures)


def _repeat_bench_runs(tmp_path, runs: int) -> None:
    failures = []
    for i in range(runs):
        result = ddpkit_cli(
            "bench",
            "--model",
            "mlp",
            "--data",
            "synthetic",
            "--modes",
            "ddp",
            "--nproc",
            "2",
            "--batch",
            "8",
            "--steps",
            "4",
            "--warmup",
            "1",
            "--out",
            str(tmp_path / f"b{i}"),
            timeout=240,
        )
        if result.returncode != 0:
            failures.append(f"bench {i}: exit {result.returncode}\n{result.stderr[-1500:]}")
    assert failures == [], "\n\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_four_finished_ddp_jobs_exit_0_beside_a_busy_core(tmp_path, busy_core):
    """Issue 10 saw 3 aborts in 20 such runs. Four clean runs here (a 52% chance at that rate,
    down from 12 runs and 14% to keep CI under its time limit) and every multi-process test of the
    suite, each asserting exit 0, are what guard it now."""
    _repeat_ddp_runs(tmp_path, runs=4)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_finished_bench_runs_exit_0_beside_a_busy_core(tmp_path, busy_core):
    _repeat_bench_runs(tmp_path, runs=2)  # 4 before; the bench tests of the suite run many more


# -- no orphans: a launcher killed by any signal takes its workers with it ------------------------

STUCK = """
import os, sys, time
import torch, ddpkit

rt = ddpkit.init()
open(os.path.join(sys.argv[1], f"rank{rt.rank}.pid"), "w").write(str(os.getpid()))
if rt.rank == 0:
    rt.all_reduce(torch.ones(1))  # waits for rank 1, which never comes
time.sleep(3600)
"""


def _ended(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (its code no longer runs)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in status)
    except FileNotFoundError:
        return True


def _start(cmd: list[str]) -> subprocess.Popen:
    """A launcher in a session of its own, its output dropped (it is killed, not read)."""
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_env(), start_new_session=True
    )


def _kill_launcher_and_watch(launcher: subprocess.Popen, pid_dir, ranks: int) -> tuple[list[int], float]:
    import os
    import signal
    import time

    from helpers import wait_for

    try:
        wait_for(lambda: len(list(pid_dir.glob("rank*.pid"))) == ranks, timeout=180, what="the workers' pid files")
        time.sleep(1)  # rank 0 inside its all_reduce, rank 1 in its sleep
        pids = [int(p.read_text()) for p in sorted(pid_dir.glob("rank*.pid"))]
        os.kill(launcher.pid, signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 30
        while time.monotonic() < deadline and not all(_ended(p) for p in pids):
            time.sleep(0.1)
        return [p for p in pids if not _ended(p)], time.monotonic() - killed
    finally:
        for p in pid_dir.glob("rank*.pid"):
            kill_tree(int(p.read_text()))
        kill_tree(launcher.pid)
        launcher.wait(timeout=30)


@pytest.mark.timeout(240)
def test_workers_of_a_sigkilled_ddpkit_run_end_within_seconds(tmp_path):
    """ddpkit run SIGKILLed (the OOM killer, a scheduler): its workers, one blocked in a collective,
    one in its own code, end within seconds rather than staying orphaned."""
    from helpers import BIN

    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    launcher = _start([str(BIN / "ddpkit"), "run", "-n", "2", str(script), str(tmp_path)])
    left, seconds = _kill_launcher_and_watch(launcher, tmp_path, 2)
    assert left == [], f"workers {left} still ran {seconds:.0f} s after ddpkit run was killed"


LAUNCH_PARENT = """
import os, sys, time
import torch, ddpkit

def stuck(directory):
    import signal
    signal.signal(signal.SIGINT, lambda *_: None)  # a script that handles Ctrl-C itself
    rt = ddpkit.init()
    open(os.path.join(directory, f"rank{rt.rank}.pid"), "w").write(str(os.getpid()))
    if rt.rank == 0:
        rt.all_reduce(torch.ones(1))
    time.sleep(3600)

if __name__ == "__main__":
    ddpkit.launch(stuck, nprocs=2, args=(sys.argv[1],), start_method=sys.argv[2])
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("start_method", [pytest.param("spawn", marks=pytest.mark.slow), "forkserver"])
def test_children_of_a_sigkilled_launch_parent_end_within_seconds(tmp_path, start_method):
    """torch's spawn sends its children SIGINT when the parent dies, which a script handling Ctrl-C
    ignores; ddpkit's children get SIGKILL. A forkserver's children are not the launcher's: they die
    with the server, which ends when the launcher dies."""
    script = tmp_path / "parent.py"
    script.write_text(LAUNCH_PARENT)
    launcher = _start([sys.executable, str(script), str(tmp_path), start_method])
    left, seconds = _kill_launcher_and_watch(launcher, tmp_path, 2)
    assert left == [], f"children {left} still ran {seconds:.0f} s after the ddpkit.launch parent was killed"


FT_REPLICA = """
import os, sys, time
import ddpkit

rt = ddpkit.init()
open(os.path.join(sys.argv[1], f"rank{os.environ['DDPKIT_FT_REPLICA']}.pid"), "w").write(str(os.getpid()))
time.sleep(3600)
"""


@pytest.mark.slow  # 6 s: make test keeps the ddpkit run launcher's
@pytest.mark.timeout(240)
def test_everything_a_sigkilled_fault_tolerant_launcher_started_ends_within_seconds(tmp_path):
    """ddpkit run --fault-tolerant SIGKILLed: its control plane (torchft's lighthouse), each replica's
    own ddpkit run and their workers all end, found as the launcher's descendants before the kill."""
    import os
    import signal
    import time

    import psutil

    from helpers import BIN, wait_for

    pytest.importorskip("torchft", reason="the fault-tolerant mode needs torchft (pip install 'ddpkit[ft]')")
    script = tmp_path / "replica.py"
    script.write_text(FT_REPLICA)
    launcher = _start([str(BIN / "ddpkit"), "run", "--fault-tolerant", "-n", "2", str(script), str(tmp_path)])
    started: list[int] = []
    try:
        wait_for(lambda: len(list(tmp_path.glob("rank*.pid"))) == 2, timeout=180, what="the replicas' pid files")
        started = [p.pid for p in psutil.Process(launcher.pid).children(recursive=True)]
        workers = {int(p.read_text()) for p in tmp_path.glob("rank*.pid")}
        assert workers <= set(started) and len(started) >= 5, started  # plane, 2 x (ddpkit run, worker)
        os.kill(launcher.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(_ended(p) for p in started):
            time.sleep(0.1)
        left = [p for p in started if not _ended(p)]
        assert left == [], f"processes {left} still ran 30 s after the fault-tolerant launcher was killed"
    finally:
        for pid in started:
            kill_tree(pid)
        kill_tree(launcher.pid)
        launcher.wait(timeout=30)
