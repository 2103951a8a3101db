"""Launcher detection, tested by handing ``detect`` the variables each launcher sets."""

from __future__ import annotations

import pytest

from ddpkit.distributed.environment import Environment, detect
from ddpkit.distributed.slurm_env import expand_nodelist, slurm_port, slurm_tasks_on_node
from ddpkit.errors import DdpkitError


def test_plain_python_is_a_world_of_one():
    env = detect({})
    assert env == Environment()
    assert env.launcher == "none" and env.world_size == 1 and not env.distributed


def test_torchelastic_variables():
    env = detect(
        {
            "RANK": "5",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "8",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "node0",
            "MASTER_PORT": "1234",
            "TORCHELASTIC_RUN_ID": "abc",
        }
    )
    assert (env.launcher, env.rank, env.local_rank, env.world_size) == ("torchelastic", 5, 1, 8)
    assert (env.local_world_size, env.node_rank, env.num_nodes) == (4, 1, 2)
    assert (env.master_addr, env.master_port) == ("node0", 1234)


def test_torchelastic_wins_over_slurm():
    """`ddpkit run` under srun: the agent's variables describe the worker, not SLURM's task."""
    env = detect(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "SLURM_PROCID": "1",
            "SLURM_NTASKS": "2",
            "SLURM_STEP_ID": "0",
        }
    )
    assert env.launcher == "torchelastic" and env.rank == 3


def _slurm(**extra: str) -> dict[str, str]:
    base = {
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_NODEID": "2",
        "SLURM_JOB_NODELIST": "node[01-03,07]",
        "SLURM_TASKS_PER_NODE": "2(x4)",
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_ID": "0",
    }
    base.update(extra)
    return base


def test_slurm_under_srun():
    env = detect(_slurm())
    assert (env.launcher, env.rank, env.local_rank, env.world_size) == ("slurm", 5, 1, 8)
    assert (env.node_rank, env.local_world_size) == (2, 2)
    assert env.master_addr == "node01"
    assert env.master_port == 15000 + 123456 % 20000


def test_slurm_master_port_given_explicitly():
    env = detect(_slurm(MASTER_PORT="40000", MASTER_ADDR="head"))
    assert (env.master_addr, env.master_port) == ("head", 40000)


def test_sbatch_script_without_srun_is_not_a_launch():
    environ = _slurm()
    del environ["SLURM_STEP_ID"]
    assert detect(environ).launcher == "none"


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("gpu5,cpu[1,3]", ["gpu5", "cpu1", "cpu3"]),
        ("rack1-n[1-2].cluster", ["rack1-n1.cluster", "rack1-n2.cluster"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node01]", "node[3-1]", "node[a-b]"])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(DdpkitError, match="node list"):
        expand_nodelist(bad)


def test_slurm_master_is_first_host_of_complex_list():
    env = detect(_slurm(SLURM_JOB_NODELIST="a[1-2]-b[3-4]", SLURM_PROCID="0", SLURM_NODEID="0"))
    assert env.master_addr == "a1-b3"


def test_slurm_tasks_per_node_forms():
    assert slurm_tasks_on_node({"SLURM_TASKS_PER_NODE": "3(x2),1", "SLURM_NODEID": "2"}, 7, 3) == 1
    assert slurm_tasks_on_node({"SLURM_TASKS_PER_NODE": "3(x2),1", "SLURM_NODEID": "1"}, 7, 3) == 3
    assert slurm_tasks_on_node({"SLURM_NTASKS_PER_NODE": "4"}, 8, 2) == 4
    assert slurm_tasks_on_node({}, 8, 2) == 4


def test_slurm_port_ignores_array_suffix():
    assert slurm_port({"SLURM_JOB_ID": "77_3"}) == 15000 + 773 % 20000


@pytest.mark.parametrize(
    "extra, own",
    [
        ({}, False),  # no GPUs asked for
        ({"CUDA_VISIBLE_DEVICES": "0", "SLURM_GPUS_PER_TASK": "1"}, True),  # srun --gpus-per-task=1
        ({"CUDA_VISIBLE_DEVICES": "0", "SLURM_STEP_GPUS": "2,3"}, True),  # --gpu-bind: one of two
        ({"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_STEP_GPUS": "0,1"}, False),  # both tasks see both
        ({"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_JOB_GPUS": "0,1"}, False),
    ],
)
def test_slurm_tasks_with_gpus_of_their_own(extra, own):
    assert detect(_slurm(**extra)).own_gpus is own


def test_torchrun_workers_never_have_gpus_of_their_own():
    """torchrun hands one CUDA_VISIBLE_DEVICES to all its workers: they share what it names."""
    env = detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0"})
    assert env.own_gpus is False


def test_mpi_rank_with_its_own_visible_devices():
    """An MPI wrapper that sets CUDA_VISIBLE_DEVICES per rank gives each its own GPU."""
    base = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert detect({**base, "CUDA_VISIBLE_DEVICES": "1"}).own_gpus is True
    assert detect(base).own_gpus is False


def test_open_mpi():
    env = detect(
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_ADDR": "head",
        }
    )
    assert (env.launcher, env.rank, env.local_rank, env.world_size, env.node_rank) == ("mpi", 3, 1, 4, 1)
    assert env.master_addr == "head"


def test_mpich_and_intel_mpi():
    env = detect({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3"})
    assert (env.launcher, env.rank, env.local_rank, env.world_size) == ("mpi", 2, 2, 3)
    assert env.master_addr == "127.0.0.1"


def test_multi_host_mpi_without_master_is_an_error():
    with pytest.raises(DdpkitError, match="MASTER_ADDR"):
        detect(
            {
                "OMPI_COMM_WORLD_RANK": "0",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            }
        )


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 is outside the world of size 2"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "at least 1"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "not a valid port"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, "4 processes on this node"),
    ],
)
def test_inconsistent_variables_are_clear_errors(environ, message):
    with pytest.raises(DdpkitError, match=message):
        detect(environ)


def test_detect_reads_os_environ(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert detect().rank == 1
