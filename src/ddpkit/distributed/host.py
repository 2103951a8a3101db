"""Facts about this machine: its cores, its addresses and interfaces, its free ports.

Nothing here knows about a job: :mod:`ddpkit.distributed.torchrun` shares the cores among a node's
processes, :mod:`ddpkit.distributed.stores` decides which interface a job's sockets bind, and
``ddpkit doctor`` reports both from these same functions.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any

from ddpkit.distributed._vars import read_list

LOOPBACK = "127.0.0.1"


# -- cores and GPUs --------------------------------------------------------------------------------


def default_nproc() -> int:
    """One process per visible GPU, else one."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def visible_gpus() -> list[str]:
    """The GPUs this process may give its children, as ``CUDA_VISIBLE_DEVICES`` names them (its own
    value's items where set, else every device's index); empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return read_list(os.environ, "CUDA_VISIBLE_DEVICES")
    return [str(index) for index in range(torch.cuda.device_count())]


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and SLURM narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_process(nproc_per_node: int, cpu_count: int | None = None) -> int:
    """CPU cores shared fairly among the processes of a node (at least one each)."""
    if cpu_count is None:
        cpu_count = usable_cores()
    return max(1, cpu_count // max(1, nproc_per_node))


# -- addresses and interfaces ----------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or a name: what it resolves to here) is a loopback address.

    ``/etc/hosts`` often maps a machine's own name to 127.0.1.1. A name that does not resolve is not.
    """
    try:
        address = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return False
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def host_port(host: str, port: object) -> str:
    """``HOST:PORT``, an IPv6 address in brackets (``[fe80::1]:29500``); brackets given are kept once.

    Example:
        >>> host_port("node01", 29500), host_port("fe80::1", 80), host_port("[fe80::1]", 80)
        ('node01:29500', '[fe80::1]:80', '[fe80::1]:80')
    """
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def local_address(host: str, port: int) -> str | None:
    """This machine's address on the route to ``host``: where the other nodes can reach it.

    Sends nothing (a UDP socket only picks its route). None if ``host`` does not resolve or
    has no route; torchrun then falls back to this machine's FQDN.
    """
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError:
        return None


def _interfaces() -> dict[str, Any]:
    """psutil's ``net_if_addrs()``; empty where psutil is missing (make gpu-check's image: one machine)."""
    try:
        import psutil
    except ImportError:
        return {}
    return psutil.net_if_addrs()


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds ``address``, or None."""
    for name, addresses in _interfaces().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    return None


def loopback_interface() -> str:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS)."""
    return interface_of(LOOPBACK) or "lo"


def address_of(interface: str) -> str | None:
    """The first IPv4 (else IPv6) address of ``interface``, or None when it has none or does not exist."""
    found = _interfaces().get(interface, [])
    for family in (socket.AF_INET, socket.AF_INET6):
        for entry in found:
            if entry.family == family:
                return entry.address.split("%")[0]
    return None


# -- ports -----------------------------------------------------------------------------------------


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on ``host:port`` and we could bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
