"""torchrun's flags on ``ddpkit run``: both spellings, mapped onto ddpkit's own; conflicts refused."""

from __future__ import annotations

import re

import pytest

from ddpkit.cli.run import spec_of
from ddpkit.distributed.environment import Environment
from ddpkit.distributed.torchrun import torchrun_args
from ddpkit.errors import UsageError
from helpers import EXAMPLES
from helpers import ddpkit as ddpkit_cli

HELLO = str(EXAMPLES / "hello.py")
LOCAL = Environment()  # not under SLURM: the flags alone decide


def _agent_args(argv: list[str]) -> list[str]:
    """torchrun's arguments for a ddpkit run command line, without the single-node random run id."""
    return [
        a
        for a in torchrun_args(spec_of(argv), LOCAL, store_dir="/private")
        if not a.startswith("--rdzv-id=") or "ddpkit-" in a
    ]


@pytest.mark.parametrize(
    "torchrun, ours",
    [
        (["--nproc_per_node", "2"], ["-n", "2"]),
        (["--nproc-per-node=2"], ["-n", "2"]),
        (["--standalone", "--nproc_per_node", "2"], ["-n", "2"]),
        (["--nproc_per_node", "2", "--nnodes", "1"], ["-n", "2"]),
        (
            ["--nnodes=2:2", "--node_rank=1", "--master_addr=10.0.0.1", "--master_port=29501", "--nproc_per_node=4"],
            ["--nnodes", "2", "--node-rank", "1", "--master", "10.0.0.1:29501", "-n", "4"],
        ),
        (
            ["--nnodes", "2", "--node-rank", "0", "--master-addr", "node01"],
            ["--nnodes", "2", "--node-rank", "0", "--master", "node01:29500"],
        ),  # torchrun's default port
        (
            ["--nnodes", "2", "--rdzv_endpoint", "node01", "--rdzv_backend", "c10d"],
            ["--nnodes", "2", "--master", "node01:29400"],
        ),
        (["--nnodes", "2", "--rdzv-endpoint", "[fd00::1]:29600"], ["--nnodes", "2", "--master", "[fd00::1]:29600"]),
        (["--max_restarts", "3", "-n", "2"], ["--max-restarts", "3", "-n", "2"]),
    ],
)
def test_torchrun_flags_map_onto_ddpkits(torchrun, ours):
    assert spec_of([*torchrun, HELLO]) == spec_of([*ours, HELLO])
    assert _agent_args([*torchrun, HELLO]) == _agent_args([*ours, HELLO])


def test_a_double_dash_ends_the_options_and_the_script_comes_next_as_under_torchrun():
    """``torchrun -n 2 -- train.py --lr 0.1`` was refused by ddpkit run ("unknown option '--'")."""
    spec = spec_of(["--nproc_per_node", "2", "--", HELLO, "-n", "5", "--", "--help"])
    assert spec == spec_of(["-n", "2", HELLO, "-n", "5", "--", "--help"])
    assert spec.target == HELLO and spec.target_args == ["-n", "5", "--", "--help"]
    with pytest.raises(UsageError, match="needs a SCRIPT or -m MODULE"):
        spec_of(["-n", "2", "--"])


def test_nproc_words_and_rdzv_id():
    assert spec_of(["--nproc_per_node", "auto", HELLO]).nproc_per_node is None  # ddpkit's default
    assert spec_of(["--nproc-per-node", "cpu", HELLO]).nproc_per_node >= 1
    spec = spec_of(["--nnodes", "2", "--master", "h:1", "--rdzv_id", "job42", HELLO])
    assert "--rdzv-id=job42" in torchrun_args(spec, LOCAL)
    assert "--rdzv-id=job7" in torchrun_args(spec_of(["--rdzv-id", "job7", HELLO]), LOCAL, store_dir="/private")
    assert spec_of(["-n", "2", "--nproc_per_node", "2", HELLO]).nproc_per_node == 2  # agreeing is fine
    script = spec_of(["--nproc_per_node", "2", HELLO, "--nproc_per_node", "9"])  # the script's own
    assert script.nproc_per_node == 2 and list(script.target_args) == ["--nproc_per_node", "9"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-n", "2", "--nproc_per_node", "3"], "-n 2 and --nproc-per-node 3 disagree; give one of them"),
        (
            ["--standalone", "--nnodes", "2"],
            "--standalone is one node with its own rendezvous; it does not combine with --nnodes 2",
        ),
        (["--standalone", "--master_addr", "h"], "it does not combine with --master-addr/--master-port"),
        (["--master", "a:1", "--master_addr", "b"], "--master and --master-addr/--master-port both name the master"),
        (["--master_addr", "a", "--rdzv_endpoint", "b:1"], "both name the master; give one of them"),
        (["--nnodes", "1:4"], "elastic MIN:MAX is not supported"),
        (["--nnodes", "two"], "--nnodes 'two': give a number of nodes"),
        (["--nproc_per_node", "many"], "give a number, auto, gpu or cpu"),
        (["--rdzv_backend", "etcd"], "--rdzv-backend 'etcd': ddpkit run rendezvouses with c10d"),
        (["--run_path"], "--run_path is a torchrun flag that ddpkit run does not take"),
        (["--no-python"], "--no-python is a torchrun flag that ddpkit run does not take"),
    ],
)
def test_conflicting_or_unsupported_flags_are_one_line(argv, message):
    with pytest.raises(UsageError) as said:
        spec_of([*argv, HELLO])
    assert message in str(said.value) and "\n" not in str(said.value)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU answer")
def test_nproc_gpu_without_a_gpu_is_refused():
    with pytest.raises(UsageError, match="torch sees no CUDA GPU here"):
        spec_of(["--nproc_per_node", "gpu", HELLO])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "flags",
    [["--nproc_per_node", "2"], pytest.param(["--standalone", "--nproc-per-node", "2"], marks=pytest.mark.slow)],
)  # (the second spelling: make test-slow; test_torchrun_flags.py maps each flag without a run)
def test_hello_with_torchruns_flags(flags):
    result = ddpkit_cli("run", *flags, HELLO)
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("world_size=")] == [
        "world_size=2 rank_sum=1"
    ]


def test_a_conflict_on_the_command_line_exits_2_in_one_line():
    result = ddpkit_cli("run", "-n", "2", "--nproc_per_node", "3", HELLO, timeout=60)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "ddpkit run: error: -n 2 and --nproc-per-node 3 disagree; give one of them"
    ]


def test_torchruns_log_flags_are_handed_to_its_agent_in_either_spelling():
    from ddpkit.distributed.torchrun import torchrun_args

    for argv in (["--tee", "3", "--redirects", "1", "--log-dir", "L"], ["-t", "3", "-r=1", "--log_dir=L"]):
        args = torchrun_args(spec_of([*argv, "-n", "2", HELLO]), store_dir="/tmp/x")
        assert {"--tee=3", "--redirects=1", "--log-dir=L"} <= set(args), args
    from ddpkit.cli.run import fault_tolerant_spec, parser, split

    ours, rest = split(["--fault-tolerant", "--log-dir", "L", "-n", "2", HELLO])
    with pytest.raises(UsageError, match="--log-dir is not taken with --fault-tolerant"):
        fault_tolerant_spec(parser().parse_args(ours), rest)


_FAILS = """
import sys
import ddpkit

rt = ddpkit.init()
print(f"hello from rank {rt.rank}", flush=True)
if rt.rank == 1:
    sys.exit(3)
rt.close()
"""


@pytest.mark.timeout(120)
def test_a_failed_rank_whose_output_was_redirected_is_named_with_its_log(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(_FAILS)
    logs = tmp_path / "logs"
    result = ddpkit_cli("run", "-n", "2", "--redirects", "3", "--log-dir", str(logs), str(script))
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"ddpkit run: rank 1 failed first (exit code 3); see its output in its log under {logs}" in result.stderr
    assert "hello from rank" not in result.stdout  # redirected: in the files, not here
    written = {path.parent.name: path.read_text() for path in logs.rglob("stdout.log")}
    assert written["1"] == "hello from rank 1\n", written


def test_torchruns_stream_values_are_checked_and_short_forms_take_their_value_attached():
    from ddpkit.distributed.torchrun import _where_output, torchrun_args

    args = torchrun_args(spec_of(["-t3", "-r1", "-n2", HELLO]), store_dir="/tmp/x")
    assert {"--tee=3", "--redirects=1", "--nproc-per-node=2"} <= set(args), args
    for bad in ("4", "a:b", "3,", "0:3,"):
        with pytest.raises(UsageError, match=rf"^--tee {re.escape(repr(bad))}: give the streams as torchrun takes"):
            spec_of(["--tee", bad, HELLO])  # torch's agent raised ValueError from deep inside its launch
    # a failed rank's error is in its log only where its stderr went there
    assert _where_output(["--redirects=3", "--log-dir=L"], 1) == "in its log under L"
    assert _where_output(["--redirects=1", "--log-dir=L"], 1) == "above"  # stdout alone: its traceback is here
    assert _where_output(["--redirects=0:3,1:1", "--log-dir=L"], 1) == "above"
    assert _where_output(["--redirects=0:1,1:2", "--log-dir=L"], 1) == "in its log under L"
    assert _where_output(["--tee=3", "--log-dir=L"], 0) == "above"
