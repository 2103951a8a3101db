"""Simulated hosts: real namespaces, a bridge and tbf-shaped veths; clean-up on every way out.

Tests that make namespaces need root and iproute2 and skip without them; argument checks and the
messages for a missing root or iproute2 run everywhere.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from ddpkit.bench import netns, netsim
from ddpkit.bench.netsim import NetsimError, SimulatedHosts, check_available, leftovers, remove_leftovers
from ddpkit.errors import UsageError
from helpers import clean_env

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="simulated hosts need root and iproute2 (`ip`, `tc`) for network namespaces and tbf",
)

NOTHING = {"namespaces": [], "links": []}
PORT = 5000  # every namespace is fresh: no other listener can hold it

SERVER = textwrap.dedent("""
    import socket, sys, threading
    srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("listening", flush=True)
    counts, threads = [], []
    def drain(conn):
        n = 0
        while data := conn.recv(1 << 16):
            n += len(data)
        counts.append(n)
    for _ in range(int(sys.argv[3])):
        threads.append(threading.Thread(target=drain, args=(srv.accept()[0],)))
        threads[-1].start()
    for thread in threads:
        thread.join()
    print(*sorted(counts), flush=True)
""")

CLIENT = textwrap.dedent("""
    import socket, sys
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30) as sock:
        sock.sendall(bytes(int(sys.argv[3])))
""")

OWNER = textwrap.dedent("""
    import sys, time
    from ddpkit.bench.netsim import SimulatedHosts
    with SimulatedHosts(2, 10, tag=sys.argv[1]) as sim:
        sleeps = [sim.popen(host, ["sleep", "300"]) for host in range(2)]
        print("ready", *[proc.pid for proc in sleeps], flush=True)
        time.sleep(300)
""")

_numbers = itertools.count()


@pytest.fixture
def tag():
    """A short tag of this test alone; whatever it left is removed (and must be removable)."""
    name = f"t{os.getpid() % 10000}{next(_numbers)}"
    yield name
    remove_leftovers(name)
    assert leftovers(name) == NOTHING


def _rate_bits(text: str) -> float:
    value, unit = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)bit", text).groups()
    return float(value) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[unit]


def _sections(text: str) -> dict[tuple[int, str], str]:
    """qdiscs() output as {(host, "upload" | "download"): tc's text for that end}."""
    found = re.findall(r"^host (\d+) (upload|download) \([^)]*\):\n(.*?)(?=^host \d+ |\Z)", text, re.M | re.S)
    return {(int(host), way): body for host, way, body in found}


def _stats(body: str) -> tuple[int, int]:
    sent, overlimits = re.search(r"Sent (\d+) bytes \d+ pkt \(dropped \d+, overlimits (\d+)", body).groups()
    return int(sent), int(overlimits)


def _python(sim: SimulatedHosts, host: int, code: str, *args: object) -> subprocess.Popen:
    return sim.popen(host, [sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE, text=True)


def _transfer(sim: SimulatedHosts, senders: list[int], receiver: int, size: int) -> None:
    """Each of ``senders`` sends ``size`` bytes over TCP to ``receiver``, which counts them."""
    server = _python(sim, receiver, SERVER, sim.addresses[receiver], PORT, len(senders))
    assert server.stdout.readline().strip() == "listening"
    clients = [_python(sim, host, CLIENT, sim.addresses[receiver], PORT, size) for host in senders]
    out, _ = server.communicate(timeout=30)
    assert out.split() == [str(size)] * len(senders)
    assert [client.wait(timeout=30) for client in clients] == [0] * len(senders)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # our PID 1 may never reap it
    except psutil.NoSuchProcess:
        return True


# -- arguments and availability: no namespaces needed ---------------------------------------------


@pytest.mark.parametrize(
    "hosts, link_mbit, tag",
    [
        (0, 10, "a"),
        (255, 10, "a"),
        (1.5, 10, "a"),
        (True, 10, "a"),
        (2, 0, "a"),
        (2, -1, "a"),
        (2, math.nan, "a"),
        (2, math.inf, "a"),
        (2, 1e-9, "a"),
        (2, 10, "bad-tag"),
        (2, 10, "x" * 10),
        (2, 10, ""),
    ],
)
def test_bad_arguments_are_one_line_errors(hosts, link_mbit, tag):
    with pytest.raises(NetsimError) as caught:
        SimulatedHosts(hosts, link_mbit, tag=tag)
    assert isinstance(caught.value, UsageError)
    assert "\n" not in str(caught.value) and str(caught.value)


def test_without_root_one_line_names_root(monkeypatch):
    monkeypatch.setattr(netsim.os, "geteuid", lambda: 1000)
    with pytest.raises(NetsimError) as caught:
        check_available()
    message = str(caught.value)
    assert "\n" not in message and "root" in message and "--hosts" in message


def test_without_iproute2_one_line_names_it(monkeypatch):
    monkeypatch.setattr(netsim.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netsim.shutil, "which", lambda name: None)
    with pytest.raises(NetsimError) as caught:
        check_available()
    message = str(caught.value)
    assert "\n" not in message and "iproute2" in message and "`ip` and `tc`" in message


def test_env_points_every_backend_at_the_shaped_interface():
    sim = SimulatedHosts(3, 10, tag="a")
    assert sim.addresses == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
    assert sim.env(2) == {
        "GLOO_SOCKET_IFNAME": sim.interface,
        "NCCL_SOCKET_IFNAME": sim.interface,
        "TP_SOCKET_IFNAME": sim.interface,
    }
    with pytest.raises(NetsimError):
        sim.env(3)
    with pytest.raises(NetsimError):
        sim.popen(0, ["true"])  # not open


# -- real namespaces -----------------------------------------------------------------------------


@needs_netns
def test_check_available_passes_here():
    check_available()
    assert not [ns for ns in leftovers()["namespaces"] if ns.endswith(f"-{os.getpid()}-probe")]


@needs_netns
@pytest.mark.timeout(60)
def test_two_hosts_talk_over_links_shaped_both_ways(tag):
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with SimulatedHosts(2, 2.5, tag=tag) as sim:
        assert leftovers(tag) == {
            "namespaces": [f"ddpk-{tag}-h0", f"ddpk-{tag}-h1"],
            "links": sorted([f"dkbr{tag}", f"dk{tag}h0", f"dk{tag}h1"]),
        }
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) != handlers
        _transfer(sim, [0], 1, 1000)
        sections = _sections(sim.qdiscs())
        assert sorted(sections) == [(0, "download"), (0, "upload"), (1, "download"), (1, "upload")]
        for body in sections.values():
            assert "qdisc tbf" in body
            assert _rate_bits(re.search(r"rate (\S+)", body).group(1)) == 2.5e6
    assert leftovers(tag) == NOTHING
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    sim.close()  # a second close does nothing


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(60)
@pytest.mark.parametrize("link_mbit", [100, 1000])
def test_high_rates_are_set_exactly(tag, link_mbit):
    with SimulatedHosts(1, link_mbit, tag=tag) as sim:
        for body in _sections(sim.qdiscs()).values():
            assert _rate_bits(re.search(r"rate (\S+)", body).group(1)) == link_mbit * 1e6


@needs_netns
@pytest.mark.timeout(60)
def test_processes_get_the_environment_and_run_inside_their_host(tag):
    with SimulatedHosts(2, 10, tag=tag) as sim:
        code = (
            "import os, socket; print(os.environ['GLOO_SOCKET_IFNAME'], os.environ['EXTRA'], "
            "sorted(socket.if_nameindex())[-1][1])"
        )
        proc = sim.popen(1, [sys.executable, "-c", code], env={"EXTRA": "x"}, stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate(timeout=30)
        assert out.split() == [sim.interface, "x", sim.interface]
        addr = sim.popen(
            1, ["ip", "-o", "addr", "show", "dev", sim.interface], stdout=subprocess.PIPE, text=True
        ).communicate(timeout=30)[0]
        assert f"inet {sim.addresses[1]}/24" in addr
        assert "inet6" not in addr  # IPv4 only: nothing else for gloo to bind


@needs_netns
@pytest.mark.timeout(60)
def test_upload_is_shaped(tag):
    payload = 1_000_000  # about 1 s at 8 Mbit/s
    with SimulatedHosts(2, 8, tag=tag) as sim:
        _transfer(sim, [0], 1, payload)
        sections = _sections(sim.qdiscs(stats=True))
        sent, overlimits = _stats(sections[0, "upload"])
        assert sent >= payload and overlimits > 0  # host 0's upload held the data back
        assert _stats(sections[1, "download"])[0] >= payload  # and it went through host 1's download


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(60)
def test_download_is_shaped(tag):
    payload = 500_000  # two senders at 8 Mbit/s each into one 8 Mbit/s download
    with SimulatedHosts(3, 8, tag=tag) as sim:
        _transfer(sim, [0, 2], 1, payload)
        sections = _sections(sim.qdiscs(stats=True))
        sent, overlimits = _stats(sections[1, "download"])
        assert sent >= 2 * payload and overlimits > 0
        assert _stats(sections[0, "upload"])[0] >= payload and _stats(sections[2, "upload"])[0] >= payload


@needs_netns
@pytest.mark.timeout(60)
def test_an_exception_in_the_block_still_cleans_up(tag):
    with pytest.raises(ValueError, match="boom"):
        with SimulatedHosts(2, 10, tag=tag) as sim:
            sleeper = sim.popen(0, ["sleep", "300"])
            raise ValueError("boom")
    assert sleeper.returncode == -signal.SIGTERM
    assert leftovers(tag) == NOTHING
    with pytest.raises(NetsimError):
        sim.popen(0, ["true"])


@needs_netns
@pytest.mark.timeout(60)
def test_a_failing_step_removes_what_was_made(tag, monkeypatch):
    real_run = netsim._run

    def failing(cmd):
        if "tbf" in cmd and f"dk{tag}h1" in cmd:
            raise NetsimError(f"`{' '.join(cmd)}` failed: refused for the test")
        return real_run(cmd)

    monkeypatch.setattr(netsim, "_run", failing)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(NetsimError, match="refused for the test") as caught:
        with SimulatedHosts(2, 10, tag=tag):
            pytest.fail("the block must not run")
    assert "\n" not in str(caught.value)
    assert leftovers(tag) == NOTHING
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(60)
def test_names_in_use_are_refused_and_left_alone(tag):
    with SimulatedHosts(1, 10, tag=tag):
        with pytest.raises(NetsimError, match="exist already"):
            with SimulatedHosts(1, 10, tag=tag):
                pass
        remove_leftovers()  # every tag, but the owner of this one is alive
        assert leftovers(tag)["namespaces"] == [f"ddpk-{tag}-h0"]
    assert leftovers(tag) == NOTHING


def _start_owner(tag: str) -> tuple[subprocess.Popen, list[int]]:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, tag], stdout=subprocess.PIPE, text=True, env=clean_env(), start_new_session=True
    )
    line = owner.stdout.readline().split()
    assert line[:1] == ["ready"], line
    sleeps = [int(pid) for pid in line[1:]]
    for host, pid in enumerate(sleeps):  # `ip netns exec` has entered the namespace
        deadline = time.monotonic() + 20
        while (
            str(pid)
            not in subprocess.run(
                ["ip", "netns", "pids", f"ddpk-{tag}-h{host}"], capture_output=True, text=True
            ).stdout.split()
        ):
            assert time.monotonic() < deadline, f"sleep {pid} never entered host {host}"
            time.sleep(0.05)
    return owner, sleeps


@needs_netns
@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)])
def test_a_signalled_owner_cleans_up(tag, sig, code):
    owner, sleeps = _start_owner(tag)
    try:
        owner.send_signal(sig)
        assert owner.wait(timeout=30) == code
    finally:
        if owner.poll() is None:
            owner.kill()
    assert leftovers(tag) == NOTHING
    assert all(_gone(pid) for pid in sleeps)


@needs_netns
@pytest.mark.timeout(90)
def test_a_killed_owner_leaves_names_that_remove_leftovers_removes(tag):
    owner, sleeps = _start_owner(tag)
    owner.kill()
    owner.wait(timeout=30)
    assert leftovers(tag) == {
        "namespaces": [f"ddpk-{tag}-h0", f"ddpk-{tag}-h1"],
        "links": sorted([f"dkbr{tag}", f"dk{tag}h0", f"dk{tag}h1"]),
    }
    assert not any(_gone(pid) for pid in sleeps)
    remove_leftovers()  # every tag whose owner is dead: this one's is
    assert leftovers(tag) == NOTHING
    assert all(_gone(pid) for pid in sleeps)


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(60)
def test_what_ignores_sigterm_or_left_its_group_is_killed_too(tag):
    with SimulatedHosts(2, 10, tag=tag) as sim:
        stubborn = sim.popen(0, ["sh", "-c", "trap '' TERM; sleep 300 & wait"])
        sim.popen(1, ["setsid", "-f", "sleep", "300"]).wait(timeout=30)  # its own session, parent gone
        deadline = time.monotonic() + 20
        while not (escaped := netns._namespace_pids([f"ddpk-{tag}-h1"])[f"ddpk-{tag}-h1"]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert stubborn.returncode == -signal.SIGKILL  # SIGTERM was ignored: SIGKILL after the grace
    assert all(_gone(pid) for pid in escaped)
    assert leftovers(tag) == NOTHING


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(60)
def test_an_owner_that_never_closes_cleans_up_at_exit(tag):
    script = textwrap.dedent("""
        import sys
        from ddpkit.bench.netsim import SimulatedHosts
        sim = SimulatedHosts(1, 10, tag=sys.argv[1]).__enter__()
        print(sim.popen(0, ["sleep", "300"]).pid, flush=True)
    """)
    done = subprocess.run(
        [sys.executable, "-c", script, tag], capture_output=True, text=True, env=clean_env(), timeout=45
    )
    assert done.returncode == 0, done.stderr
    assert leftovers(tag) == NOTHING
    assert _gone(int(done.stdout))


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(120)
def test_gloo_ranks_on_two_hosts_all_reduce_through_the_shaped_links(tag):
    script = textwrap.dedent("""
        import sys
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2, init_method=sys.argv[2])
        tensor = torch.full((1_000_000,), float(sys.argv[1]) + 1)
        dist.all_reduce(tensor)
        print(tensor.min().item(), tensor.max().item(), flush=True)
        dist.destroy_process_group()
    """)
    with SimulatedHosts(2, 1000, tag=tag) as sim:
        init = f"tcp://{sim.addresses[0]}:29500"  # host 0's address: each host has its own loopback
        ranks = [_python(sim, host, script, host, init) for host in range(2)]
        outs = [rank.communicate(timeout=90)[0] for rank in ranks]
        assert [rank.returncode for rank in ranks] == [0, 0]
        assert [out.split() for out in outs] == [["3.0", "3.0"]] * 2
        sections = _sections(sim.qdiscs(stats=True))
        for host in range(2):  # half of the 4 MB tensor out in each of two phases
            assert _stats(sections[host, "upload"])[0] >= 4_000_000
            assert _stats(sections[host, "download"])[0] >= 4_000_000
