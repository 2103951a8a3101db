"""In each replica of a one-machine fault-tolerant job: torchft's manager classes, passed on to the job's control plane (:mod:`ddpkit.distributed.ft_control`), and the replica groups' stores as files of the job's directory."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

from ddpkit import _torch
from ddpkit.distributed.ft_control import SOCKET, STORE_HOST, encode


def _connect(directory: str, timeout: float | None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(os.path.join(directory, SOCKET))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"the fault-tolerant job's control plane is gone ({exc.strerror or exc})") from None
    return sock


def _answer(sock: socket.socket) -> Any:
    line = sock.makefile("rb").readline()
    if not line:
        raise RuntimeError("the fault-tolerant job's control plane is gone (it closed the connection)")
    answer = json.loads(line)
    if "error" in answer:
        kind, message = answer["error"]
        raise (TimeoutError if kind == "TimeoutError" else RuntimeError)(message)
    return answer


class ControlServer:
    """Stands for torchft's ``ManagerServer``: the real one runs in the control plane while this lives.

    torchft builds it with ``ManagerServer``'s keywords; the control plane binds it on its own
    loopback whatever ``bind`` says.
    """

    directory = ""

    def __init__(self, **kwargs: Any) -> None:
        self._sock = _connect(self.directory, kwargs["connect_timeout"].total_seconds() + 30)
        self._sock.sendall((json.dumps({"op": "server", "kwargs": encode(kwargs)}) + "\n").encode())
        self._address = _answer(self._sock)["address"]
        self._sock.settimeout(None)

    def address(self) -> str:
        """The manager server's address, in the control plane's namespace."""
        return self._address

    def shutdown(self) -> None:
        """Close it: the control plane shuts the real server down."""
        self._sock.close()


class ControlClient:
    """Stands for torchft's ``ManagerClient``: each call is made by the control plane."""

    directory = ""

    def __init__(self, addr: str, connect_timeout: timedelta) -> None:
        self._addr, self._connect_timeout = addr, connect_timeout.total_seconds()

    def _call(self, method: str, timeout: timedelta, **kwargs: Any) -> Any:
        sock = _connect(self.directory, timeout.total_seconds() + self._connect_timeout + 30)
        with sock:
            request = {
                "op": "call",
                "addr": self._addr,
                "connect_timeout": self._connect_timeout,
                "method": method,
                "kwargs": encode({**kwargs, "timeout": timeout}),
            }
            sock.sendall((json.dumps(request) + "\n").encode())
            return _answer(sock)["result"]

    def _quorum(self, timeout: timedelta, **kwargs: Any) -> Any:
        """torchft's quorum call; its result's fields as attributes."""
        return SimpleNamespace(**self._call("_quorum", timeout, **kwargs))

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        """Where the manager's replica serves its state."""
        return str(self._call("_checkpoint_metadata", timeout, rank=rank))

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        """torchft's commit vote.

        Args:
            group_rank: the rank in the replica group (0: one process a replica).
            step: the step voted on.
            should_commit: this replica's vote.
            timeout: how long to wait for the others' votes.
        """
        return bool(self._call("should_commit", timeout, group_rank=group_rank, step=step, should_commit=should_commit))


def file_stores(directory: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """torchft's ``TCPStore`` (for a replica group's own store) and ``create_store_client``, as files.

    A replica group's store is ``STORE_HOST:K``: the file ``replica-store-K`` of ``directory``. A
    quorum that names any other store (a forged one) is refused when a process group opens it.
    """
    import torch.distributed as dist

    def store(
        host_name: str,
        port: int,
        is_master: bool = False,
        wait_for_workers: bool = True,
        timeout: timedelta = timedelta(seconds=300),
        **kwargs: Any,
    ) -> Any:
        if host_name != STORE_HOST:
            raise RuntimeError(f"a replica store at {host_name}:{port} is not this job's")
        opened = dist.FileStore(os.path.join(directory, f"replica-store-{int(port)}"), -1)
        opened.set_timeout(timeout)
        return opened

    def client(store_addr: str, timeout: timedelta) -> Any:
        host, _, rest = store_addr.partition(":")
        port, _, prefix = rest.partition("/")
        if host != STORE_HOST or not port.isdigit():
            raise RuntimeError(
                f"the quorum named the store {store_addr!r}, which is not one of this job's (a forged quorum call?)"
            )
        return dist.PrefixStore(prefix, store(host, int(port), timeout=timeout))

    return store, client


def install(directory: str) -> None:
    """Make this process's torchft managers use the control plane and the job's file stores."""
    ControlServer.directory = ControlClient.directory = directory
    store, client = file_stores(directory)
    _torch.patch_torchft(
        ManagerServer=ControlServer, ManagerClient=ControlClient, TCPStore=store, create_store_client=client
    )


__all__ = ["ControlClient", "ControlServer", "file_stores", "install"]
