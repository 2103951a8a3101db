"""`ddpkit run` argument building (no processes) and `ddpkit.launch` with real gloo processes."""

from __future__ import annotations

import os
import shlex
import sys

import pytest
import torch

import ddpkit
import workers
from ddpkit.distributed.environment import Environment
from ddpkit.distributed.host import threads_per_process
from ddpkit.distributed.torchrun import AGENT_ENV, RunSpec, parse_master, torchrun_args, validate
from ddpkit.errors import EXIT_HANG, EXIT_MISMATCH, UsageError

PRIVATE = "/private/ddpkit-job-x"


def test_single_node_meets_through_a_file_of_its_private_directory():
    args = torchrun_args(RunSpec("train.py", ["--lr", "0.1"], nproc_per_node=2), Environment(), store_dir=PRIVATE)
    assert {"--rdzv-backend=c10d", f"--rdzv-endpoint={PRIVATE}/rendezvous", "--rdzv-conf=store_type=file"} <= set(args)
    assert "--local-addr=127.0.0.1" in args  # workers never depend on the host name resolving
    assert "--nproc-per-node=2" in args and "--nnodes=1" in args
    assert args[-3:] == ["train.py", "--lr", "0.1"]
    with pytest.raises(UsageError, match="private store directory"):
        torchrun_args(RunSpec("train.py", nproc_per_node=2), Environment())


@pytest.mark.parametrize("master", ["127.0.0.1:29511", "localhost:29511", "10.0.0.1:29511"])
def test_one_node_with_a_master_stays_on_the_private_path(master):
    # torchrun's one-machine spellings (--master_addr/--master_port, --rdzv-endpoint, --master) used to
    # send the job down the multi-node path, where the agent hosts the store on every interface
    args = torchrun_args(RunSpec("t.py", nproc_per_node=2, master=master), Environment(), store_dir=PRIVATE)
    assert f"--rdzv-endpoint={PRIVATE}/rendezvous" in args and "--rdzv-conf=store_type=file" in args
    assert not any(a.startswith("--rdzv-conf=is_host") for a in args)


def test_two_single_node_runs_get_different_ids():
    first = torchrun_args(RunSpec("a.py", nproc_per_node=1), Environment(), store_dir=PRIVATE)
    second = torchrun_args(RunSpec("a.py", nproc_per_node=1), Environment(), store_dir=PRIVATE)
    ids = [a for a in first + second if a.startswith("--rdzv-id=")]
    assert len(set(ids)) == 2


def test_multi_node_is_c10d_at_the_master_with_one_run_id_on_every_node():
    nodes = [
        torchrun_args(RunSpec("t.py", nproc_per_node=4, nnodes=2, node_rank=r, master="127.0.0.1:29400"), Environment())
        for r in (0, 1)
    ]
    for args in nodes:
        assert {
            "--nnodes=2",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:29400",
            "--local-addr=127.0.0.1",
        } <= set(args)
        assert not any(a.startswith(("--node-rank", "--master-addr")) for a in args)
    ids = {a for args in nodes for a in args if a.startswith("--rdzv-id=")}
    assert len(ids) == 1  # both nodes meet in one rendezvous
    assert "--rdzv-conf=is_host=true" in nodes[0] and "--rdzv-conf=is_host=false" in nodes[1]


def test_multi_node_without_node_rank_lets_torchrun_pick_the_store_host():
    args = torchrun_args(RunSpec("t.py", nproc_per_node=2, nnodes=2, master="head.invalid:29400"), Environment())
    assert "--rdzv-endpoint=head.invalid:29400" in args and "--rdzv-backend=c10d" in args
    assert not any(a.startswith(("--rdzv-conf", "--local-addr")) for a in args)  # no route: torchrun's FQDN


def test_every_attempt_gets_a_fresh_worker_store_and_the_agent_joins_ddpkits_own():
    assert AGENT_ENV == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # no second agent store, on any job
    node0 = torchrun_args(
        RunSpec("t.py", nproc_per_node=2, nnodes=2, node_rank=0, master="10.0.0.1:29400"),
        Environment(),
        store_port=29400,
    )
    assert "--rdzv-conf=is_host=false" in node0  # ddpkit serves node 0's store itself


def test_workers_start_through_ddpkit_entry():
    # ddpkit.entry runs the target as python would, then exits without interpreter teardown
    module = torchrun_args(RunSpec("pkg.train", ["x"], module=True, nproc_per_node=1), Environment(), store_dir=PRIVATE)
    assert module[-5:] == ["--module", "ddpkit.entry", "-m", "pkg.train", "x"]
    script = torchrun_args(RunSpec("train.py", ["-m", "y"], nproc_per_node=1), Environment(), store_dir=PRIVATE)
    assert script[-5:] == ["--module", "ddpkit.entry", "train.py", "-m", "y"]


def test_under_srun_nodes_come_from_slurm(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    slurm = Environment(
        launcher="slurm",
        rank=1,
        local_rank=0,
        world_size=3,
        local_world_size=1,
        node_rank=1,
        master_addr="node01",
        master_port=19242,
    )
    args = torchrun_args(RunSpec("t.py", nproc_per_node=2), slurm)
    assert {"--nnodes=3", "--rdzv-endpoint=node01:19242", "--rdzv-id=4242", "--rdzv-conf=is_host=false"} <= set(args)


def test_under_srun_more_than_one_task_per_node_is_refused():
    slurm = Environment(launcher="slurm", rank=1, local_rank=1, world_size=4, local_world_size=2)
    with pytest.raises(UsageError, match="one task per node"):
        torchrun_args(RunSpec("t.py", nproc_per_node=2), slurm)


@pytest.mark.parametrize("text, expected", [("node01:29500", ("node01", 29500)), ("[::1]:1234", ("::1", 1234))])
def test_parse_master(text, expected):
    assert parse_master(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("nohost", "has no port"),
        ("h:0", "out of range"),
        ("h:99999", "out of range"),
        ("h:abc", "not a number"),
        ("[::1", "unbalanced brackets"),
        ("[::1:29500", "unbalanced brackets"),
        ("::1]:29500", "unbalanced brackets"),
        (":29500", "has no host"),
        ("[]:29500", "has no host"),
        ("h:", "has no port"),
    ],
)
def test_parse_master_errors(text, message):
    with pytest.raises(UsageError, match=message):
        parse_master(text)


def test_validate_rejects_bad_specs(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    validate(RunSpec(str(script), nproc_per_node=2))
    with pytest.raises(UsageError, match="at least 1"):
        validate(RunSpec(str(script), nproc_per_node=0))
    with pytest.raises(UsageError, match="not found"):
        validate(RunSpec(str(tmp_path / "missing.py")))
    with pytest.raises(UsageError, match="--max-restarts"):
        validate(RunSpec(str(script), max_restarts=-1))


def test_a_module_is_looked_for_as_python_m_would_from_the_current_directory_without_running_it(tmp_path, monkeypatch):
    package = tmp_path / "mine_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise SystemExit('imported')\n")  # finding it must not run it
    monkeypatch.chdir(tmp_path)
    validate(RunSpec("mine_pkg", module=True))
    validate(RunSpec("mine_pkg.train", module=True))  # its submodules are the workers' to find
    validate(RunSpec("json.tool", module=True))
    with pytest.raises(UsageError, match="module 'not_mine.train' not found: no 'not_mine' in the current directory"):
        validate(RunSpec("not_mine.train", module=True))


def test_threads_are_shared_among_processes():
    assert threads_per_process(2, cpu_count=8) == 4
    assert threads_per_process(3, cpu_count=2) == 1


@pytest.mark.timeout(120)
def test_launch_runs_function_in_each_process():
    results = ddpkit.launch(workers.rank_sum, nprocs=3)
    assert sorted(results) == [0, 1, 2]
    assert all(r["world_size"] == 3 and r["sum"] == 3 for r in results.values())
    assert [results[r]["rank"] for r in range(3)] == [0, 1, 2]


@pytest.mark.timeout(120)
def test_uneven_all_gather_and_reductions():
    results = ddpkit.launch(workers.gather_uneven, nprocs=3)
    gathered, mean, top = results[0]
    assert gathered == [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]
    assert mean == [1.0] and top == 2
    assert results[1] == results[0] == results[2]


@pytest.mark.timeout(120)
def test_launch_raises_first_failure_with_rank_and_traceback(capfd):
    with pytest.raises(ddpkit.LaunchError) as info:
        ddpkit.launch(workers.fail_on_rank_one, nprocs=2)
    # the failed rank closed as failed: rank 0, left in its barrier, reports no collective mismatch
    assert "collective mismatch" not in capfd.readouterr().err
    assert info.value.rank == 1
    assert "ValueError: rank one refuses" in str(info.value)
    assert "fail_on_rank_one" in info.value.child_traceback
    assert 'raise ValueError("rank one refuses")' in info.value.child_traceback


@pytest.mark.timeout(120)
def test_forkserver_children_get_each_launchs_environment_and_streams_not_the_servers(monkeypatch, capfd):
    """The server starts in the first launch; the second launch's children must not see its environment
    or write where its stdout and stderr went (capfd gives each launch new ones)."""
    import psutil

    from ddpkit.distributed import stores

    seen, nprocs = [], {"first": 2, "second": 1}  # OMP_NUM_THREADS: half the cores, then all
    for mark in nprocs:
        monkeypatch.setenv("DDPKIT_TEST_MARK", mark)
        if mark == "second":
            monkeypatch.delenv("DDPKIT_TEST_GONE")
        else:
            monkeypatch.setenv("DDPKIT_TEST_GONE", "1")
        seen.append(ddpkit.launch(workers.environment, nprocs=nprocs[mark], start_method="forkserver"))
        out, err = capfd.readouterr()
        ranks = range(nprocs[mark])
        assert sorted(out.splitlines()) == [f"stdout of rank {rank} in launch {mark}" for rank in ranks]
        assert {f"stderr of rank {rank} in launch {mark}" for rank in ranks} <= set(err.splitlines())
    for mark, results in zip(nprocs, seen):
        for rank, child in results.items():
            assert child["environ"]["DDPKIT_TEST_MARK"] == mark
            assert child["environ"]["RANK"] == str(rank) and child["environ"]["WORLD_SIZE"] == str(nprocs[mark])
            assert child["torch_threads"] == int(child["environ"]["OMP_NUM_THREADS"])
            # a child of this process's forkserver, which outlives us while its children live: each
            # child watches this process itself (tests/test_clean_exit.py kills a launcher)
            server = psutil.Process(child["ppid"])
            assert server.ppid() == os.getpid(), "not a child of this process's forkserver"
            assert "ddpkit-launcher-watch" in child["threads"]
    assert "DDPKIT_TEST_GONE" in seen[0][0]["environ"] and "DDPKIT_TEST_GONE" not in seen[1][0]["environ"]
    first, second = (results[0]["environ"][stores.STORE_DIR_ENV] for results in seen)
    assert first != second  # each job meets in its own private directory


def test_launch_rejects_zero_processes():
    with pytest.raises(UsageError):
        ddpkit.launch(workers.rank_sum, nprocs=0)


def test_a_fork_after_cuda_was_used_is_refused_in_one_line(monkeypatch):
    """A function typed into a notebook starts by fork, which CUDA does not survive: where the
    notebook used CUDA already, one line says what to do instead of every child's traceback."""
    from ddpkit.distributed import launch

    monkeypatch.setattr(launch, "_cuda_started", lambda: True)
    with pytest.raises(ddpkit.UsageError) as refused:
        ddpkit.launch(workers.environment, nprocs=2, start_method="fork")
    assert "Cannot re-initialize CUDA in forked subprocess" in str(refused.value)
    assert "call ddpkit.launch before any CUDA call" in str(refused.value) and "\n" not in str(refused.value)
    monkeypatch.undo()
    import torch

    assert launch._cuda_started() is torch.cuda.is_initialized()  # (False on a machine without a GPU)


UNGUARDED = """
import ddpkit
import workers

def main():
    print(ddpkit.launch(workers.rank_sum, nprocs=2))

{call}
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "call,refused",
    [
        ("main()", True),  # the top level reaches it through a function: each spawned child would again
        ('if __name__ == "__main__":\n    main()', False),
        pytest.param('if "__main__" == __name__:\n    main()', False, marks=pytest.mark.slow),  # (make test-slow)
    ],
    ids=["unguarded", "guarded", "guarded-reversed"],
)
def test_a_launch_from_a_scripts_unguarded_top_level_is_one_line_before_any_worker_starts(tmp_path, call, refused):
    """Each spawned worker imports the script again: an unguarded launch stopped every child in
    multiprocessing's bootstrapping phase, and the launch said "rank 0 failed: <NONE>"."""
    from helpers import ROOT, clean_env, python

    script = tmp_path / "train.py"
    script.write_text(UNGUARDED.format(call=call))
    path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    done = python(str(script), env=clean_env(PYTHONPATH=path))
    if refused:
        assert done.returncode == 1, done.stderr[-2000:]
        last = done.stderr.strip().splitlines()[-1]
        assert "ddpkit.launch: train.py line 8 reaches it from the script's top level" in last, last
        assert 'if __name__ == "__main__":' in last
        assert "bootstrapping phase" not in done.stderr and "rank 0 failed" not in done.stderr  # no worker ran
    else:
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.startswith("{0: ") and "1: " in done.stdout, done.stdout  # in rank order


FUNCTIONS = """
import ddpkit

try:
    def kept(scale):  # bound when the script is imported (a top-level try): every worker has it
        return scale * 2
except ImportError:
    pass

def outer():
    def nested(scale):
        return scale
    return nested

if __name__ == "__main__":
    def guarded(scale):
        return scale
    print(ddpkit.launch({fn}, nprocs=2, args=(3,)))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "fn,refused",
    [
        ("guarded", 'guarded is defined under `if __name__ == "__main__":` in train.py, which the workers do not run'),
        ("lambda scale: scale", "<lambda> is a lambda, which the workers cannot import"),
        pytest.param(  # (make test-slow: the lambda's refusal stays)
            "outer()",
            "outer.<locals>.nested is defined inside a function, which the workers cannot import",
            marks=pytest.mark.slow,
        ),
        ("kept", None),
    ],
    ids=["under-the-guard", "lambda", "nested", "top-level"],
)
def test_a_function_the_spawned_workers_cannot_import_is_one_line_before_any_worker_starts(tmp_path, fn, refused):
    """A function defined under the script's main guard reached each worker as "Can't get attribute", in a
    traceback a worker and torch's launcher's log; a lambda as a PicklingError."""
    from helpers import ROOT, clean_env, python

    script = tmp_path / "train.py"
    script.write_text(FUNCTIONS.format(fn=fn))
    path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    done = python(str(script), env=clean_env(PYTHONPATH=path))
    if refused is None:
        assert done.returncode == 0 and done.stdout.strip() == "{0: 6, 1: 6}", done.stderr[-2000:]
        return
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"ddpkit.launch: {refused}" in last and "define it with def at the top level of a module" in last, last
    assert "Can't get attribute" not in done.stderr and "rank 0 failed" not in done.stderr  # no worker ran


TYPED = """
import ddpkit, torch

def summed(scale):  # typed in: a __main__ with no file a spawned child could run again
    rt = ddpkit.init()
    total = ddpkit.all_reduce(torch.ones(1) * (rt.rank + 1))
    rt.close()
    return int(total) * scale

print(ddpkit.launch(summed, nprocs=2, args=(5,)))
"""


PACKAGE_MAIN = """
import ddpkit, torch

def summed(scale):
    rt = ddpkit.init()
    total = ddpkit.all_reduce(torch.ones(1) * (rt.rank + 1))
    rt.close()
    return int(total) * scale

print(ddpkit.launch(summed, nprocs=2, args=(7,){method}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", [None, "spawn"])
def test_a_function_of_a_packages_main_run_by_python_m_runs_by_fork(tmp_path, method):
    """``python -m pkg`` runs pkg/__main__.py as __main__, which multiprocessing's spawned children never
    import: every worker failed with "Can't get attribute 'summed'" before it reached the function."""
    from helpers import ROOT, clean_env, python

    package = tmp_path / "mine_launch"
    package.mkdir()
    (package / "__init__.py").write_text("")
    asked = "" if method is None else f", start_method={method!r}"
    (package / "__main__.py").write_text(PACKAGE_MAIN.format(method=asked))
    path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    done = python("-m", "mine_launch", env=clean_env(PYTHONPATH=path), cwd=tmp_path)
    if method is None:
        assert done.returncode == 0 and done.stdout.strip() == "{0: 21, 1: 21}", done.stderr[-2000:]
        return
    last = done.stderr.strip().splitlines()[-1]
    assert "summed is defined in mine_launch's __main__.py (python -m mine_launch)" in last, done.stderr[-2000:]
    assert "Can't get attribute" not in done.stderr  # refused before any worker started


@pytest.mark.timeout(120)
def test_a_function_typed_into_python_on_its_standard_input_runs_by_fork():
    """``python - < script`` names its __main__ "<stdin>", a file that is not there: spawned children ran
    it again and every worker failed with FileNotFoundError ('<stdin>') before it reached the function."""
    from helpers import ROOT, clean_env, run

    path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    command = f"{shlex.quote(sys.executable)} - <<'EOF'\n{TYPED}\nEOF\n"
    done = run(["bash", "-c", command], env=clean_env(PYTHONPATH=path))
    assert done.returncode == 0 and done.stdout.strip() == "{0: 15, 1: 15}", done.stderr[-2000:]


def test_a_forked_worker_whose_cuda_cannot_start_says_the_parent_started_it_and_what_to_do():
    """A notebook's ``torch.cuda.is_available()`` starts the CUDA driver without torch initializing
    itself, so the launch cannot refuse it beforehand; each forked worker then fails with CUDA's
    "initialization error", which now says why and what to do."""
    from ddpkit.distributed import launch

    failed = launch.LaunchError(1, "RuntimeError: CUDA error: initialization error", "Traceback ...")
    said = launch._after_cuda_in_the_parent(failed, "fork")
    assert str(said).startswith("rank 1 failed: RuntimeError: CUDA error: initialization error; this process had")
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" in said.message and said.child_traceback == "Traceback ..."
    assert launch._after_cuda_in_the_parent(failed, "spawn") is failed  # a spawned worker starts its own
    other = launch.LaunchError(0, "ValueError: bad")
    assert launch._after_cuda_in_the_parent(other, "fork") is other


def test_a_worker_that_failed_before_the_function_says_so_rather_than_none():
    from types import SimpleNamespace

    from ddpkit.distributed import launch

    failure = SimpleNamespace(exitcode=1, error_file_data={"message": "<NONE>"})
    error = launch._launch_error(0, failure)
    assert str(error) == "rank 0 failed: exit code 1, before it reached the function; its output above says why"


def test_what_a_worker_returns_comes_back_whole_with_host_tensors_as_they_were():
    """Returned values are pickled by ddpkit's own pickler (GPU tensors come back on the host: see
    test_gpu's DDP test); host tensors, parameters and their flag, and plain values are unchanged."""
    import pickle

    from ddpkit.distributed.entry import _by_value

    weight = torch.nn.Parameter(torch.arange(4.0), requires_grad=False)
    value = {"w": weight, "rows": [torch.ones(2, 3)], "note": ("kept", 3)}
    back = pickle.loads(_by_value(print, value))
    assert isinstance(back["w"], torch.nn.Parameter) and not back["w"].requires_grad
    assert torch.equal(back["w"], weight) and torch.equal(back["rows"][0], torch.ones(2, 3))
    assert back["note"] == ("kept", 3)


def test_a_rank_ended_by_the_watchdog_is_the_launchs_error_with_its_exit_code():
    from types import SimpleNamespace

    from ddpkit.distributed import launch

    ended = {0: SimpleNamespace(exitcode=1), 1: SimpleNamespace(exitcode=EXIT_MISMATCH)}
    error = launch._watchdogs_verdict(ended)
    assert error is not None and error.rank == 1 and error.exit_code == EXIT_MISMATCH
    assert str(error) == f"rank 1 failed: exit code {EXIT_MISMATCH}: the ranks called different collectives; " + (
        "the report above names each rank's call and line"
    )
    hung = launch._watchdogs_verdict({0: SimpleNamespace(exitcode=EXIT_HANG)})
    assert hung is not None and hung.exit_code == EXIT_HANG and "the job hung" in str(hung)
    assert launch._watchdogs_verdict({0: SimpleNamespace(exitcode=1)}) is None
