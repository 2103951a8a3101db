"""A fault-tolerant job that no one else can steer, poison or read, tried as an attacker would.

- The heal transport: requests and payloads signed with the job's secret; a forged, replayed,
  relayed, oversized or inflated payload is refused in one line before anything of it is loaded.
- One machine: another user (``setpriv`` to uid 65534, where the tests run as root) scans every
  port on loopback while a job trains, and calls torchft's ``Kill``, ``Quorum`` and heartbeat, the
  lighthouse's dashboard kill and the heal servers on each; none answers, the job's files are
  closed to it, and the job ends where an unattacked run ends, with no replica restarted.
- Across hosts (network namespaces, ``slow``): a third host forges a ``Quorum`` at every manager,
  naming its own server, which serves a forged state; the replicas refuse it in one line and the
  job ends where an unattacked run ends.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch

from helpers import BIN, ROOT, clean_env, kill_tree, run

pytest.importorskip("torchft", reason="the fault-tolerant mode needs torchft (pip install 'ddpkit[ft]')")

from ddpkit.distributed import ft, ft_control, ft_heal, ft_proxies  # noqa: E402

SCRIPT = str(ROOT / "tests" / "scripts" / "ft_train.py")
SECRET = b"0123456789abcdef0123456789abcdef"


def _state(step: int) -> dict:
    return {"user": {"w": torch.arange(6.0).view(2, 3) + step}, "torchft": {"step": step, "batches_committed": 0}}


@pytest.fixture
def pair():
    sender = ft_heal.transport("127.0.0.1", timedelta(seconds=5), SECRET, name="sender")
    receiver = ft_heal.transport("127.0.0.1", timedelta(seconds=5), SECRET, name="receiver")
    yield sender, receiver
    sender.shutdown()
    receiver.shutdown()


def _get(url: str, headers: dict | None = None) -> tuple[int, float]:
    import urllib.error
    import urllib.request

    started = time.monotonic()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as answer:
            return answer.status, time.monotonic() - started
    except urllib.error.HTTPError as exc:
        return exc.code, time.monotonic() - started


# -- the heal transport ------------------------------------------------------------------------------
def test_a_signed_state_round_trips_and_an_unsigned_request_is_refused_at_once(pair):
    sender, receiver = pair
    assert sender._server.server_address[0] == "127.0.0.1"
    got: list = []
    # the peer asks before the state is staged: its (signed) request waits for it
    thread = threading.Thread(
        target=lambda: got.append(receiver.recv_checkpoint(0, sender.metadata(), 7, timedelta(seconds=10)))
    )
    thread.start()
    time.sleep(0.3)
    sender.send_checkpoint([1], 7, _state(7), timedelta(seconds=10))
    thread.join(15)
    assert torch.equal(got[0]["user"]["w"], _state(7)["user"]["w"]) and receiver.refused == 0
    # anyone without the secret: 403 at once, for the step served and for a future one (nothing parks)
    for step in (7, 8):
        status, seconds = _get(f"{sender.metadata()}{step}")
        assert status == 403 and seconds < 5.0  # not parked for the 10 s a step waits
    status, _ = _get(f"{sender.metadata()}7", {"X-Ddpkit-Auth": "00:" + "0" * 64})
    assert status == 403


def test_a_request_signed_for_another_server_or_seen_before_gets_nothing(pair):
    sender, receiver = pair
    sender.send_checkpoint([1], 3, _state(3), timedelta(seconds=5))
    # what a peer signed for the attacker's URL (a forged checkpoint address), relayed to the real server
    relayed = ft_heal._mac(SECRET, b"GET", b"http://127.0.0.1:9/checkpoint/3", b"n1")
    assert _get(f"{sender.metadata()}3", {"X-Ddpkit-Auth": f"n1:{relayed}"})[0] == 403
    genuine = ft_heal._mac(SECRET, b"GET", f"{sender.metadata()}3".encode(), b"n2")
    assert _get(f"{sender.metadata()}3", {"X-Ddpkit-Auth": f"n2:{genuine}"})[0] == 200
    assert _get(f"{sender.metadata()}3", {"X-Ddpkit-Auth": f"n2:{genuine}"})[0] == 403  # replayed


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['DDPKIT_TEST_MARKER']}",))


def _hostile(body: bytes, mac: str = "") -> http.server.ThreadingHTTPServer:
    class Hostile(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            if mac:
                self.send_header("X-Ddpkit-Mac", mac)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_forged_state_is_refused_in_one_line_before_anything_of_it_is_loaded(tmp_path, monkeypatch, capfd):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("DDPKIT_TEST_MARKER", str(marker))
    forged = io.BytesIO()
    torch.save({"user": _Payload(), "torchft": {"step": 3}}, forged, pickle_module=pickle)
    loads: list = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or {})
    receiver = ft_heal.transport("127.0.0.1", timedelta(seconds=5), SECRET, name="replica 1")
    other_job = hashlib.sha256(b"another secret").hexdigest().encode()
    servers = [_hostile(forged.getvalue()), _hostile(forged.getvalue(), mac="0" * 64)]
    try:
        for server in servers:
            url = f"http://127.0.0.1:{server.server_address[1]}/checkpoint/"
            with pytest.raises(ft_heal.HealRefused, match="not signed with this job's secret"):
                receiver.recv_checkpoint(0, url, 3, timedelta(seconds=5))
    finally:
        receiver.shutdown()
        for server in servers:
            server.shutdown()
    assert not loads and not marker.exists() and receiver.refused == 2 and other_job
    said = [line for line in capfd.readouterr().err.splitlines() if "refused the state" in line]
    assert len(said) == 2 and all(
        line.startswith("ddpkit: fault-tolerant replica 1: refused the state offered at http://127.0.0.1:")
        and line.endswith("this step is redone")
        for line in said
    )


def _signing(state: dict) -> http.server.ThreadingHTTPServer:
    """A server holding the job's secret (a replica the quorum named) that signs whatever it serves."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    body = buffer.getvalue()

    class Signing(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            nonce = self.headers["X-Ddpkit-Auth"].partition(":")[0]
            url = f"http://127.0.0.1:{self.server.server_address[1]}{self.path}"
            mac = ft_heal._mac(
                SECRET, b"STATE", url.encode(), nonce.encode(), hashlib.sha256(body).hexdigest().encode()
            )
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Ddpkit-Mac", mac)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Signing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_quorum_that_names_a_step_the_source_is_not_at_gets_no_state(pair, capfd):
    """A forged Quorum makes a replica the source of a step it never reached: it serves nothing, and
    a state signed with the job's secret but of another step than the quorum's is refused too."""
    sender, receiver = pair
    sender.send_checkpoint([1], 10**9, _state(40), timedelta(seconds=5))  # asked for 10**9, at 40
    with pytest.raises(ft_heal.HealRefused, match="HTTP 404"):
        receiver.recv_checkpoint(0, sender.metadata(), 10**9, timedelta(seconds=2))
    assert "not serving its state as step 1000000000: it is at step 40" in capfd.readouterr().err
    server = _signing(_state(40))
    try:
        with pytest.raises(ft_heal.HealRefused, match="it is of step 40, the quorum named step 41"):
            receiver.recv_checkpoint(
                0, f"http://127.0.0.1:{server.server_address[1]}/checkpoint/", 41, timedelta(seconds=5)
            )
        assert (
            receiver.recv_checkpoint(
                0, f"http://127.0.0.1:{server.server_address[1]}/checkpoint/", 40, timedelta(seconds=5)
            )["torchft"]["step"]
            == 40
        )
    finally:
        server.shutdown()


def test_a_state_larger_than_this_replica_allows_is_not_read(capfd):
    sender = ft_heal.transport("127.0.0.1", timedelta(seconds=5), SECRET)
    receiver = ft_heal.transport("127.0.0.1", timedelta(seconds=5), SECRET, limit=lambda: 1000)
    try:
        sender.send_checkpoint(
            [1], 5, {"user": {"w": torch.zeros(10_000)}, "torchft": {"step": 5}}, timedelta(seconds=5)
        )
        with pytest.raises(ft_heal.HealRefused, match=r"declares \d+ bytes, more than 1000"):
            receiver.recv_checkpoint(0, sender.metadata(), 5, timedelta(seconds=5))
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_a_signed_state_that_declares_more_memory_than_it_holds_is_refused(pair, monkeypatch):
    from test_memory_bounds import inflated

    sender, receiver = pair
    bomb = inflated(64 << 20)
    loads: list = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or {})
    monkeypatch.setattr(torch, "save", lambda state, buffer: buffer.write(bomb))  # a peer that sends it
    sender.send_checkpoint([1], 2, _state(2), timedelta(seconds=5))
    with pytest.raises(ft_heal.HealRefused, match="is compressed"):
        receiver.recv_checkpoint(0, sender.metadata(), 2, timedelta(seconds=5))
    assert not loads


class _Manager:
    def __init__(self):
        self.step = 0

    def current_step(self):
        return self.step

    def start_quorum(self):
        pass

    def participating_rank(self):
        return 0

    def num_participants(self):
        return 2


def test_three_refused_heals_in_a_row_stop_the_replica_with_one_line():
    from ddpkit.errors import DdpkitError

    replica = object.__new__(ft.Replica)
    replica.__dict__.update(
        index=1,
        _job_where=None,
        _job=None,
        _manager=_Manager(),
        healed=False,
        _in_quorum=False,
        first_quorum=None,
        before_stop=None,
        transport=type("T", (), {"refused": 2})(),
    )
    replica.quorum()  # two in a row: it goes on
    replica._in_quorum = False  # (its step committed)
    replica.transport.refused = 3
    with pytest.raises(DdpkitError) as stopped:
        replica.quorum()
    assert "refused 3 heal payloads in a row" in str(stopped.value) and "\n" not in str(stopped.value)


@pytest.mark.parametrize(
    "mode, says", [(0o644, "is open to others (mode 644"), (None, "cannot be read"), (0o600, "holds 3 bytes")]
)
def test_a_secret_file_others_can_read_or_too_short_is_one_line(tmp_path, mode, says):
    from ddpkit.errors import UsageError

    path = tmp_path / "secret"
    if mode is not None:
        path.write_text("abc" if mode == 0o600 else SECRET.decode())
        path.chmod(mode)
    with pytest.raises(UsageError) as refused:
        ft_heal.read_secret(str(path))
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_quorum_naming_a_store_that_is_not_the_jobs_is_refused(tmp_path):
    store, client = ft_proxies.file_stores(str(tmp_path))
    ours = client(f"{ft_control.STORE_HOST}:3/torchft/7/0", timedelta(seconds=5))
    ours.set("k", "v")
    assert (tmp_path / "replica-store-3").is_file()
    for forged in ("127.0.0.1:29500/torchft/7/0", "evil.example:1/x", f"{ft_control.STORE_HOST}:x/y"):
        with pytest.raises(RuntimeError, match="not one of this job's"):
            client(forged, timedelta(seconds=5))


# -- one machine: another user of it ------------------------------------------------------------------
_ATTACK = r'''
import datetime, importlib.util, json, os, socket, sys, urllib.request, urllib.error

so, private, ports = sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3].split(",") if p]
spec = importlib.util.spec_from_file_location("_torchft", so)
tft = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tft)
second = datetime.timedelta(seconds=1)
found = {"ports": ports, "manager": [], "lighthouse": [], "dashboard": [], "heal": [], "files": [], "killed": []}


def h2_kill(port):
    """torchft's ManagerService/Kill over HTTP/2 by hand: what the Rust server answers with exit(1)."""
    def frame(kind, flags, stream, payload):
        return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload
    def literal(name, value):
        return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value
    headers = b"".join(literal(n, v) for n, v in [(b":method", b"POST"), (b":scheme", b"http"),
        (b":path", b"/torchft.ManagerService/Kill"), (b":authority", f"127.0.0.1:{port}".encode()),
        (b"content-type", b"application/grpc"), (b"te", b"trailers")])
    message = b"\x0a\x05owned"
    body = b"\x00" + len(message).to_bytes(4, "big") + message
    with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b"") + frame(1, 4, 1, headers)
                     + frame(0, 1, 1, body))
        answer = b""
        try:                    # read until the server closes: the call is not cancelled half-handled
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:
            pass
        return answer


def probe(port):
    address = f"http://127.0.0.1:{port}"
    try:
        client = tft.ManagerClient(address, connect_timeout=second)
        client._checkpoint_metadata(0, timeout=second)
        found["manager"].append(port)
    except Exception as exc:
        if "InvalidArgument" in str(exc):
            found["manager"].append(port)           # a manager's own answer: "rank not found"
    try:
        tft.LighthouseClient(address, connect_timeout=second).heartbeat("attacker", timeout=second)
        found["lighthouse"].append(port)
    except Exception:
        pass
    for path, method in (("/status", "GET"), ("/replica/replica_0/kill", "POST")):
        try:
            with urllib.request.urlopen(urllib.request.Request(address + path, method=method), timeout=1) as a:
                if a.status == 200:
                    found["dashboard"].append(port)
        except Exception:
            pass
    for step in (0, 7, 10**6):
        try:
            with urllib.request.urlopen(f"{address}/checkpoint/{step}", timeout=1) as a:
                found["heal"].append(port)
        except Exception:
            pass
    try:
        h2_kill(port)
    except OSError:
        pass


import concurrent.futures
with concurrent.futures.ThreadPoolExecutor(32) as pool:        # every port at once: a scan takes seconds
    list(pool.map(probe, ports))
for name in ("", "control.sock", "secret", "job-store", "replica-store-1"):
    try:
        if name == "control.sock":
            s = socket.socket(socket.AF_UNIX)
            s.connect(os.path.join(private, name))
        elif name:
            open(os.path.join(private, name), "rb").read(1)
        else:
            os.listdir(private)
        found["files"].append(name or "(listing)")
    except OSError:
        pass
print(json.dumps(found))
'''


def _attacker_python() -> str | None:
    """A Python that another user can run and that loads torchft's extension (this one's ABI)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if not os.access(candidate, os.X_OK):
            continue
        version = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True
        ).stdout.strip()
        if version == str(sys.version_info[:2]):
            return candidate
    return None


def _torchft_extension() -> str:
    import torchft

    return str(next(Path(torchft.__file__).parent.glob("_torchft*.so")))


needs_other_user = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or _attacker_python() is None,
    reason="another user's attack needs root (setpriv to uid 65534) and a system Python of this Python's version",
)


def _as_nobody(*args: str) -> dict:
    # a world-readable working directory; the attacker gets no environment of ours
    done = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "env",
            "-i",
            "HOME=/tmp",
            "RUST_LOG=off",
            _attacker_python() or "",
            "-c",
            _ATTACK,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd="/tmp",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _loopback_ports() -> list[int]:
    """Every TCP port listening on this namespace's loopback or wildcard, as /proc shows any user."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return sorted(ports)


@needs_other_user
def test_the_attacker_finds_torchft_where_it_listens_on_loopback():
    """The probe below is not empty-handed by construction: a lighthouse and a manager left on
    127.0.0.1 (torchft's own way, bound to loopback) are found, and the Kill reaches the manager."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            """
import datetime, sys, time
from torchft._torchft import LighthouseServer, ManagerServer
lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[-1]
manager = ManagerServer(replica_id="r", lighthouse_addr=address, hostname="127.0.0.1", bind="127.0.0.1:0",
                        store_addr="127.0.0.1:1", world_size=1, heartbeat_interval=datetime.timedelta(seconds=1),
                        connect_timeout=datetime.timedelta(seconds=5), quorum_retries=0)
print(address.rsplit(":", 1)[-1], manager.address().rsplit(":", 1)[-1], flush=True)
time.sleep(120)
""",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RUST_LOG": "off"},
        start_new_session=True,
    )
    try:
        lighthouse, manager = (int(p) for p in child.stdout.readline().split())
        found = _as_nobody(_torchft_extension(), "/nonexistent", f"{lighthouse},{manager}")
        assert found["lighthouse"] == [lighthouse] and manager in found["manager"], found
        assert lighthouse in found["dashboard"], found
        child.wait(timeout=30)  # torchft's Kill: the manager's process exited
        assert child.returncode == 1
    finally:
        kill_tree(child.pid)


def _job_family(launcher: int) -> list[psutil.Process]:
    return [psutil.Process(launcher), *psutil.Process(launcher).children(recursive=True)]


@needs_other_user
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_another_user_can_neither_reach_nor_read_a_one_machine_job(tmp_path):
    reference = tmp_path / "single"
    reference.mkdir()
    done = run(
        [str(BIN / "python"), SCRIPT, "--out", str(reference), "--epochs", "1"],
        timeout=200,
        env=clean_env(),
        cwd=ROOT / "tests" / "scripts",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "attacked"
    out.mkdir()
    job = subprocess.Popen(
        [
            str(BIN / "ddpkit"),
            "run",
            "--fault-tolerant",
            "-n",
            "2",
            "--max-restarts",
            "2",
            SCRIPT,
            "--out",
            str(out),
            "--epochs",
            "1",
            "--step-sleep",
            "0.4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        cwd=ROOT / "tests" / "scripts",
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and len(_steps(out)) < 4:
            time.sleep(0.2)
        assert len(_steps(out)) >= 4, "the job did not start training"
        family = _job_family(job.pid)
        control = [p for p in family if "ft_control" in " ".join(p.cmdline())]
        assert len(control) == 1
        here = os.readlink("/proc/self/ns/net")
        assert os.readlink(f"/proc/{control[0].pid}/ns/net") != here  # a network namespace of its own
        listening = [
            c.laddr
            for p in family
            if os.readlink(f"/proc/{p.pid}/ns/net") == here
            for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        assert listening and all(addr.ip in ("127.0.0.1", "::1") for addr in listening), listening
        private = next(p for p in family if p.environ().get(ft_control.CONTROL_ENV)).environ()[ft_control.CONTROL_ENV]
        found = _as_nobody(_torchft_extension(), private, ",".join(map(str, _loopback_ports())))
        _, err = job.communicate(timeout=200)
    finally:
        kill_tree(job.pid)
    assert job.returncode == 0, err[-3000:]
    assert {addr.port for addr in listening} <= set(found["ports"]), found  # it tried every one of them
    assert found["manager"] == found["lighthouse"] == found["dashboard"] == found["heal"] == [], found
    assert found["files"] == [], found
    events = [json.loads(line) for path in out.glob("events-*.jsonl") for line in path.read_text().splitlines()]
    assert {row["attempt"] for row in events} == {0}  # nothing killed, nothing restarted
    mine, theirs = (torch.load(d / "weights.pt", weights_only=True) for d in (out, reference))
    scale = max(float(v.abs().max()) for v in theirs.values() if v.is_floating_point())
    assert (
        max(float((mine[k] - theirs[k]).abs().max()) for k in theirs if theirs[k].is_floating_point()) <= 1e-5 * scale
    )


def _steps(out: Path) -> list[dict]:
    rows = []
    for path in out.glob("events-*.jsonl"):
        rows += [json.loads(line) for line in path.read_text().splitlines() if '"step"' in line]
    return [row for row in rows if row["kind"] == "step"]


# -- across hosts: a third host on the job's network ---------------------------------------------------
_FORGE = r"""
import datetime, http.server, io, json, sys, threading, torch
from torchft._torchft import ManagerClient

me, targets = sys.argv[1], json.loads(sys.argv[2])
forged = io.BytesIO()
torch.save({"user": {}, "torchft": {"step": 10**9, "batches_committed": 0}}, forged)
body, fetched = forged.getvalue(), []


class Forged(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        fetched.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Ddpkit-Mac", "0" * 64)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


server = http.server.ThreadingHTTPServer((me, 0), Forged)
threading.Thread(target=server.serve_forever, daemon=True).start()
metadata = f"http://{me}:{server.server_address[1]}/checkpoint/"
answered = []


def forge(address):
    try:
        client = ManagerClient(address, connect_timeout=datetime.timedelta(seconds=2))
        client._quorum(group_rank=0, step=10**9, checkpoint_metadata=metadata, shrink_only=False,
                       timeout=datetime.timedelta(seconds=20), commit_failures=0, init_sync=False)
        answered.append(address)
    except Exception:
        pass


import time
threads = []
for _ in range(int(sys.argv[3])):          # rounds of forged calls, until one reaches a healing replica
    for host, ports in targets.items():
        for port in ports:
            threads.append(threading.Thread(target=forge, args=(f"http://{host}:{port}",), daemon=True))
            threads[-1].start()
    time.sleep(0.7)
    if fetched:
        break
for thread in threads:
    thread.join()
time.sleep(2)
print(json.dumps({"answered": answered, "fetched": fetched}))
"""


def _ports_in(namespace: str) -> list[int]:
    table = subprocess.run(
        ["ip", "netns", "exec", namespace, "cat", "/proc/net/tcp"], capture_output=True, text=True, check=True
    ).stdout
    return sorted(
        {int(line.split()[1].rsplit(":", 1)[1], 16) for line in table.splitlines()[1:] if line.split()[3] == "0A"}
    )


needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="simulated hosts need root and iproute2 (`ip`, `tc`) for network namespaces",
)


@needs_netns
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_forged_quorum_from_another_host_cannot_choose_what_the_replicas_load(tmp_path):
    from ddpkit.bench.netsim import SimulatedHosts

    reference = tmp_path / "single"
    reference.mkdir()
    done = run(
        [str(BIN / "python"), SCRIPT, "--out", str(reference), "--epochs", "1"],
        timeout=200,
        env=clean_env(),
        cwd=ROOT / "tests" / "scripts",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "hosts"
    out.mkdir()
    secret = out / "secret"
    ft_heal.write_secret(str(secret))
    with SimulatedHosts(3, 1000.0) as sim:
        master = f"{sim.addresses[0]}:29600"
        nodes = [
            sim.popen(
                host,
                [
                    str(BIN / "ddpkit"),
                    "run",
                    "--fault-tolerant",
                    "-n",
                    "1",
                    "--max-restarts",
                    "1",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(host),
                    "--master",
                    master,
                    "--secret-file",
                    str(secret),
                    SCRIPT,
                    "--out",
                    str(out),
                    "--epochs",
                    "1",
                    "--step-sleep",
                    "0.3",
                ],
                env=clean_env(),
                cwd=ROOT / "tests" / "scripts",
                stdout=open(out / f"node{host}.log", "w"),
                stderr=subprocess.STDOUT,
            )
            for host in range(2)
        ]
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and len(_steps(out)) < 8:
            time.sleep(0.2)
        assert len(_steps(out)) >= 8, (out / "node0.log").read_text()[-3000:]
        # one host's manager claims a step far ahead: the other replica must heal from whatever it names
        targets = {sim.addresses[1]: _ports_in(sim.namespaces[1])}
        attacker = sim.popen(
            2,
            [str(BIN / "python"), "-c", _FORGE, sim.addresses[2], json.dumps(targets), "10"],
            env={"RUST_LOG": "off"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        said, err = attacker.communicate(timeout=120)
        codes = [node.wait(timeout=300) for node in nodes]
    logs = "\n".join((out / f"node{host}.log").read_text() for host in range(2))
    assert codes == [0, 0], logs[-4000:]
    found = json.loads(said.strip().splitlines()[-1])
    assert found["answered"], (found, err[-2000:])  # the managers took the forged Quorum...
    refusals = [
        line
        for line in logs.splitlines()
        if "(a forged quorum call?)" in line
        or "refused the state offered at" in line
        or "could not fetch the state" in line
    ]
    assert refusals, logs[-4000:]  # ...and every heal it led to was refused
    assert all(line.startswith("ddpkit: fault-tolerant replica ") for line in refusals), refusals
    mine, theirs = (torch.load(d / "weights.pt", weights_only=True) for d in (out, reference))
    scale = max(float(v.abs().max()) for v in theirs.values() if v.is_floating_point())
    assert (
        max(float((mine[k] - theirs[k]).abs().max()) for k in theirs if theirs[k].is_floating_point()) <= 1e-5 * scale
    )


def test_the_control_plane_gets_a_namespace_of_its_own_or_says_why_not(tmp_path):
    from ddpkit.distributed import stores

    for isolate in (True, False):
        directory = stores.private_dir()
        try:
            child, lighthouse, refused = ft_control.start(directory, 1, 1000, 100, 1000, isolate=isolate)
            try:
                inside = os.readlink(f"/proc/{child.pid}/ns/net") != os.readlink("/proc/self/ns/net")
                assert lighthouse.startswith("http://127.0.0.1:")
                if isolate and not ft_control.namespace_refusal():
                    assert refused == "" and inside
                if not isolate:
                    assert refused == "not asked" and not inside
                    port = int(lighthouse.rsplit(":", 1)[-1])
                    assert port in _loopback_ports()  # on this machine's loopback: what doctor warns of
            finally:
                kill_tree(child.pid)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
