"""The command line end to end, in subprocesses: the same script under every launcher."""

from __future__ import annotations

import json

import pytest

import ddpkit
import workers
from ddpkit import cli
from helpers import BIN, EXAMPLES, clean_env, python, run
from helpers import ddpkit as ddpkit_cli

HELLO = str(EXAMPLES / "hello.py")


def _hello_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("world_size=")]


@pytest.mark.timeout(120)
def test_hello_under_ddpkit_run():
    result = ddpkit_cli("run", "-n", "2", HELLO)
    assert result.returncode == 0, result.stderr
    assert _hello_lines(result.stdout) == ["world_size=2 rank_sum=1"]


@pytest.mark.timeout(60)
def test_hello_under_plain_python():
    result = python(HELLO)
    assert result.returncode == 0, result.stderr
    assert _hello_lines(result.stdout) == ["world_size=1 rank_sum=0"]


@pytest.mark.timeout(120)
def test_hello_under_torchrun():
    result = run([str(BIN / "torchrun"), "--nproc_per_node", "3", HELLO])
    assert result.returncode == 0, result.stderr
    assert _hello_lines(result.stdout) == ["world_size=3 rank_sum=3"]


TWO_RUNS = """
import torch, ddpkit
for stage in ("pretrain", "finetune"):
    with ddpkit.init(seed=0) as rt:
        net = torch.nn.Linear(2, 2)
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        total = rt.all_reduce(torch.tensor([rt.rank + 1.0]))
        if rt.is_main:
            print(stage, int(total), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_script_of_two_runs_one_after_the_other_under_torchrun(tmp_path):
    """ddpkit.init after rt.close, in each process: the second group met in the first one's store, read
    its peers' stale addresses, and the ranks hung in the rendezvous, silently."""
    script = tmp_path / "two_runs.py"
    script.write_text(TWO_RUNS)
    result = run([str(BIN / "torchrun"), "--nproc_per_node", "2", str(script)], timeout=100)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["pretrain", "3", "finetune", "3"]


@pytest.mark.timeout(120)
def test_module_under_ddpkit_run(tmp_path):
    (tmp_path / "hello_mod.py").write_text((EXAMPLES / "hello.py").read_text())
    result = ddpkit_cli("run", "-n", "2", "-m", "hello_mod", env=clean_env(PYTHONPATH=str(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert _hello_lines(result.stdout) == ["world_size=2 rank_sum=1"]


@pytest.mark.timeout(120)
def test_script_arguments_pass_through(tmp_path):
    script = tmp_path / "args.py"
    script.write_text("import sys, ddpkit\nrt = ddpkit.init()\nrt.print('ARGS', sys.argv[1:])\n")
    result = ddpkit_cli("run", "-n", "1", str(script), "--lr", "0.1", "-n", "7")
    assert result.returncode == 0, result.stderr
    assert "ARGS ['--lr', '0.1', '-n', '7']" in result.stdout


@pytest.mark.timeout(120)
def test_failing_script_gives_nonzero_exit(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import ddpkit\nrt = ddpkit.init()\nraise SystemExit(3)\n")
    result = ddpkit_cli("run", "-n", "2", str(script))
    assert result.returncode == 1
    assert "ddpkit run: rank" in result.stderr and "exit code 3" in result.stderr


@pytest.mark.timeout(120)
def test_same_worker_under_launch():
    results = ddpkit.launch(workers.rank_sum, nprocs=2)
    assert {r["sum"] for r in results.values()} == {1}


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--bogus", "x.py"], "unknown option '--bogus'"),
        (["run", "-n", "2", "missing_script.py"], "script 'missing_script.py' not found"),
        (["run", "-n", "0", HELLO], "at least 1"),
        (["run", "--master", "nohost", HELLO], "has no port"),
        (["run", "--master", "h:70000", HELLO], "out of range"),
        (["run", "-n", "two", HELLO], "invalid int value"),
        (["run"], "needs a SCRIPT"),
        (["frobnicate"], "unknown command 'frobnicate'"),
        (["doctor", "--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    """In this process (``cli.main``); the command in a process of its own is the test below."""
    code = cli.main(args)
    stderr = capsys.readouterr().err
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert message in lines[0]
    assert "Traceback" not in stderr


def test_bad_input_is_one_line_and_exit_2_from_the_command():
    result = ddpkit_cli("run", "--bogus", "x.py", timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown option '--bogus'" in lines[0], result.stderr


@pytest.mark.timeout(60)
def test_doctor_reports_a_healthy_machine():
    result = ddpkit_cli("doctor", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["problems"] == []
    facts = report["facts"]
    assert facts["launcher"] == "none" and facts["rank / world size"] == "0 / 1"
    assert facts["gloo available"] is True and facts["backend"] == "gloo"
    for key in (
        "torch",
        "cuda available",
        "nccl available",
        "mpi available",
        "hostname",
        "master port free",
        "OMP_NUM_THREADS",
        "cpu cores",
    ):
        assert key in facts


def test_doctor_reports_what_a_fault_tolerant_job_listens_on_and_what_it_did_not_check(monkeypatch):
    pytest.importorskip("torchft")
    from ddpkit.cli import doctor
    from ddpkit.distributed import ft_control

    refused = ft_control.namespace_refusal()
    facts = dict(doctor.examine().facts)
    assert "firewalls" in facts["not checked"] and "node 0: the lighthouse" in facts["fault-tolerant across hosts"]
    if not refused:  # this machine gives the control plane a namespace of its own
        assert "in a network namespace of the job's own" in facts["fault-tolerant listens on"]
    monkeypatch.setattr(ft_control, "namespace_refusal", lambda: "Operation not permitted")
    report = doctor.examine()
    assert "managers on 127.0.0.1" in dict(report.facts)["fault-tolerant listens on"]
    assert any("no unprivileged network namespace (Operation not permitted)" in w for w in report.warnings)


@pytest.mark.timeout(60)
def test_doctor_fails_with_the_reason():
    result = ddpkit_cli("doctor", env=clean_env(RANK="3", WORLD_SIZE="2"))
    assert result.returncode == 1
    assert "problem: torchelastic: rank 3 is outside the world of size 2" in result.stdout


@pytest.mark.timeout(60)
def test_doctor_text_mode_and_version():
    result = ddpkit_cli("doctor")
    assert result.returncode == 0 and result.stdout.strip().endswith("ok")
    version = ddpkit_cli("--version")
    assert version.stdout.strip() == f"ddpkit {ddpkit.__version__}"


@pytest.mark.timeout(120)
def test_hello_itself_under_launch(capfd, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import hello

    assert ddpkit.launch(hello.main, nprocs=2) == {0: None, 1: None}
    assert _hello_lines(capfd.readouterr().out) == ["world_size=2 rank_sum=1"]


def test_help_piped_into_a_reader_that_stops_early_is_no_traceback():
    import subprocess
    import sys

    from helpers import clean_env

    closed = (
        "import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"  # stdout: a pipe nobody reads
        "from ddpkit.cli import main; sys.exit(main(['--help']))"
    )
    done = subprocess.run([sys.executable, "-c", closed], capture_output=True, text=True, env=clean_env(), timeout=60)
    assert done.returncode == 141 and done.stderr == "", done.stderr
