"""Simulated hosts: one Linux network namespace per host, joined by a bridge, links shaped by tc tbf.

Each host gets a namespace ``ddpk-<tag>-h<i>`` holding one end of a veth pair (named
:attr:`SimulatedHosts.interface`, address ``10.213.0.<i+1>/24``); the other end, ``dk<tag>h<i>``,
sits on the bridge ``dkbr<tag>``. A tbf qdisc on the namespace end shapes the host's upload, one
on the bridge end its download. ``ddpkit bench --hosts`` runs each host's workers with
:meth:`SimulatedHosts.popen`; MASTER_ADDR must then be ``addresses[0]``, as every namespace has
its own loopback. Needs root and iproute2 (:func:`check_available`).

Clean-up: leaving the ``with`` block (normally, on an exception, on SIGINT or SIGTERM, which
raise while the block is open, or at interpreter exit) sends SIGTERM, then SIGKILL after a
grace, to the started process groups and to anything else inside the namespaces, then deletes
links, namespaces and bridge. A SIGKILLed owner cannot do that: its names stay, with an owner
file ``/run/ddpkit-netsim/<tag>``, and :func:`remove_leftovers` removes them once the owner is dead.
"""

from __future__ import annotations

import atexit
import math
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from ddpkit.bench.netns import _OWNERS, NetsimError, _check_tag, _delete, _run, _stop, leftovers, remove_leftovers
from ddpkit.errors import warn

_SUBNET = "10.213.0"
_INTERFACE = "dkn0"


def _tbf(dev: str, link_mbit: float, netns: str | None = None) -> list[str]:
    rate = round(link_mbit * 1e6)  # bit/s: no float formatting for tc to misread
    # The bucket must hold at least one timer tick of traffic (rate/HZ, HZ=250 being the common
    # kernel default) or tbf cannot reach its rate. At low rates 32 KiB (22 full frames, 33 ms at
    # 8 Mbit/s) lets a TCP burst out whole instead of a frame per wake-up, yet stays small next to
    # the megabytes a bench step moves; larger GSO packets are segmented by tbf, not dropped.
    burst = max(rate // 8 // 250, 32 * 1024)
    # latency: the queue holds 100 ms at the rate, like a switch port's buffer: a ring's single
    # flow never overflows it, and several peers sending into one host wait rather than drop
    # (slow start may still lose a few frames there, as it would on a real switch).
    prefix = ["tc"] if netns is None else ["tc", "-n", netns]
    return [
        *prefix,
        "qdisc",
        "add",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        f"{rate}bit",
        "burst",
        str(burst),
        "latency",
        "100ms",
    ]


def check_available() -> None:
    """Raise :class:`NetsimError` (one line) unless namespaces, veths, a bridge and tbf work here."""
    if os.geteuid() != 0:
        raise NetsimError("ddpkit bench --hosts needs root (network namespaces and tc); run it as root or drop --hosts")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetsimError(
            f"ddpkit bench --hosts needs iproute2 ({' and '.join(f'`{t}`' for t in missing)} "
            "not found); install iproute2 or drop --hosts"
        )
    probe = f"ddpk-{os.getpid()}-probe"  # everything inside it goes when it is deleted
    try:
        _run(["ip", "netns", "add", probe])
        try:
            _run(["ip", "-n", probe, "link", "add", "name", "b0", "type", "bridge"])
            _run(["ip", "-n", probe, "link", "add", "name", "v0", "type", "veth", "peer", "name", "v1"])
            _run(["ip", "-n", probe, "link", "set", "dev", "v0", "master", "b0"])
            _run(_tbf("v0", 1.0, probe))
        finally:
            _run(["ip", "netns", "del", probe])
    except NetsimError as exc:
        raise NetsimError(f"ddpkit bench --hosts cannot shape links here: {exc}; drop --hosts") from exc


class SimulatedHosts:
    """``hosts`` namespaces on one bridge, each link shaped to ``link_mbit`` Mbit/s both ways.

    Example::

        with SimulatedHosts(2, 100) as sim:
            procs = [sim.popen(i, ["python", "worker.py"], env={"MASTER_ADDR": sim.addresses[0]})
                     for i in range(2)]
            for proc in procs:
                proc.wait()
    """

    def __init__(self, hosts: int, link_mbit: float, *, tag: str | None = None) -> None:
        if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= 254:
            raise NetsimError(f"--hosts must be an integer from 1 to 254, not {hosts!r}")
        if (
            isinstance(link_mbit, bool)
            or not isinstance(link_mbit, (int, float))
            or not math.isfinite(link_mbit)
            or round(link_mbit * 1e6) < 8
        ):
            raise NetsimError(f"--link-mbit must be a rate above 0 Mbit/s (at least 8 bit/s), not {link_mbit!r}")
        self.tag = str(os.getpid()) if tag is None else _check_tag(tag)
        self.hosts = hosts
        self.link_mbit = float(link_mbit)
        self.addresses = [f"{_SUBNET}.{i + 1}" for i in range(hosts)]
        self.interface = _INTERFACE
        self.namespaces = [f"ddpk-{self.tag}-h{i}" for i in range(hosts)]
        self._bridge = f"dkbr{self.tag}"
        self._veths = [f"dk{self.tag}h{i}" for i in range(hosts)]  # the bridge ends
        self._made: list[tuple[str, str]] = []  # ("netns" | "link" | "owner", name), in order
        self._procs: list[subprocess.Popen] = []
        self._previous: dict[int, Any] = {}
        self._open = False
        self._closed = False

    def env(self, host: int) -> dict[str, str]:
        """Variables that make gloo, NCCL and TensorPipe use the shaped interface of ``host``."""
        self._host(host)
        return {name: self.interface for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")}

    def popen(
        self, host: int, argv: list[str], *, env: dict[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen:
        """Start ``argv`` inside ``host``'s namespace, in a session of its own, killed by :meth:`close`.

        Args:
            host: the host's index, from 0.
            argv: the command and its arguments.
            env: variables added to this process's environment and :meth:`env`'s.
            **kwargs: passed on to :class:`subprocess.Popen` (``start_new_session`` is always set).
        """
        if not self._open or self._closed:
            raise NetsimError("SimulatedHosts.popen needs an open simulation (use it inside `with`)")
        full_env = {**os.environ, **self.env(host), **(env or {})}
        kwargs["start_new_session"] = True  # its own process group, spared the terminal's Ctrl-C
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], *argv], env=full_env, **kwargs)
        self._procs.append(proc)
        return proc

    def qdiscs(self, *, stats: bool = False) -> str:
        """``tc qdisc show`` (``-s`` with ``stats``) of both ends of every host's link, one block each."""
        show = ["qdisc", "show"] if not stats else ["-s", "qdisc", "show"]
        blocks = []
        for i, (ns, veth) in enumerate(zip(self.namespaces, self._veths)):
            up = _run(["tc", "-n", ns, *show, "dev", self.interface]).strip()
            down = _run(["tc", *show, "dev", veth]).strip()
            blocks.append(f"host {i} upload ({ns} {self.interface}):\n{up}\nhost {i} download ({veth}):\n{down}")
        return "\n".join(blocks)

    def __enter__(self) -> SimulatedHosts:
        if self._open or self._closed:
            raise NetsimError("a SimulatedHosts can be opened once")
        self._open = True
        self._install_handlers()
        try:
            self._create()
        except BaseException:
            self._close(quiet=True)
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self._close(quiet=kind is not None)

    def close(self) -> None:
        """Stop every process of the simulation and remove its names; a second call does nothing."""
        self._close(quiet=False)

    # -- making and removing -----------------------------------------------------------------

    def _host(self, host: int) -> None:
        if not 0 <= host < self.hosts:
            raise NetsimError(f"host {host} does not exist (hosts are 0 to {self.hosts - 1})")

    def _create(self) -> None:
        present = leftovers(self.tag)
        if present["namespaces"] or present["links"]:
            raise NetsimError(
                f"names of tag {self.tag} exist already ({', '.join(sum(present.values(), []))}); "
                f"another run uses them, or remove_leftovers('{self.tag}') removes them"
            )
        _OWNERS.mkdir(parents=True, exist_ok=True)
        import psutil  # (here: make gpu-check's image may lack it, and never simulates hosts)

        me = psutil.Process()
        (_OWNERS / self.tag).write_text(f"{me.pid} {me.create_time()}\n")
        self._made.append(("owner", self.tag))
        _run(["ip", "link", "add", "name", self._bridge, "type", "bridge"])
        self._made.append(("link", self._bridge))
        # IPv4 only: no IPv6 link-local address for gloo or NCCL to pick, no IPv6 chatter in the
        # shaped links. The mode must be set before a link comes up.
        _run(["ip", "link", "set", "dev", self._bridge, "addrgenmode", "none"])
        _run(["ip", "link", "set", "dev", self._bridge, "up"])
        for ns, veth, address in zip(self.namespaces, self._veths, self.addresses):
            _run(["ip", "netns", "add", ns])
            self._made.append(("netns", ns))
            _run(["ip", "link", "add", "name", veth, "type", "veth", "peer", "name", self.interface, "netns", ns])
            self._made.append(("link", veth))
            _run(["ip", "-n", ns, "link", "set", "dev", "lo", "up"])
            _run(["ip", "-n", ns, "link", "set", "dev", self.interface, "addrgenmode", "none"])
            _run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", self.interface])
            _run(["ip", "-n", ns, "link", "set", "dev", self.interface, "up"])
            _run(["ip", "link", "set", "dev", veth, "addrgenmode", "none"])
            _run(["ip", "link", "set", "dev", veth, "master", self._bridge, "up"])
            _run(_tbf(self.interface, self.link_mbit, ns))
            _run(_tbf(veth, self.link_mbit))

    def _close(self, *, quiet: bool) -> None:
        if self._closed or not self._open:
            self._closed = True
            return
        self._closed = True  # first: a signal or atexit re-entering finds it done
        deferred: list[int] = []
        handlers = self._previous if threading.current_thread() is threading.main_thread() else {}
        for sig in handlers:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, lambda signum, frame: deferred.append(signum))
        try:
            errors = _stop(self._procs, [ns for kind, ns in self._made if kind == "netns"])
            for kind, name in reversed(self._made):
                if kind == "owner":
                    if not errors:
                        (_OWNERS / name).unlink(missing_ok=True)
                elif (error := _delete(kind, name)) is not None:
                    errors.append(error)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            atexit.unregister(self._at_exit)
            for sig in deferred:  # delivered late, to the handler that was there before
                os.kill(os.getpid(), sig)
        if errors:
            message = f"simulated hosts of tag {self.tag} not fully removed: {'; '.join(errors)}"
            if quiet:
                warn(message)
            else:
                raise NetsimError(message)

    def _install_handlers(self) -> None:
        atexit.register(self._at_exit)
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only

        def terminate(signum: int, frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)

        def interrupt(signum: int, frame: FrameType | None) -> None:
            raise KeyboardInterrupt

        handlers: dict[int, Callable[[int, FrameType | None], None]] = {
            signal.SIGINT: interrupt,
            signal.SIGTERM: terminate,
        }
        for sig, handler in handlers.items():
            self._previous[sig] = signal.signal(sig, handler)

    def _at_exit(self) -> None:
        self._close(quiet=True)


__all__ = ["NetsimError", "SimulatedHosts", "check_available", "leftovers", "remove_leftovers"]
