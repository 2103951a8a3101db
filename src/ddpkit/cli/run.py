"""``ddpkit run``: a script in N processes per node, with torchrun's own flags understood.

A torchrun command line keeps working with ``torchrun`` replaced by ``ddpkit run``:
``--nproc_per_node`` / ``--nproc-per-node`` (a number, ``auto``, ``gpu`` or ``cpu``),
``--nnodes``, ``--node_rank``, ``--master_addr`` + ``--master_port``, ``--rdzv_endpoint``,
``--rdzv_id``, ``--rdzv_backend c10d|static``, ``--standalone`` and ``--max_restarts``, in both
spellings, map onto ddpkit's ``-n``, ``--nnodes``, ``--node-rank``, ``--master HOST:PORT``,
the run id and ``--max-restarts``. Two flags that say different things are a one-line error.

Example:
    >>> spec_of(["--nproc_per_node", "2", "--standalone", "hello.py"]).nproc_per_node
    2
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from typing import Any

from ddpkit._argparse import Parser
from ddpkit.distributed import ft_launch
from ddpkit.distributed.environment import detect
from ddpkit.distributed.ft_launch import FaultTolerantSpec
from ddpkit.distributed.host import host_port
from ddpkit.distributed.parent import die_with_launcher
from ddpkit.distributed.torchrun import RunSpec, placement, run
from ddpkit.errors import UsageError

# (our spelling, torchrun's spelling) -> dest; each takes a value.
_VALUED = {
    ("-n",): "n",
    ("--nproc-per-node", "--nproc_per_node"): "nproc_per_node",
    ("--nnodes",): "nnodes",
    ("--node-rank", "--node_rank"): "node_rank",
    ("--master",): "master",
    ("--master-addr", "--master_addr"): "master_addr",
    ("--master-port", "--master_port"): "master_port",
    ("--rdzv-endpoint", "--rdzv_endpoint"): "rdzv_endpoint",
    ("--rdzv-id", "--rdzv_id"): "rdzv_id",
    ("--rdzv-backend", "--rdzv_backend"): "rdzv_backend",
    ("--max-restarts", "--max_restarts"): "max_restarts",
    ("-m", "--module"): "module",
    ("--min-replicas",): "min_replicas",
    ("--quorum-timeout",): "quorum_timeout",
    ("--secret-file",): "secret_file",
    ("--local-ranks-filter", "--local_ranks_filter"): "local_ranks_filter",
    ("--monitor-interval", "--monitor_interval"): "monitor_interval",
    ("--role",): "role",
    ("--tee", "-t"): "tee",
    ("--redirects", "-r"): "redirects",
    ("--log-dir", "--log_dir"): "log_dir",
}
_PASSED_ON = {
    "local_ranks_filter": "--local-ranks-filter",
    "monitor_interval": "--monitor-interval",
    "role": "--role",
    "tee": "--tee",
    "redirects": "--redirects",
    "log_dir": "--log-dir",
}
"""torchrun flags ``ddpkit run`` hands to torch's agent as they are."""
_FLAGS = {"-h", "--help", "--standalone", "--fault-tolerant"}
_VALUE_OPTIONS = {name for names in _VALUED for name in names}

# torchrun flags that ddpkit run does not take, and why or what instead (either spelling: _ for -).
_NOT_TAKEN = {
    "--no-python": "ddpkit run starts Python scripts or modules (-m)",
    "--run-path": "give the script's path; ddpkit run uses runpy already",
    "--rdzv-conf": "ddpkit sets the rendezvous itself (node 0 hosts it)",
    "--start-method": "workers are started the way torchrun starts them by default",
    "--local-addr": "ddpkit picks this node's address on the route to the master",
}

_STREAMS = re.compile(r"[0-3]|\d+:[0-3](,\d+:[0-3])*")
"""torchrun's --tee and --redirects: streams for every local rank, or per local rank."""

TORCHRUN_MASTER_PORT = 29500  # torchrun's default for --master_port
TORCHRUN_RDZV_PORT = 29400  # and for an --rdzv_endpoint without a port


def split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``ddpkit run`` arguments into ours and the script's (from SCRIPT or -m MODULE on)."""
    ours: list[str] = []
    index = 0
    while index < len(argv):
        token = argv[index]
        name = token.split("=", 1)[0]
        if token == "--":  # the end of the options, as torchrun's argparse takes it: the script comes next
            rest = list(argv[index + 1 :])
            return ours + rest[:1], rest[1:]
        if name in ("-m", "--module"):
            take = 1 if "=" in token else 2
            return ours + list(argv[index : index + take]), list(argv[index + take :])
        if name in _VALUE_OPTIONS:
            take = 1 if "=" in token else 2
            ours += argv[index : index + take]
            index += take
        elif name in _FLAGS or (name[:2] in _VALUE_OPTIONS and not name.startswith("--") and name[:2] != "-m"):
            ours.append(token)  # (a short option with its value attached, -t3 as torchrun takes it)
            index += 1
        elif name.replace("_", "-") in _NOT_TAKEN:
            raise UsageError(
                f"{name} is a torchrun flag that ddpkit run does not take: {_NOT_TAKEN[name.replace('_', '-')]}"
            )
        elif token.startswith("-") and token != "-":
            raise UsageError(f"unknown option {token!r} for 'ddpkit run' (see 'ddpkit run --help')")
        else:
            return ours + [token], list(argv[index + 1 :])
    return ours, []


def parser() -> argparse.ArgumentParser:
    """The parser of ``ddpkit run``'s own arguments (those before the script)."""
    parser = Parser(
        prog="ddpkit run",
        description="Start SCRIPT (or -m MODULE) in N processes per node under torch's elastic agent. "
        "torchrun's flags work too, in either spelling.",
    )
    add = parser.add_argument
    add("-n", dest="n", type=int, default=None, help="processes per node (default: one per visible GPU, else 1)")
    add(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        default=None,
        metavar="N|auto|gpu|cpu",
        help="torchrun's spelling of -n; auto: one per GPU, else 1; gpu: one per GPU; cpu: one per core",
    )
    add("--nnodes", default=None, help="number of nodes (default 1); torchrun's N:N is taken too")
    add(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        type=int,
        default=None,
        help="this node's index when --nnodes > 1",
    )
    add("--master", default=None, metavar="HOST:PORT", help="rendezvous host and port of node 0")
    add(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        default=None,
        help=f"torchrun's host of node 0 (with --master-port, default {TORCHRUN_MASTER_PORT}): --master HOST:PORT",
    )
    add("--master-port", "--master_port", dest="master_port", type=int, default=None, help="see --master-addr")
    add(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        dest="rdzv_endpoint",
        default=None,
        metavar="HOST[:PORT]",
        help=f"torchrun's rendezvous endpoint (port default {TORCHRUN_RDZV_PORT}): --master HOST:PORT",
    )
    add("--rdzv-id", "--rdzv_id", dest="rdzv_id", default=None, help="job id, the same on every node")
    add(
        "--rdzv-backend",
        "--rdzv_backend",
        dest="rdzv_backend",
        default=None,
        help="c10d (what ddpkit uses) or static (taken as c10d)",
    )
    add("--standalone", action="store_true", help="one node with its own rendezvous (the default)")
    add(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=int,
        default=0,
        help="restart the whole group up to K times when a worker fails",
    )
    add(
        "--fault-tolerant",
        action="store_true",
        help="per-step fault tolerance (torchft): -n replicas of one process each; a replica that dies "
        "is restarted on its own (--max-restarts counts per replica) and heals from a live peer "
        "while the others go on, with the same result; across hosts with --nnodes/--node-rank/--master "
        "(node 0 runs the lighthouse at the master's PORT, the job's store at PORT + 1) or under srun",
    )
    add(
        "--min-replicas",
        dest="min_replicas",
        type=int,
        default=None,
        help="with --fault-tolerant: the fewest replicas a step may commit with",
    )
    add(
        "--quorum-timeout",
        dest="quorum_timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --fault-tolerant: how long a replica waits for --min-replicas before it stops (default 60)",
    )
    add(
        "--secret-file",
        dest="secret_file",
        default=None,
        metavar="PATH",
        help="with --fault-tolerant across hosts: the job's secret, the same file (readable by you alone) on "
        "every node; heal payloads are signed with it (one machine: made for the job)",
    )
    add(
        "--local-ranks-filter",
        "--local_ranks_filter",
        dest="local_ranks_filter",
        default=None,
        metavar="RANKS",
        help="torchrun's: show only these local ranks' output (e.g. 0 or 0,2)",
    )
    add(
        "--monitor-interval",
        "--monitor_interval",
        dest="monitor_interval",
        default=None,
        metavar="SECONDS",
        help="torchrun's: how often the agent checks its workers",
    )
    add("--role", default=None, help="torchrun's: the workers' role name")
    add(
        "--tee",
        "-t",
        dest="tee",
        default=None,
        metavar="STREAMS",
        help="torchrun's: also write these streams (1 stdout, 2 stderr, 3 both; or rank:streams,...) to "
        "files under --log-dir",
    )
    add(
        "--redirects",
        "-r",
        dest="redirects",
        default=None,
        metavar="STREAMS",
        help="torchrun's: write these streams to files under --log-dir instead of this terminal",
    )
    add(
        "--log-dir",
        "--log_dir",
        dest="log_dir",
        default=None,
        metavar="DIR",
        help="torchrun's: where --tee and --redirects write (a directory of its own per run)",
    )
    add("-m", "--module", default=None, help="run a module, like python -m")
    add("script", nargs="?", help="the Python script to run, followed by its arguments")
    return parser


def cmd_run(argv: Sequence[str]) -> int:
    """``ddpkit run``: start the script under torch's elastic agent; the job's exit code."""
    die_with_launcher()  # a fault-tolerant replica's own ddpkit run: it ends when that launcher dies
    ours, rest = split(argv)
    opts = parser().parse_args(ours)
    if opts.fault_tolerant:
        return ft_launch.run(fault_tolerant_spec(opts, rest))
    ft_launch.refuse_alone(opts.min_replicas, opts.quorum_timeout, opts.secret_file)
    return run(spec_of(argv))


def fault_tolerant_spec(opts: argparse.Namespace, rest: Sequence[str]) -> Any:
    """The :class:`~ddpkit.distributed.ft_launch.FaultTolerantSpec` of ``ddpkit run --fault-tolerant``."""
    if opts.module is None and opts.script is None:
        raise UsageError("ddpkit run needs a SCRIPT or -m MODULE (see 'ddpkit run --help')")
    for dest, flag in _PASSED_ON.items():
        if getattr(opts, dest) is not None:
            raise UsageError(
                f"{flag} is not taken with --fault-tolerant (each replica has an agent of its own); drop {flag}"
            )
    nnodes = _nnodes(opts.nnodes)
    return fault_tolerant_job(
        opts.module or opts.script,
        rest,
        module=opts.module is not None,
        replicas=_nproc(opts.n, opts.nproc_per_node) or 1,
        nnodes=nnodes,
        node_rank=opts.node_rank,
        master=_master(opts, nnodes),
        min_replicas=opts.min_replicas,
        max_restarts=opts.max_restarts,
        quorum_timeout=opts.quorum_timeout,
        secret_file=opts.secret_file,
    )


def fault_tolerant_job(
    target: str,
    target_args: Sequence[str],
    *,
    module: bool,
    replicas: int,
    nnodes: int,
    node_rank: int | None,
    master: str | None,
    min_replicas: int | None,
    max_restarts: int,
    quorum_timeout: float | None,
    secret_file: str | None,
) -> FaultTolerantSpec:
    """A fault-tolerant job of ``replicas`` replicas a node (``ddpkit run --fault-tolerant``, ``ddpkit train
    --fault-tolerant``), placed as SLURM places it under srun (:func:`ft_launch.run` checks it).

    Args:
        target: the script, or the module with ``module``.
        target_args: its own arguments.
        module: ``target`` is a module.
        replicas: replicas on this node.
        nnodes: nodes of the job.
        node_rank: this node's index (None: one node, or SLURM's).
        master: ``HOST:PORT`` of node 0 across nodes.
        min_replicas: the fewest replicas a step may commit with (None: 1).
        max_restarts: restarts of each replica.
        quorum_timeout: seconds a replica waits for ``min_replicas`` (None: 60).
        secret_file: the job's secret across nodes.
    """
    where = RunSpec(target=target, nnodes=nnodes, node_rank=node_rank, master=master)
    nnodes, node_rank, master, _ = placement(where, detect())  # SLURM's, under srun
    if nnodes > 1 and node_rank is None:
        raise UsageError(
            f"--fault-tolerant --nnodes {nnodes} needs --node-rank I, this host's index (node 0 runs the lighthouse)"
        )
    return FaultTolerantSpec(
        target=target,
        target_args=list(target_args),
        replicas=replicas,
        min_replicas=min_replicas or 1,
        max_restarts=max_restarts,
        module=module,
        quorum_timeout_s=60.0 if quorum_timeout is None else quorum_timeout,
        nnodes=nnodes,
        node_rank=node_rank or 0,
        master=master,
        secret_file=secret_file,
    )


def spec_of(argv: Sequence[str]) -> RunSpec:
    """The :class:`~ddpkit.distributed.torchrun.RunSpec` of a ``ddpkit run`` command line (without ``run``)."""
    ours, rest = split(argv)
    opts = parser().parse_args(ours)
    if opts.module is None and opts.script is None:
        raise UsageError("ddpkit run needs a SCRIPT or -m MODULE (see 'ddpkit run --help')")
    nnodes = _nnodes(opts.nnodes)
    master = _master(opts, nnodes)
    if opts.rdzv_backend not in (None, "c10d", "static"):
        raise UsageError(
            f"--rdzv-backend {opts.rdzv_backend!r}: ddpkit run rendezvouses with c10d; drop the flag or give c10d"
        )
    for flag, value in (("--tee", opts.tee), ("--redirects", opts.redirects)):
        if value is not None and not _STREAMS.fullmatch(value):
            raise UsageError(
                f"{flag} {value!r}: give the streams as torchrun takes them, 0 (none), 1 (stdout), 2 (stderr) "
                "or 3 (both), or per local rank as 0:3,1:2"
            )
    agent_args = [
        f"{flag}={getattr(opts, dest)}" for dest, flag in _PASSED_ON.items() if getattr(opts, dest) is not None
    ]
    return RunSpec(
        target=opts.module or opts.script,
        target_args=rest,
        module=opts.module is not None,
        nproc_per_node=_nproc(opts.n, opts.nproc_per_node),
        nnodes=nnodes,
        node_rank=opts.node_rank,
        master=master,
        max_restarts=opts.max_restarts,
        run_id=opts.rdzv_id,
        agent_args=agent_args,
    )


def _nproc(n: int | None, torchrun: str | None) -> int | None:
    if torchrun is None:
        return n
    value = _nproc_value(torchrun)
    if n is not None and value is not None and n != value:
        raise UsageError(f"-n {n} and --nproc-per-node {torchrun} disagree; give one of them")
    return value if value is not None else n


def _nproc_value(text: str) -> int | None:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if text == "auto":
        return None  # ddpkit's default: one per GPU, else 1
    if text == "gpu":
        if not gpus:
            raise UsageError("--nproc-per-node gpu: torch sees no CUDA GPU here; give a number or auto")
        return gpus
    if text == "cpu":
        return os.cpu_count() or 1
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"--nproc-per-node {text!r}: give a number, auto, gpu or cpu") from None


def _nnodes(text: str | None) -> int:
    if text is None:
        return 1
    low, sep, high = text.partition(":")
    try:
        low_n, high_n = int(low), int(high if sep else low)
    except ValueError:
        raise UsageError(f"--nnodes {text!r}: give a number of nodes") from None
    if low_n != high_n:
        raise UsageError(
            f"--nnodes {text}: ddpkit run starts a fixed number of nodes (elastic MIN:MAX is "
            "not supported); give one number"
        )
    return low_n


def _master(opts: argparse.Namespace, nnodes: int) -> str | None:
    """``--master HOST:PORT`` from whichever of ours and torchrun's the user gave; only one may say it."""
    said = {}
    if opts.master is not None:
        said["--master"] = opts.master
    if opts.master_addr is not None or opts.master_port is not None:
        host = opts.master_addr or "127.0.0.1"
        said["--master-addr/--master-port"] = host_port(host, opts.master_port or TORCHRUN_MASTER_PORT)
    if opts.rdzv_endpoint is not None:
        host, sep, port = opts.rdzv_endpoint.rpartition(":")
        if not sep or "]" in port:  # no port (or a bare [v6] address)
            host, port = opts.rdzv_endpoint, str(TORCHRUN_RDZV_PORT)
        said["--rdzv-endpoint"] = host_port(host, port)
    if len(said) > 1:
        raise UsageError(f"{' and '.join(said)} both name the master; give one of them")
    if opts.standalone:
        if said or nnodes > 1:
            raise UsageError(
                f"--standalone is one node with its own rendezvous; it does not combine with "
                f"{next(iter(said), '--nnodes ' + str(nnodes))}"
            )
        return None
    return next(iter(said.values()), None)
