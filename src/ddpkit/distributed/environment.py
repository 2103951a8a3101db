"""Which launcher started us, and our place in the world.

This is the only module that reads launcher variables (SLURM's host lists and task counts through
:mod:`ddpkit.distributed.slurm_env`). Everything else receives an :class:`Environment`, so configuration
flows explicitly from here.

Launchers are tried in order: torchrun / TorchElastic, SLURM (under ``srun``), MPI
(Open MPI, MPICH, Intel MPI), and finally none — a plain ``python script.py`` is a world
of one.

Example:
    >>> env = detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
    ...               "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    >>> env.launcher, env.rank, env.world_size
    ('torchelastic', 1, 2)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from ddpkit.distributed._vars import read_int as _int
from ddpkit.distributed._vars import read_list
from ddpkit.distributed._vars import read_port as _port
from ddpkit.distributed.slurm_env import expand_nodelist, slurm_port, slurm_tasks_on_node
from ddpkit.errors import UsageError

DEFAULT_MASTER_PORT = 29500

STORE_DIR_ENV = "DDPKIT_STORE_DIR"
"""Set by ``ddpkit run`` and :func:`ddpkit.launch` for the workers of a one-machine job: the
private directory that holds the job's stores (:func:`ddpkit.distributed.stores.private_dir`)."""


@dataclass(frozen=True)
class Environment:
    """Our place in the world, as told by the launcher.

    Attributes:
        launcher: ``"torchelastic"``, ``"slurm"``, ``"mpi"`` or ``"none"``.
        rank: global rank of this process.
        local_rank: rank of this process on its node.
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        node_rank: index of this node.
        master_addr: host of the rendezvous store (rank 0's host).
        master_port: port of the rendezvous store.
        run_id: the launcher's job id (TorchElastic run id), if any.
        restart_count: how often the elastic agent restarted the group before this attempt.
        max_restarts: how often it may (``--max-restarts``), where it says; None: it does not.
        agent_store: the elastic agent hosts the store at master_addr:master_port.
        store_dir: the private directory of a one-machine ``ddpkit run`` / ``ddpkit.launch`` job,
            which holds its stores as files (empty: the stores are sockets).
        own_gpus: the launcher showed this process GPUs its node-mates do not see (``srun
            --gpus-per-task=1``, ``--gpu-bind``), so local rank 3 may see one GPU, its own.
    """

    launcher: str = "none"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    run_id: str = ""
    restart_count: int = 0
    max_restarts: int | None = None
    agent_store: bool = False
    own_gpus: bool = False
    store_dir: str = ""

    @property
    def distributed(self) -> bool:
        """True when a launcher started us, so a process group is expected."""
        return self.launcher != "none"

    @property
    def num_nodes(self) -> int:
        """Nodes in the job: the world divided by the processes of this node (at least 1)."""
        return max(1, self.world_size // max(1, self.local_world_size))


def detect(environ: Mapping[str, str] | None = None) -> Environment:
    """Return the :class:`Environment` of the launcher that started this process.

    Args:
        environ: variables to read; ``os.environ`` when omitted (tests pass a dict).

    Raises:
        DdpkitError: the variables are present but inconsistent (rank outside the world,
            a port that is not a number, ...).
    """
    environ = os.environ if environ is None else environ
    for probe in _PROBES:
        env = probe(environ)
        if env is not None:
            _validate(env)
            return replace(env, own_gpus=_own_gpus(env.launcher, environ))
    return Environment()


_TORCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def _from_torchelastic(environ: Mapping[str, str]) -> Environment | None:
    present = [name for name in _TORCH_NAMES if name in environ]
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        if present:
            missing = [name for name in ("RANK", "WORLD_SIZE") if name not in environ]
            raise UsageError(
                f"{', '.join(present)} set but {' and '.join(missing)} missing: start the script with "
                "ddpkit run / torchrun, or set RANK and WORLD_SIZE together (or neither, for one process)"
            )
        return None
    world_size = _int(environ, "WORLD_SIZE")
    local_world_size = _int(environ, "LOCAL_WORLD_SIZE", world_size)
    rank = _int(environ, "RANK")
    return Environment(
        launcher="torchelastic",
        rank=rank,
        local_rank=_int(environ, "LOCAL_RANK", rank % max(1, local_world_size)),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=_int(environ, "GROUP_RANK", rank // max(1, local_world_size)),
        master_addr=environ.get("MASTER_ADDR") or "127.0.0.1",
        master_port=_port(environ, "MASTER_PORT", DEFAULT_MASTER_PORT),
        run_id=environ.get("TORCHELASTIC_RUN_ID", ""),
        restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT", 0),
        max_restarts=int(allowed) if (allowed := environ.get("TORCHELASTIC_MAX_RESTARTS", "")).isdigit() else None,
        agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        store_dir=environ.get(STORE_DIR_ENV, ""),
    )


def _from_slurm(environ: Mapping[str, str]) -> Environment | None:
    # SLURM_PROCID alone is also set inside an sbatch script; a task started by srun has a
    # step id. Interactive allocations ("salloc") name the job "interactive" or "bash".
    if "SLURM_PROCID" not in environ or "SLURM_NTASKS" not in environ:
        return None
    if "SLURM_STEP_ID" not in environ and "SLURM_STEPID" not in environ:
        return None
    world_size = _int(environ, "SLURM_NTASKS")
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
    hosts = expand_nodelist(nodelist) if nodelist else ["127.0.0.1"]
    local_world_size = slurm_tasks_on_node(environ, world_size, len(hosts))
    return Environment(
        launcher="slurm",
        rank=_int(environ, "SLURM_PROCID"),
        local_rank=_int(environ, "SLURM_LOCALID", 0),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=_int(environ, "SLURM_NODEID", 0),
        master_addr=environ.get("MASTER_ADDR") or hosts[0],
        master_port=_port(environ, "MASTER_PORT", slurm_port(environ)),
    )


def _from_mpi(environ: Mapping[str, str]) -> Environment | None:
    if "OMPI_COMM_WORLD_RANK" in environ:
        rank = _int(environ, "OMPI_COMM_WORLD_RANK")
        world_size = _int(environ, "OMPI_COMM_WORLD_SIZE")
        local_rank = _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", 0)
        local_world_size = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", world_size)
        node_rank = _int(environ, "OMPI_COMM_WORLD_NODE_RANK", rank // max(1, local_world_size))
    elif "PMI_RANK" in environ:
        rank = _int(environ, "PMI_RANK")
        world_size = _int(environ, "PMI_SIZE")
        local_rank = _int(environ, "MPI_LOCALRANKID", _int(environ, "PMI_LOCAL_RANK", 0))
        local_world_size = _int(environ, "MPI_LOCALNRANKS", _int(environ, "PMI_LOCAL_SIZE", world_size))
        node_rank = rank // max(1, local_world_size)
    else:
        return None
    master_addr = environ.get("MASTER_ADDR")
    if not master_addr:
        if local_world_size < world_size:
            raise UsageError(
                "MPI started processes on several hosts but MASTER_ADDR is not set; "
                "export MASTER_ADDR=<host of rank 0> (and MASTER_PORT) before mpirun"
            )
        master_addr = "127.0.0.1"
    return Environment(
        launcher="mpi",
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=_port(environ, "MASTER_PORT", DEFAULT_MASTER_PORT),
    )


def _own_gpus(launcher: str, environ: Mapping[str, str]) -> bool:
    """Whether this process sees GPUs of its own rather than every GPU of its node.

    Per-process visibility can only come from a launcher that starts each process itself:
    SLURM binds GPUs per task by giving each task its own ``CUDA_VISIBLE_DEVICES``, and MPI
    sites often wrap each rank in a script that does the same. torchrun cannot (its workers
    inherit one ``CUDA_VISIBLE_DEVICES``), and without the variable every process sees every GPU.
    """
    visible = read_list(environ, "CUDA_VISIBLE_DEVICES")
    if launcher not in ("slurm", "mpi") or not visible:
        return False
    if launcher == "slurm" and not environ.get("SLURM_GPUS_PER_TASK"):
        # Without per-task binding every task of the step sees the node's whole allocation.
        allocated = read_list(environ, "SLURM_STEP_GPUS") or read_list(environ, "SLURM_JOB_GPUS")
        if allocated:
            return len(visible) < len(allocated)
    return True


_PROBES: tuple[Callable[[Mapping[str, str]], Environment | None], ...] = (
    _from_torchelastic,
    _from_slurm,
    _from_mpi,
)


def _validate(env: Environment) -> None:
    if env.world_size < 1:
        raise UsageError(f"{env.launcher}: world size {env.world_size} must be at least 1")
    if not 0 <= env.rank < env.world_size:
        raise UsageError(
            f"{env.launcher}: rank {env.rank} is outside the world of size {env.world_size}; "
            "check that every process was started with the same world size"
        )
    if not 0 <= env.local_rank < env.local_world_size:
        raise UsageError(
            f"{env.launcher}: local rank {env.local_rank} is outside the {env.local_world_size} processes of this node"
        )
    if env.local_world_size > env.world_size:
        raise UsageError(
            f"{env.launcher}: {env.local_world_size} processes on this node but a world of only {env.world_size}"
        )
