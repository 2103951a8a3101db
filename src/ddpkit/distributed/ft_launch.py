"""``ddpkit run --fault-tolerant -n N``: torchft's lighthouse and N replicas, each restarted on its own.

On one machine, torchft's lighthouse and the replicas' manager servers run in the job's control
plane (:mod:`ddpkit.distributed.ft_control`): one process in a network namespace of its own, which the
replicas reach through a Unix socket in the job's private directory (mode 0700). That directory
also holds the replica groups' stores, the job's store and the job's secret, with which heal
payloads are signed (:class:`ddpkit.distributed.ft_heal.SafeTransport`). Each replica is a one-process
``ddpkit run`` (torch's elastic agent) with ``--max-restarts K``: when it dies, its own agent
restarts it and it heals from a live peer, while the other replicas go on. This process only
starts them and watches: when the control plane dies, every replica is stopped (one line), so the
replicas never split into groups that train apart.

Across hosts (``--nnodes H --node-rank I --master HOST:PORT --secret-file F``, or SLURM's
placement under ``srun``) every node starts its N replicas; node 0 also runs the lighthouse,
listening on the master address at PORT, and the job's store (a torch ``TCPStore``) at PORT + 1.
The managers, stores and heal servers listen on each node's address on the job's network; heal
payloads are signed with the secret in F, the same file on every node. The other nodes beat into
the job's store every second: a node that loses it (node 0 died, and the lighthouse with it)
stops its replicas with one line, and node 0 keeps the lighthouse up until every other node has
ended or gone silent.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddpkit.distributed import ft, ft_control, ft_heal, stores
from ddpkit.distributed.ft_watch import NODE_JOIN_S, end_lighthouse, stop_replicas, wait_for_nodes, watch
from ddpkit.distributed.host import host_port, local_address, visible_gpus
from ddpkit.distributed.parent import launcher_env
from ddpkit.distributed.torchrun import check_target, parse_master
from ddpkit.errors import EXIT_MISMATCH, UsageError

HOST = "127.0.0.1"

_LIGHTHOUSE = """
import sys, time
from ddpkit.distributed.parent import die_with_launcher
die_with_launcher()  # the launcher killed (SIGKILL too): the lighthouse ends with it
from torchft._torchft import LighthouseServer
bind, min_replicas, join, tick, heartbeat = sys.argv[1:6]
server = LighthouseServer(bind=bind, min_replicas=int(min_replicas), join_timeout_ms=int(join),
                          quorum_tick_ms=int(tick), heartbeat_timeout_ms=int(heartbeat))
print(server.address().rsplit(":", 1)[-1], flush=True)
while True:
    time.sleep(3600)
"""


@dataclass(frozen=True)
class FaultTolerantSpec:
    """What ``ddpkit run --fault-tolerant`` was asked."""

    target: str
    """The script (or module, with ``module``)."""
    target_args: Sequence[str]
    """The script's own arguments."""
    replicas: int
    """Replicas started (``-n``)."""
    min_replicas: int = 1
    """The fewest replicas a step may commit with."""
    max_restarts: int = 3
    """Restarts of each replica (its own elastic agent counts them)."""
    module: bool = False
    """``target`` is a module (``-m``)."""
    quorum_timeout_s: float = 60.0
    """How long a replica waits for ``min_replicas`` before it stops."""
    nnodes: int = 1
    """Hosts of the job, each starting ``replicas`` replicas."""
    node_rank: int = 0
    """This host's index, 0 to ``nnodes - 1``: node 0 runs the lighthouse."""
    master: str | None = None
    """``HOST:PORT`` of node 0 across hosts: the lighthouse listens there, the job's store at PORT + 1."""
    secret_file: str | None = None
    """Across hosts: the job's secret, the same file on every node (one machine: made for the job)."""

    @property
    def total(self) -> int:
        """Replicas of the whole job."""
        return self.replicas * self.nnodes


def refuse_alone(min_replicas: int | None, quorum_timeout: float | None, secret_file: str | None) -> None:
    """The fault-tolerant flags given without ``--fault-tolerant``: one line."""
    for flag, value in (
        ("--min-replicas", min_replicas),
        ("--quorum-timeout", quorum_timeout),
        ("--secret-file", secret_file),
    ):
        if value is not None:
            raise UsageError(f"{flag} is for fault-tolerant jobs: add --fault-tolerant, or drop {flag}")


def validate(spec: FaultTolerantSpec) -> None:
    """Refuse what cannot run, in one line."""
    ft.check_installed()
    check_target(spec.target, module=spec.module)
    if spec.replicas < 1:
        raise UsageError(f"--fault-tolerant needs -n of at least 1 replica, got {spec.replicas}")
    if spec.max_restarts < 0:
        raise UsageError(f"--max-restarts must be 0 or more, got {spec.max_restarts}")
    if not spec.quorum_timeout_s > 0:  # (NaN too)
        raise UsageError(f"--quorum-timeout must be a number of seconds above 0, got {spec.quorum_timeout_s}")
    if spec.nnodes > 1:
        if spec.master is None:
            raise UsageError(
                f"--fault-tolerant --nnodes {spec.nnodes} needs --master HOST:PORT (node 0's "
                "address; its lighthouse listens at PORT, the job's store at PORT + 1)"
            )
        if not 0 <= spec.node_rank < spec.nnodes:
            raise UsageError(f"--node-rank {spec.node_rank} must be between 0 and --nnodes - 1 ({spec.nnodes - 1})")
        _split_master(spec.master)
    if not 1 <= spec.min_replicas <= spec.total:
        raise UsageError(f"--min-replicas {spec.min_replicas} must be between 1 and the job's replicas ({spec.total})")
    if spec.nnodes > 1 and spec.secret_file is None:
        raise UsageError(
            f"--fault-tolerant --nnodes {spec.nnodes} needs --secret-file PATH (the same file on "
            "every node: heal payloads are signed with it); make one with: python -c 'import "
            "secrets; print(secrets.token_hex(32))' > PATH && chmod 600 PATH"
        )
    if spec.nnodes == 1 and spec.secret_file is not None:
        raise UsageError(
            "--secret-file is for a fault-tolerant job across hosts (--nnodes); on one machine the "
            "job makes its own: drop --secret-file"
        )
    if spec.secret_file is not None:
        ft_heal.read_secret(spec.secret_file)


def _split_master(master: str) -> tuple[str, int]:
    host, port = parse_master(master)
    if port >= 65535:
        raise UsageError(f"--master {master}: give a port below 65535 (the job's store takes PORT + 1)")
    return host, port


def start_lighthouse(min_replicas: int, host: str = HOST, port: int = 0) -> tuple[subprocess.Popen, str]:
    """torchft's lighthouse in a child process listening on ``host:port`` (0: a free port); (process, its address)."""
    bind = host_port(host, port)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _LIGHTHOUSE,
            bind,
            str(min_replicas),
            str(ft.JOIN_TIMEOUT_MS),
            str(ft.QUORUM_TICK_MS),
            str(ft.HEARTBEAT_TIMEOUT_MS),
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn"), **launcher_env()},
    )
    assert child.stdout is not None
    port = child.stdout.readline().strip()
    if not port.isdigit():
        child.kill()
        raise UsageError(
            f"torchft's lighthouse did not start on {bind} (is the port free, and torchft installed? "
            "pip install 'ddpkit[ft]')"
        )
    return child, f"http://{host_port(host, port)}"


def start_control_plane(min_replicas: int, directory: str) -> tuple[subprocess.Popen, str]:
    """One machine: the lighthouse and the managers' servers in a process no other can reach; (process, lighthouse).

    Says in one line when the kernel gave it no namespace of its own (it then listens on 127.0.0.1).
    """
    try:
        child, address, refused = ft_control.start(
            directory, min_replicas, ft.JOIN_TIMEOUT_MS, ft.QUORUM_TICK_MS, ft.HEARTBEAT_TIMEOUT_MS
        )
    except RuntimeError as exc:
        raise UsageError(f"{exc} (is torchft installed? pip install 'ddpkit[ft]')") from None
    if refused:
        sys.stderr.write(
            f"ddpkit run: warning: the fault-tolerant control plane got no network namespace of its "
            f"own ({refused}: unprivileged user namespaces are off), so torchft's lighthouse and "
            "managers listen on 127.0.0.1, where other users of this machine can reach them "
            "(docs/concepts/security.md)\n"
        )
    return child, address


def replica_command(spec: FaultTolerantSpec) -> list[str]:
    """One replica: a one-process ``ddpkit run`` that restarts it up to ``max_restarts`` times."""
    target = ["-m", spec.target] if spec.module else [spec.target]
    return [
        sys.executable,
        "-m",
        "ddpkit",
        "run",
        "-n",
        "1",
        "--max-restarts",
        str(spec.max_restarts),
        *target,
        *spec.target_args,
    ]


def replica_env(
    spec: FaultTolerantSpec,
    index: int,
    lighthouse: str,
    job: str,
    environ: Any = None,
    host: str = HOST,
    sockets: dict[str, str] | None = None,
    secret: str = "",
    private: str = "",
    gpus: Sequence[str] = (),
) -> dict[str, str]:
    """The environment of replica ``index``.

    Each replica is a one-process ``ddpkit run`` (local rank 0), so on a GPU node it is shown one GPU
    of the node's, its own where there are enough: without, every replica took GPU 0, and NCCL refuses
    two ranks on one GPU at the first quorum. Where replicas outnumber the GPUs they share them round
    robin, and a replica that trains on CUDA refuses that in one line (:data:`ft.SHARED_GPU_ENV`).

    Args:
        spec: the job.
        index: the replica, 0 to ``spec.total - 1`` (node ``I``'s are ``I * replicas`` on).
        lighthouse: the lighthouse's address.
        job: the job's store (:data:`ddpkit.distributed.ft.JOB_STORE_ENV`).
        environ: the environment to start from (default: this process's).
        host: this node's address, where the replica's servers listen.
        sockets: the interface gloo and NCCL use (default: loopback, one machine).
        secret: the job's secret file.
        private: one machine: the job's private directory, where its control plane and stores are.
        gpus: the node's GPUs, as ``CUDA_VISIBLE_DEVICES`` names them (:func:`visible_gpus`); empty: none.
    """
    env = dict(os.environ if environ is None else environ)
    for name in ("SLURM_STEP_ID", "SLURM_STEPID"):  # the replica's own ddpkit run is one process, not srun's task
        env.pop(name, None)
    env.update(
        {
            ft.LIGHTHOUSE_ENV: lighthouse,
            ft.JOB_STORE_ENV: job,
            ft.REPLICA_ENV: str(index),
            ft.REPLICAS_ENV: str(spec.total),
            ft.MIN_REPLICAS_ENV: str(spec.min_replicas),
            ft.HOST_ENV: host,
            ft.QUORUM_TIMEOUT_ENV: str(spec.quorum_timeout_s),
            ft_heal.SECRET_ENV: secret,
        }
    )
    env.pop(ft_control.CONTROL_ENV, None)
    env.pop(ft.SHARED_GPU_ENV, None)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[(index - spec.node_rank * spec.replicas) % len(gpus)]
        if spec.replicas > len(gpus):
            env[ft.SHARED_GPU_ENV] = f"{spec.replicas}:{len(gpus)}"
    if private:
        env[ft_control.CONTROL_ENV] = private
    env.update(sockets if sockets is not None else {"GLOO_SOCKET_IFNAME": "lo"})
    env.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info
    env.update(launcher_env())  # the replica's own ddpkit run ends when this launcher dies, SIGKILL too
    return env


def run(spec: FaultTolerantSpec) -> int:
    """Start the lighthouse (node 0) and this node's replicas, wait for them; this node's exit code."""
    validate(spec)
    work = stores.private_dir()  # mode 0700: the control plane's socket, the stores, the secret
    lighthouse: subprocess.Popen | None = None
    server: Any = None
    private = ""
    if spec.nnodes == 1:
        host, master_host, master_port = HOST, HOST, 0
        secret = os.path.join(work, "secret")
        ft_heal.write_secret(secret)
        lighthouse, address = start_control_plane(spec.min_replicas, work)
        job = f"file:{os.path.join(work, 'job-store')}"
        private = work
    else:
        secret = os.path.abspath(spec.secret_file or "")
        master_host, master_port = _split_master(spec.master or "")
        if spec.node_rank == 0:
            host = master_host
            lighthouse, address = start_lighthouse(spec.min_replicas, master_host, master_port)
            try:
                server = stores.serve(master_host, master_port + 1, timeout_s=NODE_JOIN_S)
            except BaseException:
                end_lighthouse(lighthouse)
                raise
        else:
            host = local_address(master_host, master_port) or ""
            if not host:
                raise UsageError(f"--master {spec.master}: no route from this host to node 0")
            address = f"http://{host_port(master_host, master_port)}"
        job = f"tcp:{host_port(master_host, master_port + 1)}"
    sockets = stores.socket_env(spec.nnodes, master_host, master_port)
    try:
        store = ft.job_store(job, timeout_s=NODE_JOIN_S)  # other nodes: waits for node 0's
    except (RuntimeError, OSError) as exc:
        if lighthouse is not None:
            end_lighthouse(lighthouse)
        raise UsageError(
            f"ddpkit run: cannot reach the fault-tolerant job's store at {job[4:]} on node 0 "
            f"({ft._first_line(exc)}); start node 0 first, with the same --master"
        ) from None
    replicas: list[subprocess.Popen] = []
    stopping: list[int] = []
    failure: int | None = None

    def forward(signum: int, frame: Any) -> None:
        stopping.append(signum)
        for child in replicas:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {number: signal.signal(number, forward) for number in (signal.SIGTERM, signal.SIGINT)}
    first = spec.node_rank * spec.replicas
    gpus = visible_gpus()
    try:
        replicas = [
            subprocess.Popen(
                replica_command(spec),
                env=replica_env(
                    spec,
                    first + index,
                    address,
                    job,
                    host=host,
                    sockets=sockets,
                    secret=secret,
                    private=private,
                    gpus=gpus,
                ),
            )
            for index in range(spec.replicas)
        ]
        failure = watch(spec, replicas, lighthouse, store)
        if failure is not None:
            return failure  # the replicas are stopped below
        if spec.nnodes > 1 and spec.node_rank != 0:
            with contextlib.suppress(RuntimeError, OSError):  # node 0 ended first: nobody is left to tell
                store.set(f"ddpkit/ft/exit/{spec.node_rank}", "1")
        if server is not None:
            wait_for_nodes(spec, store, lighthouse)
    finally:
        for number, old in previous.items():
            signal.signal(number, old)
        stop_replicas(replicas, at_once=failure == EXIT_MISMATCH)
        shutil.rmtree(work, ignore_errors=True)
        if lighthouse is not None:
            end_lighthouse(lighthouse)
    codes = [child.returncode for child in replicas]
    failed = [(first + index, code) for index, code in enumerate(codes) if code != 0]
    for index, code in failed:
        sys.stderr.write(f"ddpkit run: replica {index} ended with exit code {code}\n")
    if stopping and failed:
        return failed[0][1]
    return 0 if len(failed) < len(codes) else failed[0][1]


__all__ = ["FaultTolerantSpec", "replica_command", "replica_env", "run", "start_lighthouse", "validate"]
