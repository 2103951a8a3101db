"""The control plane of a one-machine fault-tolerant job, where no other process can reach it.

torchft's lighthouse and each replica's manager server answer gRPC (and the lighthouse HTTP)
calls from whoever reaches their port, with no credential: ``Kill`` makes a replica exit,
``Quorum`` takes the caller's step and the address its peers heal from, the lighthouse's dashboard
kills any replica. On one machine, ``ddpkit run --fault-tolerant`` runs all of them in one process
of its own, the control plane (:func:`start`), in a new user and network namespace whose only
interface is a loopback of its own: no other process of the machine, of any user, can open a
connection to them. The replicas reach it through a Unix socket in the job's directory (mode
0700): :class:`ControlServer` and :class:`ControlClient` stand in for torchft's ``ManagerServer``
and ``ManagerClient`` in each replica (:func:`install`) and pass each call on. The replica
groups' stores become ``FileStore`` files in the same directory (:func:`file_stores`), so no
socket carries them either. torchft's own code does everything else: quorums, membership, the
commit vote.

Where the kernel refuses an unprivileged user namespace, the control plane runs in the machine's
namespace, listening on 127.0.0.1: unreachable from other hosts, reachable by other users of this
machine. :func:`start` says so in one line and ``ddpkit doctor`` reports which of the two a job
would get.

Example:
    >>> encode({"timeout": __import__("datetime").timedelta(seconds=2)})
    {'timeout': {'__seconds__': 2.0}}
"""

from __future__ import annotations

import json
import os
import socketserver
import subprocess
import sys
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ddpkit.distributed.parent import launcher_env

CONTROL_ENV = "DDPKIT_FT_CONTROL"
"""The job's private directory (one machine): the control plane's socket, the stores, the secret."""
SOCKET = "control.sock"
"""The control plane's Unix socket, in the job's directory."""
STORE_HOST = "ddpkit-private-store"
"""The host torchft is told a replica group's store is on: :func:`file_stores` opens the job's file."""
LOOPBACK = "127.0.0.1"

_ISOLATE = r"""
import ctypes, fcntl, os, socket, struct, sys


def isolate():
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(0x10000000 | 0x40000000) != 0:     # CLONE_NEWUSER | CLONE_NEWNET
        return os.strerror(ctypes.get_errno())
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as handle:
            handle.write(text)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:      # bring the new loopback up
        flags = struct.unpack("16sH", fcntl.ioctl(sock, 0x8913, struct.pack("16sH22x", b"lo", 0))[:18])[1]
        fcntl.ioctl(sock, 0x8914, struct.pack("16sH22x", b"lo", flags | 1))
    return ""
"""
"""``isolate()``: this process into a new user and network namespace with its loopback up; "" or why not."""

_BOOT = (
    _ISOLATE
    + r"""
refused = isolate() if sys.argv[1] == "isolate" else "not asked"
from ddpkit.distributed.parent import die_with_launcher
die_with_launcher()  # after unshare, which may clear it: the launcher killed, the control plane ends too
from ddpkit.distributed.ft_control import serve

serve(sys.argv[2:], refused)
"""
)
"""Run by :func:`start` as ``python -c``: the namespace is made first, while the process has one
thread (``unshare`` refuses a new user namespace to a threaded process), then ddpkit is imported."""


def namespace_refusal() -> str:
    """Why this machine would give a control plane no namespace of its own ("" when it would); for doctor."""
    try:
        done = subprocess.run(
            [sys.executable, "-S", "-c", _ISOLATE + "print(isolate() or 'ok')"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    said = done.stdout.strip() or done.stderr.strip().splitlines()[-1:] or ["no answer"]
    text = said if isinstance(said, str) else said[0]
    return "" if text == "ok" else text


# -- the control plane's process ------------------------------------------------------------------


def start(
    directory: str, min_replicas: int, join_ms: int, tick_ms: int, heartbeat_ms: int, isolate: bool = True
) -> tuple[subprocess.Popen, str, str]:
    """Start the control plane for the job whose private directory is ``directory``.

    Args:
        directory: the job's private directory (mode 0700): the socket goes there.
        min_replicas: the lighthouse's fewest replicas for a quorum.
        join_ms: how long the lighthouse waits for a live replica to join a quorum.
        tick_ms: how often it checks for a quorum.
        heartbeat_ms: how long it waits for a replica's heartbeat before leaving it out.
        isolate: ask for a namespace of its own (False: on this machine's 127.0.0.1 at once).

    Returns:
        The process, the lighthouse's address (as the replicas name it) and, when the control plane
        could not get a namespace of its own, why (empty when it did).

    Raises:
        RuntimeError: it did not start.
    """
    path = os.path.join(directory, SOCKET)
    if len(path.encode()) > 100:
        raise RuntimeError(
            f"the job's directory {directory} is too long a path for a Unix socket; set TMPDIR to a shorter directory"
        )
    args = [str(min_replicas), str(join_ms), str(tick_ms), str(heartbeat_ms)]
    attempts = ["isolate", "plain"] if isolate else ["plain"]
    said = ""
    for how in attempts:
        child = subprocess.Popen(
            [sys.executable, "-c", _BOOT, how, directory, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn"), **launcher_env()},
        )
        assert child.stdout is not None
        line = child.stdout.readline().split()
        if len(line) == 3 and line[0] == "ready":
            threading.Thread(target=_drain, args=(child,), daemon=True).start()
            return child, line[1], "" if line[2] == "-" else line[2].replace("_", " ")
        child.kill()
        said = (child.stderr.read() if child.stderr else "").strip().splitlines()[-1:] or ["no output"]
        said = said[0]
    raise RuntimeError(f"torchft's control plane did not start ({said})")


def _drain(child: subprocess.Popen) -> None:
    """Pass the control plane's stderr on (torchft's warnings), so its pipe never fills."""
    assert child.stderr is not None
    for line in child.stderr:
        sys.stderr.write(line)


def serve(argv: Sequence[str], refused: str) -> None:
    """The control plane's main: the lighthouse, then manager servers and calls on request, until killed.

    Args:
        argv: the job's directory, then the lighthouse's minimum replicas, join timeout, quorum
            tick and heartbeat timeout (milliseconds).
        refused: why the process has no namespace of its own ("" when it has).
    """
    from torchft._torchft import LighthouseServer

    directory, min_replicas, join_ms, tick_ms, heartbeat_ms = argv
    lighthouse = LighthouseServer(
        bind=f"{LOOPBACK}:0",
        min_replicas=int(min_replicas),
        join_timeout_ms=int(join_ms),
        quorum_tick_ms=int(tick_ms),
        heartbeat_timeout_ms=int(heartbeat_ms),
    )
    port = lighthouse.address().rsplit(":", 1)[-1]
    path = os.path.join(directory, SOCKET)
    server = socketserver.ThreadingUnixStreamServer(path, _Handler)
    server.daemon_threads = True
    os.chmod(path, 0o600)
    why = refused.replace(" ", "_") if refused else "-"
    print(f"ready http://{LOOPBACK}:{port} {why}", flush=True)
    server.serve_forever()


class _Handler(socketserver.StreamRequestHandler):
    """One replica's request: ``server`` (a manager server for as long as the connection lasts) or ``call``."""

    _clients: dict[str, Any] = {}
    _lock = threading.Lock()

    def handle(self) -> None:
        request = json.loads(self.rfile.readline() or "{}")
        try:
            if request.get("op") == "server":
                self._server(decode(request["kwargs"]))
            elif request.get("op") == "call":
                self._reply({"result": self._call(request)})
        except Exception as exc:  # noqa: BLE001 - torchft's errors go back to the replica that asked
            self._reply({"error": [type(exc).__name__, str(exc)]})

    def _reply(self, answer: dict[str, Any]) -> None:
        self.wfile.write((json.dumps(answer) + "\n").encode())
        self.wfile.flush()

    def _server(self, kwargs: dict[str, Any]) -> None:
        from torchft._torchft import ManagerServer

        kwargs.update(bind=f"{LOOPBACK}:0", hostname=LOOPBACK)
        manager = ManagerServer(**kwargs)
        try:
            self._reply({"address": manager.address()})
            while self.rfile.read(4096):  # until the replica closes it, or dies
                pass
        finally:
            manager.shutdown()  # its heartbeats stop: the lighthouse drops the replica

    def _call(self, request: dict[str, Any]) -> Any:
        from torchft._torchft import ManagerClient

        address = request["addr"]
        with self._lock:
            client = self._clients.get(address)
        if client is None:
            client = ManagerClient(address, connect_timeout=timedelta(seconds=request["connect_timeout"]))
            with self._lock:
                self._clients[address] = client
        try:
            result = getattr(client, request["method"])(**decode(request["kwargs"]))
        except Exception:
            with self._lock:
                self._clients.pop(address, None)
            raise
        if isinstance(result, (str, bool, int)):
            return result
        return {
            name: getattr(result, name)
            for name in dir(result)
            if not name.startswith("_") and not callable(getattr(result, name))
        }


def encode(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keywords of a torchft call as JSON: a ``timedelta`` becomes ``{"__seconds__": s}``."""
    return {
        key: {"__seconds__": value.total_seconds()} if isinstance(value, timedelta) else value
        for key, value in kwargs.items()
    }


def decode(kwargs: dict[str, Any]) -> dict[str, Any]:
    """What :func:`encode` made, back."""
    return {
        key: timedelta(seconds=value["__seconds__"]) if isinstance(value, dict) and "__seconds__" in value else value
        for key, value in kwargs.items()
    }


# -- in each replica: torchft's manager classes, passed on to the control plane -------------------


__all__ = ["CONTROL_ENV", "STORE_HOST", "decode", "encode", "namespace_refusal", "serve", "start"]
