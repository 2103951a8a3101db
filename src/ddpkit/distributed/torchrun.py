"""``ddpkit run``: starting a script's processes through torch's elastic launcher (``torch.distributed.run``).

``ddpkit run`` is a thin front that fills in what torchrun leaves to the user (stores in a
private directory on one node, nodes from SLURM, threads per process). Its workers end through
:mod:`ddpkit.entry`, so a finished job cannot abort in interpreter teardown. :func:`ddpkit.launch`
(:mod:`ddpkit.distributed.launch`) starts its processes with the same private job, agent variables and
failure ranking, from here.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit import _torch
from ddpkit._torch import elastic_signal_exception
from ddpkit.distributed import preemption, stores
from ddpkit.distributed.environment import Environment, detect
from ddpkit.distributed.failures import describe, root_failure
from ddpkit.distributed.host import LOOPBACK, default_nproc, host_port, is_loopback, local_address, threads_per_process
from ddpkit.distributed.parent import launcher_env
from ddpkit.distributed.stores import rendezvous_file
from ddpkit.errors import EXIT_HANG, EXIT_MISMATCH, UsageError


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
    run_id: str | None = None  # the same on every node; default: derived from the master
    agent_args: Sequence[str] = ()  # torchrun flags passed on as given (--local-ranks-filter, ...)


def parse_master(text: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` too) and check it: a host, balanced brackets, a port in range.

    Raises:
        UsageError: no host, no port, unbalanced brackets, or a port outside 1-65535.
    """
    example = "write HOST:PORT, e.g. --master node01:29500 or --master [fe80::1]:29500"
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text:
        raise UsageError(f"--master {text!r} has no port; {example}")
    if (
        host.startswith("[") != host.endswith("]")
        or host.count("[") > 1
        or host.count("]") > 1
        or ("[" in host.strip("[]") or "]" in host.strip("[]"))
    ):
        raise UsageError(f"--master {text!r} has unbalanced brackets; {example}")
    host = host[1:-1] if host.startswith("[") else host
    if not host.strip():
        raise UsageError(f"--master {text!r} has no host; {example}")
    if "%" in host:
        raise UsageError(
            f"--master {text!r}: torch's rendezvous takes no zone index (%{host.split('%', 1)[1]}) on "
            "an address; give the node's host name or a global IPv6 address instead of a link-local one"
        )
    if "[" in port_text or "]" in port_text:
        raise UsageError(f"--master {text!r} has unbalanced brackets; {example}")
    try:
        port = int(port_text)
    except ValueError:
        raise UsageError(f"--master {text!r}: port {port_text!r} is not a number; {example}") from None
    if not 0 < port < 65536:
        raise UsageError(f"--master {text!r}: port {port} is out of range; use 1-65535")
    return host, port


RESOLVE_TIMEOUT_S = 5.0


def resolve_master(host: str, port: int, timeout_s: float = RESOLVE_TIMEOUT_S) -> str:
    """The address ``host`` resolves to, within ``timeout_s`` (a resolver that hangs does not hang us).

    Raises:
        UsageError: the name does not resolve, or its resolver did not answer in time.
    """
    import socket
    import threading

    answer: dict[str, Any] = {}

    def ask() -> None:
        try:
            answer["address"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
        except OSError as exc:
            answer["error"] = exc

    asker = threading.Thread(target=ask, daemon=True, name="ddpkit-resolve-master")
    asker.start()
    asker.join(timeout_s)
    if "address" in answer:
        return answer["address"]
    why = f"its resolver did not answer within {timeout_s:g} s" if asker.is_alive() else "it does not resolve"
    raise UsageError(
        f"master host {host!r} cannot be used: {why}; give node 0's address or a name that "
        "resolves on every node (check /etc/hosts or DNS)"
    )


def torchrun_args(
    spec: RunSpec, env: Environment | None = None, store_port: int | None = None, store_dir: str | None = None
) -> list[str]:
    """The ``torch.distributed.run`` arguments for ``spec``.

    One node (``--nnodes 1``, whatever master is named): the c10d rendezvous keeps its state in a
    ``FileStore`` file of ``store_dir`` (torchrun's ``store_type=file``), so no rendezvous socket
    exists. Several nodes: c10d rendezvous at the master, hosted by node 0 (``--node-rank 0``, or
    the first SLURM node), under one run id on every node, so a failed worker restarts the whole job
    together. The rendezvous numbers the nodes (by address), so global rank 0 may live on any node.
    Under ``srun`` (one task per node) nodes, node rank and master come from SLURM.

    Args:
        spec: what ``ddpkit run`` was asked to start.
        env: the launcher's environment, read for SLURM's placement (None: detected now).
        store_port: given when ddpkit serves the rendezvous store itself (:func:`rendezvous_store`):
            node 0's agent then joins it as a client (None: the agent hosts it).
        store_dir: the job's private directory (:func:`ddpkit.distributed.stores.private_dir`); a one-node job needs it.

    Raises:
        UsageError: a one-node job without ``store_dir``, or a node rank outside the nodes.
    """
    nproc = spec.nproc_per_node or default_nproc()
    nnodes, node_rank, master, run_id = placement(spec, detect() if env is None else env)
    args = [f"--nproc-per-node={nproc}", f"--max-restarts={spec.max_restarts}"]
    args += list(spec.agent_args)
    if master is None:
        if not store_dir:
            raise UsageError("a one-node job needs its private store directory (ddpkit.distributed.stores.private_dir)")

        # --local-addr: the node's name in the rendezvous; nothing listens there
        return args + [
            "--nnodes=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rendezvous_file(store_dir)}",
            "--rdzv-conf=store_type=file",
            f"--rdzv-id={run_id or uuid.uuid4().hex[:12]}",
            "--local-addr=127.0.0.1",
            *_target(spec),
        ]
    host, port = parse_master(master)

    args += [
        f"--nnodes={nnodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={host_port(host, port)}",
        f"--rdzv-id={run_id or f'ddpkit-{host}-{port}'}",
    ]  # the same on every node
    if node_rank is not None:
        if not 0 <= node_rank < nnodes:
            raise UsageError(f"--node-rank {node_rank} is outside 0..{nnodes - 1}")
        args.append(f"--rdzv-conf=is_host={'true' if node_rank == 0 and not store_port else 'false'}")
    local = local_address(host, port)
    if local is not None:
        args.append(f"--local-addr={local}")  # peers reach rank 0's store here, not at its FQDN
    return args + _target(spec)


def placement(spec: RunSpec, env: Environment) -> tuple[int, int | None, str | None, str | None]:
    """(nodes, node rank, master, run id) of ``spec``: from SLURM under srun, else as given.

    ``master`` is None for a one-node run, whatever master was named (torchrun's
    ``--master_addr``/``--rdzv-endpoint`` spellings of one machine included): it meets through its
    private directory and needs no address.
    """
    if env.launcher == "slurm" and spec.master is None:
        if env.local_world_size != 1:
            raise UsageError(
                f"ddpkit run under srun needs one task per node, got {env.local_world_size}; "
                "use srun --ntasks-per-node=1 ddpkit run -n GPUS_PER_NODE ..."
            )
        run_id = spec.run_id or os.environ.get("SLURM_JOB_ID")
        if env.world_size == 1:
            return 1, None, None, run_id
        return env.world_size, env.node_rank, f"{env.master_addr}:{env.master_port}", run_id
    if spec.nnodes > 1 and spec.master is None:
        raise UsageError(f"--nnodes {spec.nnodes} needs --master HOST:PORT (the host of node 0)")
    if spec.nnodes == 1:
        if spec.node_rank not in (None, 0):
            raise UsageError(
                f"--node-rank {spec.node_rank} with one node: a one-node job is node 0; give --nnodes N "
                "(and --master HOST:PORT) for a job of several nodes"
            )
        return 1, None, None, spec.run_id
    return spec.nnodes, spec.node_rank, spec.master, spec.run_id


def _target(spec: RunSpec) -> list[str]:
    """The worker command: the target under :mod:`ddpkit.entry`, which ends it without teardown."""
    return ["--module", "ddpkit.entry", *(["-m", spec.target] if spec.module else [spec.target]), *spec.target_args]


_STORE_TIMEOUT_S = 900.0  # how long the rendezvous store ddpkit serves waits on a client


def flight_recorder_env() -> dict[str, str]:
    """torch's flight recorder, on in every ``ddpkit run`` unless the user set its variables.

    The last 2000 collectives of each process (NCCL; gloo too on recent torch), which the hang
    watchdog's reports quote, and NCCL's own dump when its watchdog times out
    (``TORCH_NCCL_DUMP_ON_TIMEOUT``). The buffer's variable is ``TORCH_FR_BUFFER_SIZE`` on a torch
    that has it, ``TORCH_NCCL_TRACE_BUFFER_SIZE`` before (now deprecated, with a warning per process).
    ``TORCH_FR_DUMP_TEMP_FILE`` names where NCCL dumps: ``ddpkit run`` points it into the job's
    private directory (mode 0700) and keeps a dump there, saying where, when the job ends
    (:func:`_keep_flight_dumps`).
    """
    return {_torch.flight_recorder_buffer_variable(): _torch.FLIGHT_RECORDER_SIZE, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def _keep_flight_dumps(notes: str) -> None:
    """Move NCCL's flight-recorder dumps out of the job's directory before it is removed, and say where."""
    import glob
    import tempfile

    # torchft makes an empty directory of that name for each quorum's process group: only a
    # dump with something in it is kept (else every fault-tolerant job left a folder in /tmp)
    dumps = [
        path
        for path in sorted(glob.glob(os.path.join(notes, "flight-recorder-rank-*")))
        if (os.listdir(path) if os.path.isdir(path) else os.path.getsize(path))
    ]
    if not dumps:
        return
    kept = tempfile.mkdtemp(prefix="ddpkit-flight-recorder-")  # 0700, the user's own
    for path in dumps:
        os.replace(path, os.path.join(kept, os.path.basename(path)))
    sys.stderr.write(f"ddpkit run: NCCL's flight recorder dumped {len(dumps)} file(s) into {kept}\n")


AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""Variables for the elastic agent of every job, on top of ``spec.extra_env``.

The agent would otherwise open a second store for the workers, listening on every interface
(and, between nodes, telling attempts apart by a restart count each node keeps for itself).
Without it worker rank 0 hosts a fresh store for every attempt, bound to the master address
(:func:`ddpkit.distributed.process_group.init`).
"""


def rendezvous_store(spec: RunSpec, env: Environment | None = None) -> Any:
    """The rendezvous store ddpkit serves for a job of several nodes, or None (the agent hosts it).

    On node 0 (``--node-rank 0`` or SLURM's first node), at the master's port on the master's
    address when that is one of this machine's non-loopback addresses, bound before any port is
    published; otherwise torchrun's agent hosts it, on every interface. A one-node job has none
    (its stores are files: :func:`ddpkit.distributed.stores.private_dir`).
    """
    nnodes, node_rank, master, _ = placement(spec, detect() if env is None else env)
    if master is None or node_rank != 0:
        return None
    host, port = parse_master(master)
    local = local_address(host, port)
    if local is None or is_loopback(local):
        return None
    try:
        return stores.serve(local, port, timeout_s=_STORE_TIMEOUT_S)
    except OSError:  # the master's address is not this machine's: the agent decides
        return None


ASKED_MASTER_ENV = "DDPKIT_ASKED_MASTER"
"""``HOST:PORT`` a one-node ``ddpkit run`` was given (``--master_addr``/``--master_port``,
``--rdzv-endpoint``, ``--master``): the worker entry sets ``MASTER_ADDR`` and ``MASTER_PORT`` to it,
as torchrun would, though the job itself meets through its private directory."""


@contextlib.contextmanager
def private_job(nnodes: int = 1, master: str | None = None) -> Iterator[tuple[str | None, dict[str, str]]]:
    """(private directory or None, variables for the workers) of a job; the directory goes at the end.

    One node: a new directory only this user can open, which holds the rendezvous and the workers'
    stores, and gloo/NCCL on loopback. Several nodes: no directory, gloo/NCCL on the interface of
    the route to the master (the user's ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` stay).
    """
    import shutil

    if master is not None:
        host, port = parse_master(master)
        yield None, stores.socket_env(nnodes, host, port)
        return
    directory = stores.private_dir()
    try:
        yield directory, {stores.STORE_DIR_ENV: directory, **stores.socket_env(1, LOOPBACK, 0)}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def validate(spec: RunSpec) -> None:
    """Check what can be checked before any process starts."""
    if spec.nproc_per_node is not None and spec.nproc_per_node < 1:
        raise UsageError(f"-n/--nproc-per-node must be at least 1, got {spec.nproc_per_node}")
    if spec.nnodes < 1:
        raise UsageError(f"--nnodes must be at least 1, got {spec.nnodes}")
    if spec.max_restarts < 0:
        raise UsageError(f"--max-restarts must be 0 or more, got {spec.max_restarts}")
    if spec.node_rank is not None and spec.nnodes > 1 and not 0 <= spec.node_rank < spec.nnodes:
        raise UsageError(f"--node-rank {spec.node_rank} is outside 0..{spec.nnodes - 1}")
    if spec.master is not None:
        resolve_master(*parse_master(spec.master))  # last: a resolver may take its 5 s
    check_target(spec.target, module=spec.module)


def check_target(target: str, *, module: bool) -> None:
    """Refuse, before any process starts, a script that is not a file or a module whose top package
    ``python -m`` would not find (from the current directory, as the workers start)."""
    if not module:
        if not os.path.isfile(target):
            raise UsageError(f"script {target!r} not found; give the path of a Python file or use -m MODULE")
        return
    import importlib.machinery
    import importlib.util

    top = target.partition(".")[0]
    # finding a top-level name runs none of its code (a dotted one would import its packages)
    if top in sys.modules or importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is not None:
        return
    if importlib.util.find_spec(top) is None:  # built-in and frozen modules
        raise UsageError(
            f"module {target!r} not found: no {top!r} in the current directory or on sys.path; "
            "run from the directory that holds it, or add it to PYTHONPATH"
        )


@contextlib.contextmanager
def _thread_env(nproc_per_node: int, extra: Mapping[str, str] = {}) -> Iterator[None]:
    """Set OMP_NUM_THREADS (unless the user did), this launcher's pid and ``extra`` for the children, then restore."""
    updates = {**launcher_env(), **extra}  # workers end when this process dies (ddpkit.distributed.parent)
    taken = set(os.environ) | set(extra)
    if not taken & {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}:
        updates.update({k: v for k, v in flight_recorder_env().items() if k not in taken})
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


def _own_signals() -> bool:
    """Whether torchrun can leave SIGTERM and SIGUSR1 to ddpkit (``--signals-to-handle``, torch >= 2.9)."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    return "signals_to_handle" in {f.name for f in dataclasses.fields(LaunchConfig)}


def _signal_args() -> list[str]:
    """torchrun's signals, less SIGTERM and SIGUSR1, which ``ddpkit run`` handles itself (given
    only where it installed its handlers: :func:`ddpkit.distributed.preemption.pass_on`).

    ``ddpkit run`` notes a preemption signal for its workers, then stops the agent as torch's own
    handler does: the agent sends that signal (SIGTERM or SLURM's SIGUSR1) to every worker and
    gives them ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (default 30) to save
    (:mod:`ddpkit.distributed.preemption`). With an older torch, torch handles SIGTERM as before.
    """
    return ["--signals-to-handle=SIGINT,SIGHUP,SIGQUIT"]


def _where_output(agent_args: Sequence[str], local_rank: Any) -> str:
    """Where a failed worker's error went: this terminal, or its log files (torchrun's ``--redirects`` of
    its stderr: 2 or 3, for every local rank or for its own, ``0:3,1:2``)."""
    given = dict(arg.split("=", 1) for arg in agent_args if "=" in arg)
    streams = given.get("--redirects", "0")
    if ":" in streams:
        streams = dict(part.split(":", 1) for part in streams.split(",")).get(str(local_rank), "0")
    if streams not in ("2", "3"):
        return "above"
    log_dir = given.get("--log-dir")
    return (
        f"in its log under {log_dir}" if log_dir else "in its log (under a temporary directory: --log-dir chooses it)"
    )


def run(spec: RunSpec) -> int:
    """Start ``spec`` under torch's elastic agent and wait; returns the exit code.

    A job stopped by SIGTERM or SIGUSR1 whose workers saved a checkpoint for it returns
    :data:`ddpkit.distributed.preemption.EXIT_CODE` (75); stopped before they saved, 128 + the signal.
    """
    import shutil
    import tempfile

    validate(spec)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torch_run

    nnodes, _, master, _ = placement(spec, detect())
    store = rendezvous_store(spec)  # kept alive (and listening) until the run ends
    nproc = spec.nproc_per_node or default_nproc()
    notes = tempfile.mkdtemp(prefix="ddpkit-run-")  # mode 0700: the preemption notice and marker
    marker = os.path.join(notes, "preempted-save-done")
    notice = os.path.join(notes, "preemption-signal")
    notes_env = {preemption.MARKER_ENV: marker}
    if "TORCH_FR_DUMP_TEMP_FILE" not in os.environ and "TORCH_FR_DUMP_TEMP_FILE" not in spec.extra_env:
        # NCCL's dump on timeout, in this private directory rather than at a name any user can take in /tmp
        notes_env["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(notes, "flight-recorder-rank-")
    undo = None
    if _own_signals() and threading.current_thread() is threading.main_thread():
        undo = preemption.pass_on(notice)
        notes_env[preemption.NOTICE_ENV] = notice
    try:
        with private_job(nnodes, master) as (directory, worker_env):
            argv = torchrun_args(spec, store_port=store.port if store is not None else None, store_dir=directory)
            if master is None and spec.master is not None:  # one node: the script sees the master asked
                worker_env[ASKED_MASTER_ENV] = spec.master
            if undo is not None:
                argv = _signal_args() + argv
            with _thread_env(nproc, {**AGENT_ENV, **worker_env, **spec.extra_env, **notes_env}):
                try:
                    torch_run(parse_args(argv))
                except ChildFailedError as exc:
                    codes = {getattr(f, "exitcode", None) for f in exc.failures.values()}
                    if codes == {preemption.EXIT_CODE}:
                        sys.stderr.write(
                            "ddpkit run: the workers were preempted and saved a checkpoint; "
                            f"exit code {preemption.EXIT_CODE} (a resume continues from it)\n"
                        )
                        return preemption.EXIT_CODE
                    rank, failure = root_failure(exc.failures)
                    sys.stderr.write(
                        f"ddpkit run: rank {rank} failed first ({describe(failure)}); see its output "
                        f"{_where_output(spec.agent_args, getattr(failure, 'local_rank', None))}\n"
                    )
                    # every rank that exited by itself refused its input (argparse, ddpkit's one-line
                    # usage errors): a usage error, exit 2 too
                    own = {f.exitcode for f in exc.failures.values() if (getattr(f, "exitcode", None) or 0) > 0}
                    if getattr(failure, "exitcode", None) in (EXIT_MISMATCH, EXIT_HANG):
                        return failure.exitcode  # the watchdog's verdict: a collective mismatch, a hang
                    return 2 if own == {2} else 1
                except elastic_signal_exception() as exc:
                    return preemption.stopped(exc.sigval, os.path.exists(marker), notice)
            if directory is not None and nproc > 1 and not any(Path(directory).glob("workers-*")):
                sys.stderr.write(
                    f"ddpkit run: warning: none of the {nproc} processes joined a process group, so each "
                    "ran the whole script on its own; call ddpkit.init() (or "
                    "torch.distributed.init_process_group()) in the script, or run it with -n 1\n"
                )
    finally:
        if undo is not None:
            undo()
        _keep_flight_dumps(notes)
        shutil.rmtree(notes, ignore_errors=True)
    return 0
