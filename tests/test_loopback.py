"""Nothing of a one-machine job is reachable from the network or writable by another local user.

Each job runs in a UTS namespace whose host name is this machine's network address, as in a
container (Docker, Kubernetes, cloud VMs): there gloo, left to itself, binds what the host name
resolves to. Every job then gets its MASTER_PORT squatted and creates one more process group, to
show that no port of the job is picked free, published and bound later.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from helpers import BIN, clean_env, kill_tree, master_port

ROOT = Path(__file__).resolve().parents[1]


def _network_addresses() -> list[str]:
    return [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]


def _can_unshare() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-u", "true"], capture_output=True).returncode == 0


def _interface_of(address: str) -> str:
    return next(name for name, addrs in psutil.net_if_addrs().items() if any(a.address == address for a in addrs))


NETWORK = _network_addresses()
needs_network = pytest.mark.skipif(not NETWORK, reason="this machine has no non-loopback IPv4 address to connect from")
needs_uts = pytest.mark.skipif(
    not (NETWORK and _can_unshare()),
    reason="needs root, unshare and a non-loopback address: the job runs in a UTS "
    "namespace whose host name is that address",
)


def _python_of_nobody() -> str | None:
    """A Python that the user ``nobody`` can run (this venv's may live under /root, mode 0700)."""
    if os.geteuid() != 0 or not shutil.which("runuser"):
        return None
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        probe = subprocess.run(
            ["runuser", "-u", "nobody", "--", candidate, "-c", "print(1)"], capture_output=True, text=True, cwd="/"
        )
        if probe.returncode == 0:
            return candidate
    return None


NOBODY_PYTHON = _python_of_nobody()
needs_other_uid = pytest.mark.skipif(
    NOBODY_PYTHON is None, reason="needs root, runuser and a Python the user nobody can run"
)

WAITER = """
import os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist

def wait(flag, how="ddpkit"):
    if how == "plain":              # a hand-written script: its own init_process_group, env://
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        import ddpkit
        rt = ddpkit.init()
        rank = rt.rank
        if how == "groups":         # PowerSGD's second group and fsdp's device mesh
            model = rt.setup(torch.nn.Linear(8, 8), grad_compression="powersgd")
            rt.backward(model(torch.ones(4, 8)).sum())
            sharded = rt.setup(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), strategy="fsdp")
            sharded(torch.ones(2, 8)).sum().backward()
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 0:
        Path(flag + ".ready").write_text(os.environ.get("MASTER_PORT", ""))
    while not Path(flag + ".done").exists():
        time.sleep(0.1)
    late = dist.new_group()                        # after MASTER_PORT was squatted
    dist.all_reduce(t, group=late)
    dist.barrier()
    if rank == 0:
        Path(flag + ".result").write_text(str(t.item()))
    return rank

if __name__ == "__main__":
    if sys.argv[1] == "launch":
        import ddpkit
        print(ddpkit.launch(wait, nprocs=2, args=(sys.argv[2], sys.argv[3])))
    else:
        wait(sys.argv[2], sys.argv[3])
"""


def _listening(root: psutil.Process) -> set[tuple[int, str, int]]:
    found = set()
    for proc in [root, *root.children(recursive=True)]:
        try:
            found |= {
                (proc.pid, c.laddr.ip, c.laddr.port)
                for c in proc.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN
            }
        except psutil.NoSuchProcess:
            pass
    return found


def _accepts(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(2)
        return probe.connect_ex((host, port)) == 0


def _in_container(command: list[str]) -> list[str]:
    """``command`` in a new UTS namespace whose host name is this machine's network address."""
    return ["unshare", "-u", "sh", "-c", 'hostname "$0" && exec "$@"', NETWORK[0], *command]


def _command(how: str, script: Path, flag: str) -> list[str]:
    run = [str(BIN / "ddpkit"), "run"]
    port = str(master_port())
    lines = {
        "ddpkit run -n 2": [*run, "-n", "2", str(script), "run", flag, "ddpkit"],
        "groups": [*run, "-n", "2", str(script), "run", flag, "groups"],
        "ddpkit.launch": [sys.executable, str(script), "launch", flag, "ddpkit"],
        "plain init_process_group": [*run, "-n", "2", str(script), "run", flag, "plain"],
        "--master_addr/--master_port": [
            *run,
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
            str(script),
            "run",
            flag,
            "ddpkit",
        ],
        "--rdzv-endpoint localhost": [
            *run,
            "--nproc_per_node",
            "2",
            "--rdzv-endpoint",
            f"localhost:{port}",
            str(script),
            "run",
            flag,
            "plain",
        ],
        "--master localhost": [*run, "-n", "2", "--master", f"localhost:{port}", str(script), "run", flag, "ddpkit"],
    }
    return lines[how]


class Job:
    """A 2-process job of ``how`` in a UTS namespace, waiting at its ready flag until told to finish."""

    def __init__(self, how: str, directory: Path):
        self.script = directory / "waiter.py"
        self.script.write_text(WAITER)
        self.flag = str(directory / "flag")
        self.proc = subprocess.Popen(
            _in_container(_command(how, self.script, self.flag)),
            env=clean_env(),
            cwd=ROOT,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def ready(self) -> str:
        """The MASTER_PORT the workers were given, once rank 0 is ready."""
        deadline = time.monotonic() + 90
        while not Path(self.flag + ".ready").exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.proc.communicate()
            time.sleep(0.2)
        time.sleep(0.3)
        return Path(self.flag + ".ready").read_text()

    def finish(self) -> tuple[int, str]:
        Path(self.flag + ".done").write_text("done")
        _, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, err

    def kill(self) -> None:
        kill_tree(self.proc.pid)


@needs_uts
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "how",
    [
        "ddpkit run -n 2",
        "plain init_process_group",
        *(
            pytest.param(how, marks=pytest.mark.slow)
            for how in (
                "--master_addr/--master_port",
                "ddpkit.launch",
                "groups",
                "--rdzv-endpoint localhost",
                "--master localhost",
            )
        ),
    ],
)
def test_a_container_job_listens_on_loopback_only_and_a_squatted_port_changes_nothing(how, tmp_path):
    job = Job(how, tmp_path)
    try:
        published = job.ready()
        listening = _listening(psutil.Process(job.proc.pid))
        ports = {port for _, _, port in listening}
        assert len(ports) >= 2, listening  # gloo's: one per rank (and per group)
        assert {ip for _, ip, _ in listening} == {"127.0.0.1"}, listening
        assert [(h, p) for h in NETWORK for p in ports if _accepts(h, p)] == []
        with socket.create_server(("0.0.0.0", 0)) as control:  # the probe can tell: a wildcard socket accepts
            assert _accepts(NETWORK[0], control.getsockname()[1])
        if published:  # the port the agent published: nothing binds it later, so take it
            assert int(published) not in ports
            squatter = socket.create_server(("0.0.0.0", int(published)))
        else:
            squatter = None
        try:
            code, err = job.finish()
        finally:
            if squatter is not None:
                squatter.close()
        assert code == 0, err[-3000:]
        assert Path(job.flag + ".result").read_text() == "4.0"  # the group made after the squat worked
    finally:
        job.kill()


ATTACKER = r"""
import json, os, pickle, socket, sys, glob
marker, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]

class Boom:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))

payload = pickle.dumps(Boom())
report = {"connected": [], "files": {}}
for port in ports:
    for data in (payload, b"\x00" * 8 + payload, os.urandom(4096), (1).to_bytes(8, "little") + payload):
        with socket.socket() as s:
            s.settimeout(2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                report["connected"].append(port)
                try:
                    s.sendall(data)
                except OSError:
                    pass
for directory in glob.glob(os.path.join(os.environ.get("TMPDIR", "/tmp"), "ddpkit-job-*")):
    try:
        names = os.listdir(directory)
    except OSError as exc:
        report["files"][directory] = f"list: {type(exc).__name__}"
        names = ["rendezvous", "workers-0"]
    for name in names:
        try:
            with open(os.path.join(directory, name), "ab") as f:
                f.write(payload)
            report["files"][os.path.join(directory, name)] = "written"
        except OSError as exc:
            report["files"][os.path.join(directory, name)] = type(exc).__name__
print(json.dumps(report))
"""


STORE_PROBE = """
import datetime, os, sys, threading
import torch.distributed as dist
took = []

def probe(port):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=3),
                          wait_for_workers=False)
    store.set("probe", "1")
    if store.get("probe") == b"1":
        took.append(port)

threads = [threading.Thread(target=probe, args=(int(p),), daemon=True) for p in sys.argv[1:]]
for t in threads:
    t.start()
for t in threads:
    t.join(8)
print(" ".join(map(str, took)), flush=True)
os._exit(0)      # a client stuck on a socket that never answers (gloo's) cannot be joined
"""


def _stores_among(ports: list[int]) -> list[int]:
    """The ports on 127.0.0.1 where a c10d store takes keys (it would take them from any local user)."""
    probe = subprocess.run(
        [sys.executable, "-c", STORE_PROBE, *map(str, ports)],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    return [int(p) for p in probe.stdout.split()]


@needs_uts
@needs_other_uid
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_another_local_user_writing_every_port_and_store_file_runs_nothing_and_the_job_ends_normally(tmp_path):
    public = Path(tempfile.mkdtemp(prefix="ddpkit-attacker-"))
    try:
        public.chmod(0o755)
        attacker = public / "attacker.py"
        attacker.write_text(ATTACKER)
        attacker.chmod(0o644)
        marker = tmp_path / "pwned"  # only the job's user could create it here
        job = Job("groups", tmp_path)
        try:
            job.ready()
            ports = sorted({port for _, _, port in _listening(psutil.Process(job.proc.pid))})
            from ddpkit.distributed import stores as ddpkit_stores

            control = ddpkit_stores.serve("127.0.0.1", 0, timeout_s=30)  # the probe can tell a store
            stores = _stores_among([*ports, control.port])  # would take keys, from any uid
            attack = subprocess.run(
                ["runuser", "-u", "nobody", "--", NOBODY_PYTHON, str(attacker), str(marker), *map(str, ports)],
                capture_output=True,
                text=True,
                timeout=120,
                env={**clean_env(), "HOME": "/"},
                cwd="/",
            )
            assert attack.returncode == 0, attack.stderr[-2000:]
            report = json.loads(attack.stdout.strip().splitlines()[-1])
            assert report["connected"], report  # it did reach gloo's ports on loopback...
            assert stores == [control.port], stores  # ...but none of the job's is a store to write
            assert report["files"], report  # the job's private directory was found...
            assert "written" not in report["files"].values(), report  # ...and could not be written
            code, err = job.finish()
            assert code == 0, err[-3000:]
            assert Path(job.flag + ".result").read_text() == "4.0"
        finally:
            job.kill()
        time.sleep(0.5)
        assert not marker.exists()
    finally:
        shutil.rmtree(public, ignore_errors=True)


@pytest.mark.slow  # 10-16 s: make test-slow keeps make test under 15 minutes
@pytest.mark.timeout(120)
def test_doctor_says_where_a_run_listens_and_what_plain_torchrun_exposes(tmp_path):
    from helpers import ddpkit as ddpkit_cli

    facts = json.loads(ddpkit_cli("doctor", "--json").stdout)["facts"]
    assert facts["a run listens on"].startswith("127.0.0.1 only")
    assert facts["gloo/NCCL listen on"].startswith("127.0.0.1 (")
    script = tmp_path / "doctor.py"  # doctor inside a job started by plain torchrun, rank 0 reporting
    script.write_text(
        "import json, os, sys\nfrom ddpkit.cli.doctor import examine\n"
        "r = examine()\nif os.environ['RANK'] == '0': print(json.dumps(r.warnings))\n"
    )
    plain = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "1", str(script)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert (
        "started by plain torchrun: its agent's rendezvous and worker stores listen on every interface" in plain.stdout
    )
    ours = subprocess.run(
        [str(BIN / "ddpkit"), "run", "-n", "1", str(script)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert ours.returncode == 0 and "plain torchrun" not in ours.stdout, ours.stderr[-2000:]


@needs_uts
@pytest.mark.timeout(60)
def test_doctor_in_a_container_names_the_addresses_gloo_would_really_use():
    doctor = [str(BIN / "ddpkit"), "doctor", "--json"]
    inside = json.loads(
        subprocess.run(_in_container(doctor), env=clean_env(), capture_output=True, text=True, timeout=50).stdout
    )
    assert inside["facts"]["hostname resolves to"] == NETWORK[0]  # as in Docker
    assert inside["facts"]["a run listens on"].startswith("127.0.0.1 only")
    interface = _interface_of(NETWORK[0])
    told = json.loads(
        subprocess.run(
            _in_container(doctor),
            env=clean_env(GLOO_SOCKET_IFNAME=interface),
            capture_output=True,
            text=True,
            timeout=50,
        ).stdout
    )
    assert told["facts"]["gloo/NCCL listen on"] == f"{NETWORK[0]} ({interface})"
    assert any(f"GLOO_SOCKET_IFNAME={interface} makes gloo listen on {NETWORK[0]}" in w for w in told["warnings"])


def test_worker_variables_bind_loopback_on_one_machine_and_keep_the_users_own(monkeypatch):
    from ddpkit.distributed import host, stores

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    lo = host.loopback_interface()
    assert host.address_of(lo) == "127.0.0.1"
    assert stores.socket_env(1, "127.0.0.1", 0) == {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}
    assert stores.socket_env(1, "127.0.0.1", 0, {"GLOO_SOCKET_IFNAME": "eth9"}) == {"NCCL_SOCKET_IFNAME": "eth9"}


@needs_network
def test_between_nodes_gloo_binds_the_interface_of_the_route_to_the_master():
    from ddpkit.distributed import stores

    interface = _interface_of(NETWORK[0])
    assert stores.gloo_interface(2, NETWORK[0], 29500, {}) == (interface, NETWORK[0])


def test_the_private_directory_is_the_users_alone(tmp_path, monkeypatch):
    import stat

    from ddpkit.distributed import stores

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    old = os.umask(0o000)  # a permissive umask cannot widen it
    try:
        directory = stores.private_dir()
    finally:
        os.umask(old)
    info = os.stat(directory)
    assert info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700
    assert Path(directory).parent == tmp_path


def test_rank_0s_store_binds_the_master_address_unless_a_multi_node_name_is_loopback_here(monkeypatch):
    import torch.distributed as dist

    from ddpkit.distributed import process_group
    from ddpkit.distributed.environment import Environment

    served = []
    monkeypatch.setattr("ddpkit.distributed.stores.serve", lambda host, port, **kw: served.append(host) or "bound")
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **kw: "every interface")
    one_node = Environment(launcher="torchelastic", world_size=2, local_world_size=2, master_addr="127.0.0.1")
    assert process_group._serve(one_node, 5) == "bound" and served == ["127.0.0.1"]
    # /etc/hosts maps the node's own name to loopback, other nodes reach it at its network address
    two_nodes = Environment(launcher="slurm", world_size=4, local_world_size=2, master_addr="localhost")
    assert process_group._serve(two_nodes, 5) == "every interface"


def test_a_master_that_does_not_resolve_in_time_is_one_line(monkeypatch):
    from ddpkit.distributed.torchrun import resolve_master
    from ddpkit.errors import UsageError

    def slow(*args, **kwargs):
        time.sleep(30)  # then fails as a resolver would (the asker thread outlives the test)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    with pytest.raises(UsageError, match="did not answer within 0.2 s"):
        resolve_master("slow.example", 29500, timeout_s=0.2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "master, message",
    [
        ("[::1", "unbalanced brackets"),
        ("nohost.invalid:29500", "cannot be used"),
        (":29500", "has no host"),
        ("h:70000", "out of range"),
        ("[::1]]:5", "unbalanced brackets"),
        ("[fe80::1%lo]:29400", "no zone index"),
    ],
)
def test_bad_masters_fail_in_one_line_with_exit_2(monkeypatch, capsys, master, message):
    """In this process, in the environment a command gets (helpers.clean_env); the first case from the command too."""
    from ddpkit import cli
    from helpers import EXAMPLES

    for name in set(os.environ) - set(clean_env()):
        monkeypatch.delenv(name)
    command = ["run", "-n", "2", "--nnodes", "2", "--node-rank", "0", "--master", master, str(EXAMPLES / "hello.py")]
    code = cli.main(command)
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in stderr, stderr
    if master == "[::1":
        done = subprocess.run(
            [str(BIN / "ddpkit"), *command], env=clean_env(), capture_output=True, text=True, timeout=50
        )
        assert done.returncode == 2 and done.stderr.strip().splitlines() == lines, (done.stdout, done.stderr)


class _Boom:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_bytes_that_arrive_for_an_object_collective_never_build_anything_but_plain_data(tmp_path):
    import io

    import torch

    from ddpkit.distributed import collectives
    from ddpkit.errors import DdpkitError

    marker = tmp_path / "pwned"
    crafted = io.BytesIO()
    torch.save({"rng": _Boom(marker)}, crafted)  # what a peer, or an impostor on its port, could send
    with pytest.raises(DdpkitError, match=r"not plain data \(it needs builtins.getattr\); ddpkit refuses"):
        collectives._from_bytes(torch.frombuffer(bytearray(crafted.getvalue()), dtype=torch.uint8))
    assert not marker.exists()
    with pytest.raises(TypeError, match="only tensors, numbers, strings"):
        collectives._to_bytes({"rng": _Boom(marker)})  # refused before it is sent
    plain = {"torch": torch.arange(3), "python": [3, (1, 2), None], "name": "x", "lr": 0.1}
    back = collectives._from_bytes(collectives._to_bytes(plain))
    assert torch.equal(back["torch"], plain["torch"]) and back["python"] == [3, (1, 2), None] and back["lr"] == 0.1


def test_raw_bytes_is_numpys_tobytes_for_any_layout_and_reads_no_element_in_python(monkeypatch):
    """``_tensors.raw_bytes`` carries every object between ranks and the bench's weights digest. It
    once read a storage one element at a time in Python (``bytes(storage)``): 115 s for ResNet-18's
    weights, most of a bench row. A storage's ``__getitem__`` that raises proves it is not called."""
    import numpy as np
    import torch

    from ddpkit._tensors import raw_bytes

    def _element_read(self, index):
        raise AssertionError("raw_bytes read a storage element in Python")

    monkeypatch.setattr(torch.UntypedStorage, "__getitem__", _element_read)
    big = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    cases = [
        big,
        big[:, ::3],  # strided view
        big[2:4],  # a view at an offset into a larger storage
        big.t(),  # transposed
        torch.tensor(3.5, dtype=torch.float64),  # zero-dimensional
        torch.arange(6, dtype=torch.bfloat16),  # a dtype numpy lacks
        torch.empty(5, 0),  # no elements
    ]
    for tensor in cases:
        expected = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert raw_bytes(tensor) == expected, tuple(tensor.shape)
    assert raw_bytes(big[2:4]) == np.arange(16, 32, dtype=np.float32).tobytes()
    assert len(raw_bytes(torch.zeros(3_000_000))) == 12_000_000
