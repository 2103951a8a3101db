"""Where a job's stores live and which addresses its sockets listen on.

One machine (``ddpkit run -n N``, :func:`ddpkit.launch`): the rendezvous state and the workers'
store are ``FileStore`` files in a directory only the user can open, so no socket carries them,
and gloo and NCCL bind loopback. Between nodes: stores and gloo on the job's interface only.
Which interface that is (:func:`gloo_interface`, :func:`socket_env`) is decided here, for the job;
the facts it is decided from, this machine's addresses and interfaces, are in :mod:`ddpkit.distributed.host`.

Between nodes a store must be a socket. torch's ``TCPStore`` server binds the wildcard address
whatever host it is given, and torch's dynamic rendezvous unpickles the state it keeps there, so
ddpkit binds the socket itself, on the node's own address, before any port is published, and
hands it to ``TCPStore`` through ``master_listen_fd``.

Example:
    >>> store = serve("127.0.0.1", 0, timeout_s=30)       # doctest: +SKIP
    >>> store.port                                          # doctest: +SKIP
    41233
"""

from __future__ import annotations

import datetime
import errno
import socket
from collections.abc import Iterator
from typing import Any

from ddpkit.distributed.environment import STORE_DIR_ENV as STORE_DIR_ENV  # for the launchers
from ddpkit.distributed.environment import detect
from ddpkit.distributed.host import LOOPBACK, address_of, interface_of, local_address, loopback_interface
from ddpkit.errors import DdpkitError, UsageError


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: one the OS picks).

    Raises:
        UsageError: the port is in use.
        OSError: ``host`` is not an address of this machine (``EADDRNOTAVAIL``) or does not resolve.
    """
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UsageError(
                f"port {port} on {host} is already in use, so this machine cannot host the "
                "rendezvous store: choose another port in --master HOST:PORT"
            ) from None
        raise
    return sock


def serve(host: str, port: int, *, timeout_s: float, world_size: int | None = None) -> Any:
    """A ``TCPStore`` server listening on ``host:port`` only; ``store.port`` is the port it got.

    Args:
        host: an address of this machine to listen on (not the wildcard).
        port: the port to bind (0: one the OS picks).
        timeout_s: seconds a store operation (a get, a wait) waits before it fails.
        world_size: processes that will use the store (None: not known, as for the agent's rendezvous).

    Raises:
        UsageError: the port is in use.
        OSError: ``host`` is not an address of this machine or does not resolve.
    """
    import torch.distributed as dist

    sock = bound_socket(host, port)
    bound_port = sock.getsockname()[1]
    return dist.TCPStore(
        host,
        bound_port,
        world_size,
        True,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )  # the store owns the fd now


# -- one machine: stores in a directory only the user can open -----------------------------------


def private_dir() -> str:
    """A new directory only this user can open (mode 0700, a fresh random name), for a job's stores.

    The rendezvous state and the workers' store live there as torch ``FileStore`` files, so no
    socket carries them: another user of this machine can neither read nor write them (root can).

    Raises:
        DdpkitError: the directory came out readable by others (a umask cannot widen mkdtemp's
            mode, but a file system without permissions can).
    """
    import os
    import stat
    import tempfile

    path = tempfile.mkdtemp(prefix="ddpkit-job-")
    info = os.lstat(path)
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        import shutil

        shutil.rmtree(path, ignore_errors=True)

        raise DdpkitError(
            f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):o}), so it cannot "
            "hold the job's stores privately: set TMPDIR to a directory on a local file system"
        )
    return path


def rendezvous_file(directory: str) -> str:
    """The file of the elastic agent's rendezvous state in ``directory`` (torchrun's ``store_type=file``)."""
    return f"{directory}/rendezvous"


def worker_store(directory: str, attempt: int) -> Any:
    """The workers' store of one attempt of a one-machine job: a ``FileStore`` in ``directory``.

    One file per attempt: a restarted group never reads the addresses of the processes it replaced.
    """
    import torch.distributed as dist

    return dist.FileStore(f"{directory}/workers-{attempt}", -1)


def env_rendezvous(
    url: str, timeout: datetime.timedelta | None = None, **kwargs: Any
) -> Iterator[tuple[Any, int, int]]:
    """torch's ``env://`` rendezvous for a worker of a one-machine ddpkit job, through the private store.

    Scripts that call ``dist.init_process_group()`` themselves read ``env://``; torch's own handler
    would make rank 0 host a ``TCPStore`` on every interface. :mod:`ddpkit.entry` installs this one in
    the workers of ``ddpkit run`` and :func:`ddpkit.launch` instead (:func:`ddpkit._torch.use_env_rendezvous`).
    Rank and world size come from the URL's query or the launcher, as in torch's.
    """
    import urllib.parse

    import torch.distributed as dist

    env = detect()
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlparse(url).query))
    rank, world_size = int(query.get("rank", env.rank)), int(query.get("world_size", env.world_size))
    store = worker_store(env.store_dir, env.restart_count)
    if timeout is not None:
        store.set_timeout(timeout)
    yield dist.PrefixStore("torch-env", store), rank, world_size
    raise RuntimeError("env:// cannot rendezvous again within one attempt; the launcher restarts the group")


# -- which interface gloo and NCCL bind ----------------------------------------------------------

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_IFNAME = "NCCL_SOCKET_IFNAME"


def gloo_interface(num_nodes: int, master_addr: str, master_port: int, environ: Any = None) -> tuple[str, str | None]:
    """(interface, address) gloo binds for a job of ``num_nodes`` nodes: what ddpkit sets and what doctor prints.

    The user's ``GLOO_SOCKET_IFNAME`` wins. Otherwise one machine: loopback. Several nodes: the
    interface of this node's route to the master, the job's network. Without either, gloo would bind
    whatever the host name resolves to, which in a container is its network address.

    Args:
        num_nodes: nodes of the job (one: loopback).
        master_addr: the master's address; the route to it picks the interface.
        master_port: the master's port (only to look the route up; nothing is sent).
        environ: the environment to read ``GLOO_SOCKET_IFNAME`` from (None: ``os.environ``).

    Returns:
        The interface's name and its address; ``("", None)`` when no route to the master is found.
    """
    import os

    environ = os.environ if environ is None else environ
    chosen = environ.get(GLOO_IFNAME, "").split(",")[0].strip()
    if chosen:
        return chosen, address_of(chosen)
    if num_nodes <= 1:
        return loopback_interface(), LOOPBACK
    local = local_address(master_addr, master_port)
    name = interface_of(local) if local else None
    return (name, local) if name else ("", None)


def socket_env(num_nodes: int, master_addr: str, master_port: int, environ: Any = None) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` for a job's processes; the user's own stay.

    Every process group of the job reads them when it is created (PowerSGD's second group and
    fsdp's device mesh too), so one setting before the first group covers all of them.

    Args:
        num_nodes: nodes of the job (one: loopback).
        master_addr: the master's address; the route to it picks the interface.
        master_port: the master's port (only to look the route up).
        environ: the environment whose settings stay (None: ``os.environ``).

    Returns:
        The variables to set, those the user has not set; empty when no interface is found.
    """
    import os

    environ = os.environ if environ is None else environ
    name, _ = gloo_interface(num_nodes, master_addr, master_port, environ)
    if not name:
        return {}
    return {key: name for key in (GLOO_IFNAME, NCCL_IFNAME) if not environ.get(key)}
