"""Starting processes, always through torch's elastic launcher (``torch.distributed.run``).

``ddpkit run`` is a thin front that fills in what torchrun leaves to the user (a free
loopback port, nodes from SLURM, threads per process); :func:`launch` runs a function in N
processes from a notebook or a script, the ``mp.spawn`` pattern without the index argument.
Both end their workers through :mod:`ddpkit.entry`, so a finished job cannot abort in
interpreter teardown.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
import tempfile
import uuid
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

from ddpkit.env import Environment, detect
from ddpkit.errors import DdpkitError, UsageError


@dataclass(frozen=True)
class RunSpec:
    """What ``ddpkit run`` was asked to start (validated)."""

    target: str
    target_args: Sequence[str] = ()
    module: bool = False
    nproc_per_node: int | None = None
    nnodes: int = 1
    node_rank: int | None = None
    master: str | None = None
    max_restarts: int = 0
    extra_env: Mapping[str, str] = field(default_factory=dict)
    run_id: str | None = None           # the same on every node; default: derived from the master


def parse_master(text: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` too) and check the port.

    Raises:
        UsageError: no port, or a port outside 1-65535.
    """
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise UsageError(f"--master {text!r} has no port; write HOST:PORT, e.g. --master node01:29500")
    try:
        port = int(port_text)
    except ValueError:
        raise UsageError(f"--master {text!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise UsageError(f"--master {text!r}: port {port} is out of range; use 1-65535")
    return host.strip("[]"), port


def default_nproc() -> int:
    """One process per visible GPU, else one."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


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


def torchrun_args(spec: RunSpec, env: Environment | None = None, store_port: int | None = None) -> list[str]:
    """The ``torch.distributed.run`` arguments for ``spec``.

    ``store_port``: ddpkit serves the rendezvous store itself on that port (see
    :func:`rendezvous_store`), so the agent joins it as a client (``is_host=false``).
    Single node: c10d rendezvous on a free loopback port chosen by the OS. Several nodes: c10d
    rendezvous at the master, hosted by node 0 (``--node-rank 0``, or the first SLURM node),
    under one run id on every node, so a failed worker restarts the whole job together. The
    rendezvous numbers the nodes (by address), so global rank 0 may live on any node.
    Under ``srun`` (one task per node) nodes, node rank and master come from SLURM.
    """
    nproc = spec.nproc_per_node or default_nproc()
    nnodes, node_rank, master, run_id = _placement(spec, detect() if env is None else env)
    args = [f"--nproc-per-node={nproc}", f"--max-restarts={spec.max_restarts}"]
    if master is None:
        # --local-addr: workers reach the store at 127.0.0.1, not at a host name that may not resolve
        own = ["--rdzv-conf=is_host=false"] if store_port else []
        return args + ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{store_port or 0}",
                       f"--rdzv-id={run_id or uuid.uuid4().hex[:12]}", "--local-addr=127.0.0.1", *own,
                       *_target(spec)]
    host, port = parse_master(master)
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    args += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
             f"--rdzv-id={run_id or f'ddpkit-{host}-{port}'}"]      # the same on every node
    if node_rank is not None:
        if not 0 <= node_rank < nnodes:
            raise UsageError(f"--node-rank {node_rank} is outside 0..{nnodes - 1}")
        args.append(f"--rdzv-conf=is_host={'true' if node_rank == 0 and not store_port else 'false'}")
    local = local_address(host, port)
    if local is not None:
        args.append(f"--local-addr={local}")     # peers reach rank 0's store here, not at its FQDN
    return args + _target(spec)


def _placement(spec: RunSpec, env: Environment) -> tuple[int, int | None, str | None, str | None]:
    """(nodes, node rank, master, run id) of ``spec``: from SLURM under srun, else as given.

    ``master`` is None only for a single-node run, which needs none.
    """
    if env.launcher == "slurm" and spec.master is None:
        if env.local_world_size != 1:
            raise UsageError(
                f"ddpkit run under srun needs one task per node, got {env.local_world_size}; "
                "use srun --ntasks-per-node=1 ddpkit run -n GPUS_PER_NODE ..."
            )
        return (env.world_size, env.node_rank, f"{env.master_addr}:{env.master_port}",
                spec.run_id or os.environ.get("SLURM_JOB_ID"))
    if spec.nnodes > 1 and spec.master is None:
        raise UsageError(f"--nnodes {spec.nnodes} needs --master HOST:PORT (the host of node 0)")
    return spec.nnodes, spec.node_rank, spec.master, spec.run_id


def _target(spec: RunSpec) -> list[str]:
    """The worker command: the target under :mod:`ddpkit.entry`, which ends it without teardown."""
    return ["--module", "ddpkit.entry", *(["-m", spec.target] if spec.module else [spec.target]),
            *spec.target_args]


def local_address(host: str, port: int) -> str | None:
    """This machine's address on the route to ``host``: where the other nodes can reach it.

    Sends nothing (a UDP socket only picks its route). None if ``host`` does not resolve or
    has no route; torchrun then falls back to this machine's FQDN.
    """
    import socket

    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError:
        return None


_STORE_TIMEOUT_S = 900.0         # how long the rendezvous store ddpkit serves waits on a client

AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""Variables for the elastic agent of every job, on top of ``spec.extra_env``.

The agent would otherwise open a second store for the workers, listening on every interface
(and, between nodes, telling attempts apart by a restart count each node keeps for itself).
Without it worker rank 0 hosts a fresh store for every attempt, bound to the master address
(:func:`ddpkit.process_group.init`).
"""


def rendezvous_store(spec: RunSpec, env: Environment | None = None) -> Any:
    """The rendezvous store ddpkit serves for ``spec`` on one address, or None (the agent hosts it).

    One node: on 127.0.0.1, a free port. Several nodes: on node 0 (``--node-rank 0`` or SLURM's
    first node), at the master's port on the master's address when that is one of this
    machine's non-loopback addresses; otherwise torchrun's agent hosts it, on every interface.
    """
    from ddpkit import stores

    nnodes, node_rank, master, _ = _placement(spec, detect() if env is None else env)
    if master is None:
        return stores.serve(stores.LOOPBACK, 0, timeout_s=_STORE_TIMEOUT_S)
    if node_rank != 0:
        return None
    host, port = parse_master(master)
    local = local_address(host, port)
    if local is None or stores.is_loopback(local):
        return None
    try:
        return stores.serve(local, port, timeout_s=_STORE_TIMEOUT_S)
    except OSError:                 # the master's address is not this machine's: the agent decides
        return None



def validate(spec: RunSpec) -> None:
    """Check what can be checked before any process starts."""
    if spec.nproc_per_node is not None and spec.nproc_per_node < 1:
        raise UsageError(f"-n/--nproc-per-node must be at least 1, got {spec.nproc_per_node}")
    if spec.nnodes < 1:
        raise UsageError(f"--nnodes must be at least 1, got {spec.nnodes}")
    if spec.max_restarts < 0:
        raise UsageError(f"--max-restarts must be 0 or more, got {spec.max_restarts}")
    if spec.master is not None:
        parse_master(spec.master)
    if not spec.module and not os.path.isfile(spec.target):
        raise UsageError(f"script {spec.target!r} not found; give the path of a Python file or use -m MODULE")


@contextlib.contextmanager
def _thread_env(nproc_per_node: int, extra: Mapping[str, str] = {}) -> Iterator[None]:
    """Set OMP_NUM_THREADS (unless the user did) and ``extra`` for the children, then restore."""
    updates = dict(extra)
    if "OMP_NUM_THREADS" not in os.environ:
        updates["OMP_NUM_THREADS"] = str(threads_per_process(nproc_per_node))
    saved = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run(spec: RunSpec) -> int:
    """Start ``spec`` under torch's elastic agent and wait; returns the exit code."""
    validate(spec)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torch_run

    store = rendezvous_store(spec)           # kept alive (and listening) until the run ends
    argv = torchrun_args(spec, store_port=store.port if store is not None else None)
    nproc = spec.nproc_per_node or default_nproc()
    with _thread_env(nproc, {**AGENT_ENV, **spec.extra_env}):
        try:
            torch_run(parse_args(argv))
        except ChildFailedError as exc:
            rank, failure = _root_failure(exc.failures)
            sys.stderr.write(f"ddpkit run: rank {rank} failed first ({_describe(failure)}); see its output above\n")
            return 1
    return 0


# Errors a rank raises because a peer died first: never the root cause when another exists.
_SECONDARY = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "remote worker crashing", "sigterm", "signal 15")


def _root_failure(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The failure that most likely caused the others: not a peer-loss error, earliest, lowest rank."""

    def key(item: tuple[int, Any]) -> tuple[bool, int, int]:
        rank, failure = item
        return _is_secondary(_failure_text(failure)), int(getattr(failure, "timestamp", 0) or 0), rank

    return min(failures.items(), key=key)


def _is_secondary(text: str) -> bool:
    return any(word in text.lower() for word in _SECONDARY)


def _failure_text(failure: Any) -> str:
    text = str(getattr(failure, "message", "") or "")
    code = getattr(failure, "exitcode", None)
    if code == -15:
        text += " SIGTERM"
    return text


def _describe(failure: Any) -> str:
    code = getattr(failure, "exitcode", None)
    if code is not None and code < 0:
        import signal

        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class LaunchError(DdpkitError):
    """A process started by :func:`launch` failed; carries its rank and traceback."""

    def __init__(self, rank: int, message: str, traceback: str = ""):
        self.rank = rank
        self.child_traceback = traceback
        text = f"rank {rank} failed: {message}"
        super().__init__(text + (f"\n\nTraceback from rank {rank}:\n{traceback}" if traceback else ""))


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    max_restarts: int = 0,
    start_method: str | None = None,
) -> dict[int, Any]:
    """Call ``fn(*args)`` in ``nprocs`` processes on one machine and wait for all of them.

    Unlike ``mp.spawn`` no index is passed first: ``ddpkit.init()`` inside ``fn`` knows the
    rank. The rendezvous uses a free loopback port, so two launches never collide.

    Returns:
        Each rank's return value, ``{rank: value}``.

    Raises:
        LaunchError: the first rank that failed, with its traceback.

    Example:
        >>> def work():
        ...     rt = ddpkit.init()
        ...     return rt.all_reduce(rt.rank)
        >>> ddpkit.launch(work, nprocs=2)        # doctest: +SKIP
        {0: 1.0, 1: 1.0}
    """
    if nprocs < 1:
        raise UsageError(f"nprocs must be at least 1, got {nprocs}")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from ddpkit import entry, stores       # entry not at the top: python -m ddpkit.entry must import it first

    store = stores.serve(stores.LOOPBACK, 0, timeout_s=_STORE_TIMEOUT_S)   # listens on loopback only
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=uuid.uuid4().hex[:12],
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{store.port}",
        rdzv_configs={"is_host": False},
        local_addr="127.0.0.1",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method=start_method or _start_method(fn),
    )
    with tempfile.TemporaryDirectory(prefix="ddpkit-launch-") as error_dir, _thread_env(nprocs, AGENT_ENV):
        try:
            returned = elastic_launch(config, entry.call_and_record)(fn, error_dir, config.start_method, *args)
        except ChildFailedError as exc:
            raise _earliest_error(error_dir) or _launch_error(*_root_failure(exc.failures)) from None
    return {rank: pickle.loads(value) for rank, value in returned.items()}   # bytes: see entry._by_value


def _earliest_error(error_dir: str) -> LaunchError | None:
    records = []
    for path in Path(error_dir).glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
    if not records:
        return None
    first = min(records, key=lambda r: (_is_secondary(r["message"]), r["time"], r["rank"]))
    return LaunchError(first["rank"], first["message"], first["traceback"].strip())


def _start_method(fn: Callable[..., Any]) -> str:
    # Functions typed into a notebook or REPL live in a __main__ that spawned children
    # cannot import; fork them instead. Everything else gets the safe default, spawn.
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        return "fork"
    return "spawn"


def _launch_error(rank: int, failure: Any) -> LaunchError:
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message", {}) if isinstance(data, dict) else {}
    if isinstance(message, dict):
        text = str(message.get("message", "")).strip()
        traceback = str(message.get("extraInfo", {}).get("py_callstack", "")).strip()
    else:
        text, traceback = str(message), ""
    return LaunchError(rank, text or _describe(failure), traceback)
