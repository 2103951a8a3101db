"""c10d stores that listen on one address, not on every interface.

torch's ``TCPStore`` server binds the wildcard address whatever host it is given, so a job's
rendezvous store is reachable from the whole network, and torch's dynamic rendezvous
unpickles the state it keeps there. ddpkit binds the socket itself (``127.0.0.1`` for a job on
one machine, the node's own address between nodes) and hands it to ``TCPStore`` through
``master_listen_fd``.

Example:
    >>> store = serve("127.0.0.1", 0, timeout_s=30)       # doctest: +SKIP
    >>> store.port                                          # doctest: +SKIP
    41233
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import socket
from typing import Any

from ddpkit.errors import UsageError

LOOPBACK = "127.0.0.1"


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
            raise UsageError(f"port {port} on {host} is already in use, so this machine cannot host the "
                             "rendezvous store: choose another port (ddpkit run picks a free one itself)") from None
        raise
    return sock


def serve(host: str, port: int, *, timeout_s: float, world_size: int | None = None) -> Any:
    """A ``TCPStore`` server listening on ``host:port`` only; ``store.port`` is the port it got."""
    import torch.distributed as dist

    sock = bound_socket(host, port)
    bound_port = sock.getsockname()[1]
    return dist.TCPStore(host, bound_port, world_size, True, datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=sock.detach())   # the store owns the fd now


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or a name: what it resolves to here) is a loopback address.

    ``/etc/hosts`` often maps a machine's own name to 127.0.1.1. A name that does not resolve is not.
    """
    try:
        address = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return False
    return ipaddress.ip_address(address.split("%")[0]).is_loopback
