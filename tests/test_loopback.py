"""Nothing a single-machine job listens on is reachable from this machine's network address."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers import BIN, clean_env, kill_tree

ROOT = Path(__file__).resolve().parents[1]


def _network_addresses() -> list[str]:
    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET and not a.address.startswith("127.")]


NETWORK = _network_addresses()
needs_network = pytest.mark.skipif(not NETWORK, reason="this machine has no non-loopback IPv4 address to connect from")

WAITER = """
import os, sys, time
from pathlib import Path
import ddpkit

def wait(flag):
    rt = ddpkit.init()
    if rt.rank == 0:
        Path(flag + ".ready").write_text("ready")
    while not Path(flag + ".done").exists():
        time.sleep(0.1)
    rt.barrier()
    return rt.rank

if __name__ == "__main__":
    if sys.argv[1] == "launch":
        print(ddpkit.launch(wait, nprocs=2, args=(sys.argv[2],)))
    else:
        wait(sys.argv[2])
"""


def _listening(root: psutil.Process) -> set[tuple[int, str, int]]:
    found = set()
    for proc in [root, *root.children(recursive=True)]:
        try:
            found |= {(proc.pid, c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            pass
    return found


def _accepts(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(2)
        return probe.connect_ex((host, port)) == 0


@needs_network
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["ddpkit run -n 2", "ddpkit.launch"])
def test_no_socket_of_the_job_accepts_from_the_network(how, tmp_path):
    import subprocess

    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    flag = str(tmp_path / "flag")
    command = ([str(BIN / "ddpkit"), "run", "-n", "2", str(script), "run", flag] if how.startswith("ddpkit run")
               else [sys.executable, str(script), "launch", flag])
    job = subprocess.Popen(command, env=clean_env(), cwd=ROOT, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not Path(flag + ".ready").exists():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.2)
        listening = _listening(psutil.Process(job.pid))
        ports = {port for _, _, port in listening}
        assert len(ports) >= 3, listening       # the rendezvous store, rank 0's store, gloo's sockets
        assert {ip for _, ip, _ in listening} == {"127.0.0.1"}, listening
        reachable = [(host, port) for host in NETWORK for port in ports if _accepts(host, port)]
        assert reachable == []
        with socket.create_server(("0.0.0.0", 0)) as control:     # the probe can tell: a wildcard socket accepts
            assert _accepts(NETWORK[0], control.getsockname()[1])
        Path(flag + ".done").write_text("done")
        out, err = job.communicate(timeout=60)
        assert job.returncode == 0, err[-2000:]
    finally:
        kill_tree(job.pid)


@pytest.mark.timeout(120)
def test_doctor_says_where_a_run_listens_and_what_plain_torchrun_exposes(tmp_path):
    import json
    import subprocess

    from helpers import ddpkit as ddpkit_cli

    facts = json.loads(ddpkit_cli("doctor", "--json").stdout)["facts"]
    assert facts["a run listens on"].startswith("127.0.0.1 only")
    script = tmp_path / "doctor.py"      # doctor inside a job started by plain torchrun, rank 0 reporting
    script.write_text("import json, os, sys\nfrom ddpkit.doctor import examine\n"
                      "r = examine()\nif os.environ['RANK'] == '0': print(json.dumps(r.warnings))\n")
    plain = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "1", str(script)],
                           env=clean_env(), capture_output=True, text=True, timeout=100)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert "started by plain torchrun: its agent's rendezvous and worker stores listen on every interface" in plain.stdout
    ours = subprocess.run([str(BIN / "ddpkit"), "run", "-n", "1", str(script)],
                          env=clean_env(), capture_output=True, text=True, timeout=100)
    assert ours.returncode == 0 and "plain torchrun" not in ours.stdout, ours.stderr[-2000:]


def test_rank_0s_store_binds_the_master_address_unless_a_multi_node_name_is_loopback_here(monkeypatch):
    import torch.distributed as dist

    from ddpkit import process_group
    from ddpkit.env import Environment

    served = []
    monkeypatch.setattr("ddpkit.stores.serve", lambda host, port, **kw: served.append(host) or "bound")
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **kw: "every interface")
    one_node = Environment(launcher="torchelastic", world_size=2, local_world_size=2, master_addr="127.0.0.1")
    assert process_group._serve(one_node, 5) == "bound" and served == ["127.0.0.1"]
    # /etc/hosts maps the node's own name to loopback, other nodes reach it at its network address
    two_nodes = Environment(launcher="slurm", world_size=4, local_world_size=2, master_addr="localhost")
    assert process_group._serve(two_nodes, 5) == "every interface"
