"""``ddpkit doctor``: what this machine and launch look like, and what would make a run fail."""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ddpkit._argparse import Parser
from ddpkit.distributed import ft_control, host, process_group, stores
from ddpkit.distributed.environment import detect
from ddpkit.errors import DdpkitError


@dataclass
class Report:
    """Facts (name, value) and problems (reasons a run would fail) and warnings."""

    facts: list[tuple[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def add(self, name: str, value: Any) -> None:
        """Record the fact ``name: value``, in the order the report prints it."""
        self.facts.append((name, value))

    def as_dict(self) -> dict[str, Any]:
        """The report as ``--json`` prints it: facts, problems, warnings and ``ok``."""
        return {
            "facts": dict(self.facts),
            "problems": self.problems,
            "warnings": self.warnings,
            "ok": not self.problems,
        }

    def render(self) -> str:
        """The report as text: one fact a line, then the warnings and problems, then the verdict."""
        width = max(len(name) for name, _ in self.facts)
        lines = [f"{name:<{width}}  {value}" for name, value in self.facts]
        lines += [f"warning: {text}" for text in self.warnings]
        lines += [f"problem: {text}" for text in self.problems]
        lines.append("ok" if not self.problems else f"{len(self.problems)} problem(s) found")
        return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The parser of ``ddpkit doctor``."""
    parser = Parser(prog="ddpkit doctor", description="Check torch, devices, backends, launcher and network.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def cmd_doctor(argv: Sequence[str]) -> int:
    """``ddpkit doctor``: print the report (``--json``: as JSON); 1 when a run would fail, else 0."""
    opts = parser().parse_args(argv)
    report = examine()
    print(json.dumps(report.as_dict(), default=str, indent=2) if opts.json else report.render())
    return 0 if not report.problems else 1


def examine() -> Report:
    """Look at torch, devices, backends, the launcher and the network."""
    import torch
    import torch.distributed as dist

    report = Report()
    report.add("python", platform.python_version())
    report.add("torch", torch.__version__)
    report.add("cuda available", torch.cuda.is_available())
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    report.add("visible gpus", gpus)
    for index in range(gpus):
        report.add(f"  gpu {index}", torch.cuda.get_device_name(index))
    report.add("nccl available", dist.is_available() and dist.is_nccl_available())
    report.add("gloo available", dist.is_available() and dist.is_gloo_available())
    report.add("mpi available", dist.is_available() and dist.is_mpi_available())
    if not dist.is_available():
        report.problems.append("this torch build has no torch.distributed; install a build with it")

    try:
        env = detect()
    except DdpkitError as exc:
        report.problems.append(str(exc))
        return report
    report.add("launcher", env.launcher)
    report.add("rank / world size", f"{env.rank} / {env.world_size}")
    report.add("local rank / local world", f"{env.local_rank} / {env.local_world_size}")
    report.add("node rank", env.node_rank)
    try:
        device = process_group.choose_device(env)
        report.add("device", device)
        report.add("backend", process_group.choose_backend(device))
    except DdpkitError as exc:
        report.problems.append(str(exc))

    _network(report, env)
    _listening(report, env)
    _fault_tolerant(report)
    _threads(report, env.local_world_size)
    report.add(
        "not checked",
        "firewalls and routes between nodes, other programs' ports, SLURM's and the "
        "trackers' own daemons and network use, NCCL's InfiniBand and NVLink transports, plain torchrun's "
        "stores beyond its variables",
    )
    return report


def _fault_tolerant(report: Any) -> None:
    """What ``ddpkit run --fault-tolerant`` would listen on, on one machine and across hosts."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        report.add("fault-tolerant listens on", "nothing: torchft is not installed (pip install 'ddpkit[ft]')")
        return

    refused = ft_control.namespace_refusal()
    if not refused:
        report.add(
            "fault-tolerant listens on",
            "one machine: torchft's lighthouse and managers in a network namespace "
            "of the job's own (no other process can connect), reached through a Unix socket in a 0700 "
            "directory; heal servers and gloo on 127.0.0.1, heal requests and payloads signed with the job's "
            "secret; stores are files in that directory",
        )
    else:
        report.add(
            "fault-tolerant listens on",
            "one machine: torchft's lighthouse and managers on 127.0.0.1 (no "
            "namespace of their own here); heal servers and gloo on 127.0.0.1, signed with the job's secret; "
            "stores are files in a 0700 directory",
        )
        report.warnings.append(
            f"this machine gives no unprivileged network namespace ({refused}): other users of "
            "it can reach a fault-tolerant job's torchft lighthouse and managers on 127.0.0.1 "
            "(torchft's Kill restarts a replica; a forged Quorum makes a step be redone); they "
            "cannot read or change its state"
        )
    report.add(
        "fault-tolerant across hosts",
        "node 0: the lighthouse at the master's PORT and the job's store at "
        "PORT + 1; each node: its managers, replica stores and heal servers on its address on the job's "
        "network, heal payloads signed with --secret-file (the multi-node trust boundary: "
        "docs/concepts/security.md)",
    )


def _listening(report: Any, env: Any) -> None:
    """Every address a run with these settings listens on, from what the launcher itself uses.

    gloo's (and NCCL's) interface comes from :func:`ddpkit.distributed.stores.gloo_interface`, the function
    ``ddpkit run``, ``ddpkit.launch`` and ``ddpkit.init`` set it with, so a container whose host
    name resolves to its network address gets the real answer.
    """
    interface, address = stores.gloo_interface(env.num_nodes, env.master_addr, env.master_port)
    where = f"{address or '(no address)'} ({interface or 'the interface of the host name'})"
    report.add("gloo/NCCL listen on", where)
    if env.num_nodes > 1 or (env.launcher == "slurm" and env.world_size > 1):
        report.add(
            "a run listens on",
            f"{env.master_addr}:{env.master_port} (rendezvous and rank 0's store, on "
            f"node 0) and {where} for gloo/NCCL; see README 'Security'",
        )
        return
    if address is not None and host.is_loopback(address):
        report.add(
            "a run listens on",
            f"{address} only (gloo's ports; the rendezvous and the workers' store are "
            "files in a private directory) for ddpkit run, ddpkit.launch, train/bench/predict/demo",
        )
    else:
        report.add("a run listens on", f"{where}: gloo's ports, reachable from the network")
        report.warnings.append(
            f"GLOO_SOCKET_IFNAME={interface} makes gloo listen on {address or interface}, where other hosts can "
            "connect; unset it (a job on one machine binds loopback) unless this is meant"
        )
    if (
        env.launcher == "torchelastic"
        and not env.store_dir
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    ):
        report.warnings.append(
            "started by plain torchrun: its agent's rendezvous and worker stores listen on every interface, "
            "and its rendezvous unpickles what it reads there; anyone who can reach those ports can run code "
            "as you. ddpkit run keeps them in files only you can open on one machine"
        )


def _network(report: Any, env: Any) -> None:
    hostname = socket.gethostname()
    report.add("hostname", hostname)
    try:
        report.add("hostname resolves to", socket.gethostbyname(hostname))
    except OSError:
        text = f"host name {hostname!r} does not resolve; other nodes cannot reach this one by name"
        (report.problems if env.num_nodes > 1 else report.warnings).append(text)
    report.add("master", f"{env.master_addr}:{env.master_port}")
    if env.distributed:
        try:
            socket.getaddrinfo(env.master_addr, env.master_port)
        except OSError:
            report.problems.append(
                f"master host {env.master_addr!r} does not resolve from here; fix MASTER_ADDR or DNS"
            )
    else:
        free = host.port_is_free("127.0.0.1", env.master_port)
        report.add("master port free", free)
        if not free:
            report.warnings.append(
                f"port {env.master_port} is taken on this host; ddpkit run needs no port on one machine, "
                "but a hand-set MASTER_PORT would collide"
            )


def _threads(report: Any, local_world_size: int) -> None:
    import torch

    cpus = host.usable_cores()
    report.add("cpu cores", cpus)
    report.add("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "(unset)"))
    report.add("torch threads", torch.get_num_threads())
    total = torch.get_num_threads() * local_world_size
    if total > cpus:
        report.warnings.append(
            f"{local_world_size} process(es) x {torch.get_num_threads()} threads exceed {cpus} cores; "
            f"set OMP_NUM_THREADS={max(1, cpus // max(1, local_world_size))}"
        )
