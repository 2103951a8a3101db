"""Several "nodes" on one machine: two agents on loopback, two network namespaces, SLURM scripts."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

from ddpkit import checkpoint
from ddpkit.cli.slurm import sbatch_script
from helpers import BIN, EXAMPLES, ROOT, clean_env, kill_tree, master_port
from helpers import ddpkit as ddpkit_cli

HELLO = str(EXAMPLES / "hello.py")
NODE_LOCAL = str(ROOT / "tests" / "scripts" / "node_local.py")
ELASTIC = str(ROOT / "tests" / "scripts" / "elastic_train.py")


def _nodes(commands: list[list[str]], timeout: float = 240, envs: list[dict] | None = None) -> list[tuple[int, str]]:
    """Start one command per node at once; return (exit code, stdout+stderr) of each.

    Output goes to files, not pipes: a node whose pipe nobody reads yet could block on a full pipe
    while its peer waits for it in a collective.
    """
    logs = [tempfile.TemporaryFile("w+") for _ in commands]
    procs = [
        subprocess.Popen(
            cmd,
            stdout=logs[i],
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=(envs[i] if envs else clean_env()),
            start_new_session=True,
        )
        for i, cmd in enumerate(commands)
    ]
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
    results = []
    for proc, log in zip(procs, logs):
        log.seek(0)
        results.append((proc.returncode, log.read()))
        log.close()
    return results


def _two_agents(
    script_and_args: list[str],
    nproc: int = 2,
    prefix: list[list[str]] | None = None,
    master: str | None = None,
    envs: list[dict] | None = None,
    options: tuple[str, ...] = (),
) -> list[tuple[int, str]]:
    master = master or f"127.0.0.1:{master_port()}"
    return _nodes(
        [
            [
                *(prefix[i] if prefix else []),
                str(BIN / "ddpkit"),
                "run",
                "--nnodes",
                "2",
                "--node-rank",
                str(i),
                "--master",
                master,
                "-n",
                str(nproc),
                *options,
                *script_and_args,
            ]
            for i in range(2)
        ],
        envs=envs,
    )


@pytest.mark.timeout(300)
def test_two_agents_on_loopback_form_world_of_four():
    results = _two_agents([HELLO])
    assert all(code == 0 for code, _ in results), results
    lines = [line for _, out in results for line in re.findall(r"world_size=\d+ rank_sum=\d+", out)]
    assert lines == ["world_size=4 rank_sum=6"]  # printed once, by global rank 0


def _train_on_two_nodes(common: list[str], out: Path, env: dict) -> list[tuple[int, str]]:
    """``ddpkit train`` with ``common`` on two nodes of two processes (two agents on this machine)."""
    master = f"127.0.0.1:{master_port()}"
    return _nodes(
        [
            [str(BIN / "ddpkit"), "train", *common, "--nproc", "2", "--nnodes", "2", "--node-rank", str(rank)]
            + ["--master", master, "--out", str(out)]
            for rank in range(2)
        ],
        timeout=180,
        envs=[env, env],
    )


@pytest.mark.slow  # 7 s: two simulated nodes
@pytest.mark.timeout(300)
def test_local_rank_zero_prepares_each_node_first(tmp_path):
    results = _two_agents([NODE_LOCAL, str(tmp_path)])
    assert all(code == 0 for code, _ in results), results
    lines = sorted(
        re.findall(
            r"rank=\d+ node=\d+ local_rank=\d+ prepared_by=\w+ world_size=\d+ seen=\d+", results[0][1] + results[1][1]
        )
    )
    assert len(lines) == 4 and all("world_size=4 seen=4" in line for line in lines)
    assert [line.split()[3] for line in lines] == [
        "prepared_by=self",
        "prepared_by=peer",
        "prepared_by=self",
        "prepared_by=peer",
    ]
    assert sorted(os.listdir(tmp_path)) == ["node0.ready", "node1.ready"]


@pytest.mark.slow  # 40 s; two agents forming a world of four stay in make test
@pytest.mark.timeout(400)
def test_train_across_two_nodes_matches_four_processes_on_one(tmp_path):
    common = ["--model", "convnet", "--data", "digits", "--epochs", "1", "--global-batch", "64"]
    # One thread each in both layouts, whatever the cores: intra-op threading must not change sums.
    env = clean_env(OMP_NUM_THREADS="1")
    single = ddpkit_cli("train", *common, "--nproc", "4", "--out", str(tmp_path / "one"), timeout=180, env=env)
    assert single.returncode == 0, single.stderr[-3000:]
    results = _train_on_two_nodes(common, tmp_path / "two", env)
    assert all(code == 0 for code, _ in results), results
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert one["world_size"] == two["world_size"] == 4
    first = checkpoint.read(one["final_checkpoint"])["user"]["model"]
    second = checkpoint.read(two["final_checkpoint"])["user"]["model"]
    for name, value in first.items():
        assert torch.equal(second[name], value), name
    assert two["test_accuracy"] == one["test_accuracy"]


@pytest.mark.slow  # 50 s
@pytest.mark.timeout(400)
def test_micro_shards_across_two_nodes_end_at_one_processs_bits(tmp_path):
    """micro_shards=4 on 2 nodes of 2: ranks 1 and 2 trade their slots of each global batch, so each node
    makes the tree's innermost additions, and the run still ends at one process's bits."""
    common = ["--model", "convnet", "--data", "digits", "--epochs", "1", "--global-batch", "64", "--micro-shards", "4"]
    one = ddpkit_cli("train", *common, "--nproc", "1", "--out", str(tmp_path / "one"), timeout=180)
    assert one.returncode == 0, one.stderr[-3000:]
    results = _train_on_two_nodes(common, tmp_path / "two", clean_env())
    assert all(code == 0 for code, _ in results), results
    single = json.loads((tmp_path / "one" / "summary.json").read_text())
    nodes = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert (single["world_size"], nodes["world_size"]) == (1, 4)
    first = checkpoint.read(single["final_checkpoint"])["user"]["model"]
    second = checkpoint.read(nodes["final_checkpoint"])["user"]["model"]
    assert first.keys() == second.keys()
    for name, value in first.items():
        assert torch.equal(second[name], value), name
    assert nodes["test_accuracy"] == single["test_accuracy"]


@pytest.mark.slow  # 35 s
@pytest.mark.timeout(400)
def test_a_worker_killed_on_one_node_restarts_both_and_resumes_bitwise(tmp_path):
    """c10d rendezvous: the other node's agent sees the failed node rejoin and restarts its workers."""
    env = clean_env(OMP_NUM_THREADS="1")
    reference = tmp_path / "one.pt"
    single = ddpkit_cli(
        "run",
        "-n",
        "4",
        ELASTIC,
        "--checkpoints",
        str(tmp_path / "one-ckpt"),
        "--result",
        str(reference),
        timeout=120,
        env=env,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    result = tmp_path / "two.pt"
    results = _two_agents(
        [
            ELASTIC,
            "--checkpoints",
            str(tmp_path / "two-ckpt"),
            "--result",
            str(result),
            "--kill-step",
            "9",
            "--kill-rank",
            "3",
        ],
        options=("--max-restarts", "1"),
        envs=[env, env],
    )
    output = results[0][1] + results[1][1]
    assert all(code == 0 for code, _ in results), output[-4000:]
    # 7 when the checkpoint of step 8 was still being written in the background as the job stopped
    assert re.search(r"resumed at step (7|8|9)\b", output), output[-4000:]
    # Every rank on both nodes finished in a process that a restart started, resuming at 8 or 9.
    starts = dict(re.findall(r"rank (\d+) started at step (\d+)", output))
    assert sorted(starts) == ["0", "1", "2", "3"], output[-4000:]
    assert len(set(starts.values())) == 1 and set(starts.values()) <= {"7", "8", "9"}, starts
    weights, expected = torch.load(result, weights_only=True), torch.load(reference, weights_only=True)
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)


# -- real separate hosts: network namespaces joined by a veth pair ------------------------------

# Named per test process, so two test runs on one machine never tear down each other's hosts.
NAMESPACES = (f"ddpkit-{os.getpid()}-0", f"ddpkit-{os.getpid()}-1")
IFACES = (f"ddpk{os.getpid()}a", f"ddpk{os.getpid()}b")  # at most 15 characters
ADDRESSES = ("10.231.77.1", "10.231.77.2")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def namespaces():
    if shutil.which("ip") is None:
        pytest.skip("iproute2's 'ip' is not installed: cannot create network namespaces")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    for name in NAMESPACES:
        _ip("netns", "del", name)
    made = _ip("netns", "add", NAMESPACES[0])
    if made.returncode != 0:
        pytest.skip(f"this sandbox cannot create network namespaces: {made.stderr.strip()}")
    try:
        steps = [
            ("netns", "add", NAMESPACES[1]),
            ("link", "add", IFACES[0], "type", "veth", "peer", "name", IFACES[1]),
            ("link", "set", IFACES[0], "netns", NAMESPACES[0]),
            ("link", "set", IFACES[1], "netns", NAMESPACES[1]),
        ]
        for _index, (ns, address, iface) in enumerate(zip(NAMESPACES, ADDRESSES, IFACES)):
            steps += [
                ("-n", ns, "addr", "add", f"{address}/24", "dev", iface),
                ("-n", ns, "link", "set", iface, "up"),
                ("-n", ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            result = _ip(*step)
            if result.returncode != 0:
                pytest.skip(f"cannot set up the namespaces (ip {' '.join(step)}): {result.stderr.strip()}")
        yield
    finally:
        for name in NAMESPACES:
            _ip("netns", "del", name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "told",
    [pytest.param(True, marks=pytest.mark.slow), False],  # given: 5 s, make test-slow
    ids=["GLOO_SOCKET_IFNAME given", "ddpkit picks the interface"],
)
def test_two_hosts_in_network_namespaces(namespaces, told):
    # The host name resolves to 127.0.0.1 in both namespaces (/etc/hosts): left to itself, gloo would
    # bind loopback there and the hosts could not connect. ddpkit binds the interface of the route to
    # the master, the job's network, and nothing else.
    master = f"{ADDRESSES[0]}:29531"
    prefix = [["ip", "netns", "exec", ns] for ns in NAMESPACES]
    envs = [clean_env(GLOO_SOCKET_IFNAME=iface) if told else clean_env() for iface in IFACES]
    results = _two_agents([HELLO], nproc=1, prefix=prefix, master=master, envs=envs)
    assert all(code == 0 for code, _ in results), results
    lines = [line for _, out in results for line in re.findall(r"world_size=\d+ rank_sum=\d+", out)]
    assert lines == ["world_size=2 rank_sum=1"]


# -- SLURM scripts -------------------------------------------------------------------------------


def test_slurm_script_runs_ddpkit_run_once_per_node():
    result = ddpkit_cli("slurm", "--nodes", "2", "train.py", timeout=60)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith("#!/bin/bash\n")
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=1" in text
    srun = [line for line in text.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1 and " run -n 1 train.py" in srun[0] and "ddpkit" in srun[0].split()[2]


def test_slurm_script_options():
    text = sbatch_script(
        "t.py",
        ["--lr", "0.1"],
        nodes=4,
        gpus_per_node=8,
        cpus_per_task=32,
        partition="gpu",
        time="1-00:00:00",
        max_restarts=2,
        ddpkit_command="ddpkit",
    )
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=1-00:00:00",
    ):
        assert line in text
    assert "srun --ntasks-per-node=1 ddpkit run -n 8 --max-restarts 2 t.py --lr 0.1" in text


def test_slurm_requeue_script_asks_for_the_warning_passes_it_on_and_requeues_on_75():
    text = sbatch_script(
        "t.py", [], nodes=2, time="4:00:00", requeue=True, preempt_signal_s=300, ddpkit_command="ddpkit"
    )
    for line in (
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "trap 'signalled=1; kill -USR1 \"$step\" 2>/dev/null' USR1",
        'if [ "$code" = 75 ]; then',
        'scontrol requeue "$SLURM_JOB_ID" && exit 0',
        "command -v scontrol",
    ):
        assert line in text, line
    assert "srun --ntasks-per-node=1 ddpkit run -n 1 t.py &" in text
    plain = sbatch_script("t.py", [], nodes=2, time="4:00:00", ddpkit_command="ddpkit")
    assert "--signal" not in plain and "requeue" not in plain


def test_slurm_requeue_script_without_scontrol_says_what_to_do(tmp_path):
    """In a batch step with no scontrol (a container), a preempted job prints one line and exits 75."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/bash\nexit 75\n")
    (fake / "srun").chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(
        sbatch_script("t.py", [], nodes=1, time="10", requeue=True, preempt_signal_s=60, ddpkit_command="ddpkit")
    )
    done = subprocess.run(
        ["/bin/bash", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": str(fake), "SLURM_JOB_ID": "7"},
    )  # builtins only: no scontrol
    assert done.returncode == 75, done.stderr
    assert done.stderr.strip().splitlines() == [
        "ddpkit: preempted after saving a checkpoint, but this batch step cannot requeue (no scontrol here): "
        "resubmit this script with sbatch and it resumes"
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "0", "t.py"], "--nodes must be at least 1"),
        (["--nodes", "2", "--time", "soon", "t.py"], "--time 'soon'"),
        (["t.py"], "--nodes"),
        (["--nodes", "1", "--requeue", "t.py"], "--requeue needs --time"),
        (
            ["--nodes", "1", "--requeue", "--time", "2", "--preempt-signal-s", "120", "t.py"],
            "--preempt-signal-s 120 is not before the end of --time 2 (120 s)",
        ),
        (
            ["--nodes", "1", "--requeue", "--time", "1-0", "--preempt-signal-s", "0", "t.py"],
            "--preempt-signal-s must be 1 to 65535",
        ),
    ],
)
def test_slurm_bad_input(capsys, args, message):
    from ddpkit import cli

    code = cli.main(["slurm", *args])  # (in this process: what reaches stderr from the command, test_cli.py)
    stderr = capsys.readouterr().err
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
