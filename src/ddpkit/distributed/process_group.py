"""Init and destroy of the default process group; the backend chosen from the device.

Its barrier, like every other collective, is :func:`ddpkit.distributed.collectives.barrier`.
"""

from __future__ import annotations

import datetime
import errno
import os
import socket

import torch
import torch.distributed as dist

from ddpkit.distributed import host, stores
from ddpkit.distributed.environment import Environment
from ddpkit.errors import DdpkitError, UsageError, warn

BACKENDS = ("nccl", "gloo", "mpi")


def choose_device(env: Environment, device: str | None = None) -> torch.device:
    """The device of this process: its own GPU when CUDA is usable, else the CPU.

    ``device="cuda"`` (or ``"auto"`` with CUDA available) picks the GPU as :func:`_gpu_for`
    explains; ``"cuda:1"``, ``"cpu"`` and the like are taken as given.

    Raises:
        DdpkitError: CUDA asked for but no GPU visible, or more processes on this node than
            GPUs while every process sees all of them.
    """
    if device is not None and device != "auto":
        chosen = torch.device(device)
        if chosen.type == "cuda" and chosen.index is None:
            chosen = torch.device("cuda", _gpu_for(env))
        return chosen
    if torch.cuda.is_available():
        return torch.device("cuda", _gpu_for(env))
    return torch.device("cpu")


def _gpu_for(env: Environment) -> int:
    """The local rank's GPU among those this process sees.

    Usually every process of a node sees every GPU of it, and local rank r takes GPU r. Under
    ``srun --gpus-per-task=1`` (or ``--gpu-bind``) each task sees only its own GPU, as cuda:0,
    while its local rank may be 3: then local rank modulo the visible count is that GPU.
    """
    count = torch.cuda.device_count()
    if count == 0:
        raise DdpkitError("device='cuda' was asked for but no CUDA GPU is visible; use device='cpu'")
    if env.local_world_size <= count:
        return env.local_rank
    if env.own_gpus:
        return env.local_rank % count
    raise DdpkitError(
        f"{env.local_world_size} processes on this node but only {count} visible GPU(s), the same in "
        "every process, and NCCL cannot run two ranks on one GPU: "
        f"start at most {count} processes per node (ddpkit run -n {count}), give each process its "
        "own GPU (srun --gpus-per-task=1), or use device='cpu'"
    )


def choose_backend(device: torch.device, backend: str | None = None) -> str:
    """nccl when each process has its own CUDA device, gloo otherwise; ``backend`` overrides."""
    if backend is not None and backend != "auto":
        if backend not in BACKENDS:
            raise UsageError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if backend == "nccl" and device.type != "cuda":
            raise UsageError("backend 'nccl' needs CUDA devices; use backend='gloo' on the CPU")
        return backend
    if device.type == "cuda" and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def init(env: Environment, backend: str, device: torch.device, timeout_s: float) -> None:
    """Initialise the default process group for ``env`` (no-op when already initialised).

    Args:
        env: this process's place in the job (rank, world size, master address, store).
        backend: ``"nccl"``, ``"gloo"`` or ``"mpi"``, as :func:`choose_backend` settled it.
        device: this process's device (:func:`choose_device`); a GPU becomes the current one.
        timeout_s: seconds to reach the rendezvous, and the timeout of every collective.

    Raises:
        DdpkitError: the master could not be reached within ``timeout_s``, naming host:port.
    """
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {}
    if backend == "nccl":
        # Binds NCCL's communicator to this process's GPU (avoids a guess by rank).
        kwargs["device_id"] = device

    # Before the first group: every group of this process (PowerSGD's, fsdp's mesh) binds there too.
    os.environ.update(stores.socket_env(env.num_nodes, env.master_addr, env.master_port))
    store = _store_of_this_group(env, timeout_s)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )


def _store_of_this_group(env: Environment, timeout_s: float) -> dist.Store:
    """The store this default group meets in. A launcher's (its agent's, or a file of ``ddpkit run``'s)
    outlives a group, so a later group of this process (``ddpkit.init`` after ``rt.close``) meets in keys of
    its own there: the first one's peer addresses were read again and the ranks hung. Rank 0's own server
    is kept for the later groups too: a new one found its port still taken."""
    key = (env.store_dir, env.restart_count, env.master_addr, env.master_port, env.rank, env.run_id)
    if key not in _STORES:
        _STORES[key] = _store(env, timeout_s)
    else:
        _STORES[key].set_timeout(datetime.timedelta(seconds=timeout_s))  # this init's, not the first one's
    _JOINS[key] = joins = _JOINS.get(key, -1) + 1
    return dist.PrefixStore(f"join{joins}/", _STORES[key]) if joins else _STORES[key]


_STORES: dict[tuple[object, ...], dist.Store] = {}
"""The rendezvous store of each place this process joined a job at (rank 0's server kept alive)."""

_JOINS: dict[tuple[object, ...], int] = {}
"""How many default groups this process made there before the newest (``ddpkit.init`` after ``rt.close``)."""


def _store(env: Environment, timeout_s: float) -> dist.Store:
    """The rendezvous store, scoped to this attempt of this run.

    A one-machine job of ``ddpkit run`` or ``ddpkit.launch`` keeps it in a file of the job's
    private directory, one file per attempt (:func:`ddpkit.distributed.stores.worker_store`): nothing listens.
    Under the elastic agent on one node the agent hosts the store and it outlives a restart;
    without a prefix per attempt, restarted workers read the previous attempt's peer addresses
    and hang or fail connecting to dead processes. Elsewhere (``ddpkit run`` on several nodes,
    srun, mpirun, by hand) rank 0 hosts a store of its own.
    """
    if env.store_dir:  # one machine under ddpkit run / launch: a file only this user can open
        return dist.PrefixStore(f"ddpkit/{env.run_id or 'run'}/", stores.worker_store(env.store_dir, env.restart_count))
    host_store = not env.agent_store and env.rank == 0
    try:
        store = _serve(env, timeout_s) if host_store else _tcp_store(env, timeout_s, is_master=False)
    except UsageError:  # a ValueError too: the port taken, said as it is
        raise
    except (RuntimeError, TimeoutError, ValueError, OSError) as exc:
        if "address already in use" in str(exc).lower():
            if env.launcher == "torchelastic":  # the agent picked the port free, then let it go
                raise DdpkitError(
                    f"port {env.master_port} on {env.master_addr}, which the launcher picked for rank 0's "
                    "store, was taken by another process before rank 0 could bind it: a process on this node "
                    "holds ports it does not own; with --max-restarts the next attempt gets another port"
                ) from None
            raise UsageError(
                f"port {env.master_port} on {env.master_addr} is already in use, so rank 0 cannot host "
                "the rendezvous: choose another MASTER_PORT"
            ) from None
        raise DdpkitError(
            f"could not reach the master at {env.master_addr}:{env.master_port} within "
            f"{timeout_s:g}s (rank {env.rank} of {env.world_size}): check that rank 0 is "
            "running, that the host name resolves here, that the port is open in the "
            "firewall, and that every node uses the same master address and port"
        ) from None
    # The agent's store outlives restarts (one node: its restart count is the attempt). A store
    # that rank 0 hosts is new for every attempt, and nodes may count their restarts differently.
    attempt = f"attempt{env.restart_count}/" if env.agent_store else ""
    return dist.PrefixStore(f"ddpkit/{env.run_id or 'run'}/{attempt}", store)


def _serve(env: Environment, timeout_s: float) -> dist.Store:
    """Rank 0's store, listening on the master address only (loopback on one machine).

    A master address that is not one of this machine's (a name resolving elsewhere, say) cannot
    be bound; the store then listens on every interface, as torch's own would, with a warning.
    So does a job of several nodes whose master name resolves to loopback here (``/etc/hosts``
    often maps a machine's own name to 127.0.1.1) while the other nodes resolve it to this
    node's network address.
    """
    if env.num_nodes > 1 and host.is_loopback(env.master_addr):
        return _tcp_store(env, timeout_s, is_master=True)
    try:
        return stores.serve(env.master_addr, env.master_port, timeout_s=timeout_s, world_size=env.world_size)
    except OSError as exc:
        if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
            warn(
                f"MASTER_ADDR {env.master_addr} is not an address of this machine, so rank 0's "
                f"store listens on every interface ({exc.strerror or exc}); set MASTER_ADDR to "
                "this machine's address on the network the job uses"
            )
            return _tcp_store(env, timeout_s, is_master=True)
        raise


def _tcp_store(env: Environment, timeout_s: float, *, is_master: bool) -> dist.Store:
    """torch's own ``TCPStore`` at the master: a client, or a server on every interface."""
    return dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=is_master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def destroy() -> None:
    """Destroy the default process group if one exists."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
