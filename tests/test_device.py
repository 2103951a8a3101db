"""Which device each process gets: choose_device with the GPU count monkeypatched (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from ddpkit.distributed.environment import Environment
from ddpkit.distributed.process_group import choose_backend, choose_device
from ddpkit.errors import DdpkitError


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this process sees ``n`` CUDA GPUs."""

    def visible(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return visible


def _env(local_rank: int, local_world_size: int, own_gpus: bool = False) -> Environment:
    return Environment(
        launcher="slurm",
        rank=local_rank,
        local_rank=local_rank,
        world_size=local_world_size,
        local_world_size=local_world_size,
        own_gpus=own_gpus,
    )


def test_every_process_sees_every_gpu_and_takes_its_local_rank(gpus):
    gpus(4)
    assert [choose_device(_env(r, 4)) for r in range(4)] == [torch.device("cuda", r) for r in range(4)]
    assert choose_device(_env(1, 2), "cuda") == torch.device("cuda", 1)


def test_a_task_bound_to_one_gpu_takes_it_whatever_its_local_rank(gpus):
    """srun --gpus-per-task=1: local rank 3 of 4 sees one GPU, its own, as cuda:0."""
    gpus(1)
    assert [choose_device(_env(r, 4, own_gpus=True)) for r in range(4)] == [torch.device("cuda", 0)] * 4


def test_tasks_bound_to_two_gpus_each_take_one_of_their_own(gpus):
    gpus(2)
    chosen = [choose_device(_env(r, 8, own_gpus=True)).index for r in range(8)]
    assert chosen == [0, 1, 0, 1, 0, 1, 0, 1]


def test_processes_sharing_fewer_gpus_than_they_are_is_refused(gpus):
    gpus(2)
    with pytest.raises(
        DdpkitError,
        match=r"4 processes on this node but only 2 visible GPU\(s\), the same in "
        r"every process, and NCCL cannot run two ranks on one GPU",
    ):
        choose_device(_env(3, 4))
    with pytest.raises(DdpkitError, match="ddpkit run -n 2"):
        choose_device(_env(0, 4), "cuda")


def test_no_gpu_means_the_cpu_unless_cuda_is_asked_for(gpus):
    gpus(0)
    assert choose_device(_env(1, 2)) == torch.device("cpu")
    with pytest.raises(DdpkitError, match="no CUDA GPU is visible"):
        choose_device(_env(0, 1), "cuda")


def test_an_explicit_device_is_taken_as_given(gpus):
    gpus(1)
    assert choose_device(_env(3, 4), "cuda:0") == torch.device("cuda", 0)
    assert choose_device(_env(3, 4), "cpu") == torch.device("cpu")


def test_a_bound_task_under_srun_end_to_end(gpus, monkeypatch):
    """From SLURM's variables to the device: detect() and choose_device() together."""
    from ddpkit.distributed.environment import detect

    gpus(1)
    env = detect(
        {
            "SLURM_PROCID": "7",
            "SLURM_LOCALID": "3",
            "SLURM_NTASKS": "8",
            "SLURM_NODEID": "1",
            "SLURM_STEP_ID": "0",
            "SLURM_JOB_NODELIST": "gpu[1-2]",
            "SLURM_NTASKS_PER_NODE": "4",
            "SLURM_GPUS_PER_TASK": "1",
            "CUDA_VISIBLE_DEVICES": "0",
        }
    )
    device = choose_device(env)
    assert device == torch.device("cuda", 0)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert choose_backend(device) == "nccl"
