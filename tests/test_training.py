"""Training with real gloo processes: world-size invariance and bitwise exact resume."""

from __future__ import annotations

import pytest
import torch

import ddpkit
import workers
from ddpkit.distributed import collectives
from ddpkit.errors import DdpkitError


def _relative(a: dict, b: dict) -> float:
    flat_a = torch.cat([v.double().flatten() for k, v in sorted(a.items()) if v.is_floating_point()])
    flat_b = torch.cat([v.double().flatten() for k, v in sorted(b.items()) if v.is_floating_point()])
    return float((flat_a - flat_b).norm() / flat_a.norm())


@pytest.mark.timeout(300)
def test_same_samples_and_weights_for_1_2_3_processes():
    # 100 samples, global batch 12: 9 steps an epoch, the last one of 4 samples (2/1/1 on 3 ranks).
    runs = {world: ddpkit.launch(workers.train_steps, nprocs=world, args=(50,))[0] for world in (1, 2, 3)}
    reference = runs[1]
    assert reference["epoch"] == 5  # crossed five epoch boundaries
    for world in (2, 3):
        assert runs[world]["visited"] == reference["visited"], f"world {world} visited other samples"
        assert _relative(runs[world]["weights"], reference["weights"]) <= 1e-5
        for name, value in reference["weights"].items():  # every tensor on its own, too
            if value.is_floating_point():
                assert _relative({name: runs[world]["weights"][name]}, {name: value}) <= 1e-5, name
            else:
                assert torch.equal(runs[world]["weights"][name], value), name
    # every epoch's steps cover every sample once: set_epoch happened without the user
    first_epoch = [i for step in reference["visited"][:9] for i in step]
    second_epoch = [i for step in reference["visited"][9:18] for i in step]
    assert sorted(first_epoch) == sorted(second_epoch) == list(range(100))
    assert reference["visited"][:9] != reference["visited"][9:18]


@pytest.mark.timeout(300)
# 4: a ring allreduce rounds by bucket layout (2 commutes); 32 s, in make test-slow
@pytest.mark.parametrize("nprocs", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_resumed_run_ends_with_bitwise_equal_weights(tmp_path, nprocs, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (tmp_path / "none").mkdir()
    uninterrupted = ddpkit.launch(workers.resumable_run, nprocs=nprocs, args=(20, None, str(tmp_path / "none")))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    stopped = ddpkit.launch(workers.resumable_run, nprocs=nprocs, args=(20, 11, str(ckpt)))
    assert stopped[0] == {"stopped": 11}
    assert sorted(p.name for p in ckpt.iterdir()) == ["ckpt-step00000011.pt", "ckpt-step00000011.pt.sha256"]
    resumed = ddpkit.launch(workers.resumable_run, nprocs=nprocs, args=(20, None, str(ckpt)))
    assert resumed[0]["step"] == uninterrupted[0]["step"] == 20
    assert resumed[0]["note"] == "plain values survive too"
    for name, value in uninterrupted[0]["weights"].items():
        assert torch.equal(resumed[0]["weights"][name], value), name


@pytest.mark.timeout(120)
def test_every_rank_resumes_from_the_checkpoint_rank_zero_chose(tmp_path):
    """As on node-local disks: rank 1's own checkpoint_dir is empty; it must not start afresh."""
    shared, empty = tmp_path / "rank0", tmp_path / "rank1"
    empty.mkdir()
    rt = ddpkit.init(checkpoint_dir=shared)
    rt.global_step = 3
    rt.checkpoint({"model": torch.nn.Linear(4, 2)})
    rt.close()
    steps = ddpkit.launch(workers.resume_auto_step, nprocs=2, args=([str(shared), str(empty)],))
    assert steps == {0: 3, 1: 3}


def test_a_checkpoint_this_rank_cannot_read_is_a_clear_error(tmp_path, monkeypatch):
    rt = ddpkit.init(checkpoint_dir=tmp_path, resume="auto")
    monkeypatch.setattr(collectives, "broadcast_object", lambda obj, src=0: str(tmp_path / "elsewhere.pt"))
    with pytest.raises(
        DdpkitError,
        match=r"rank 0 resumes from .*elsewhere\.pt, which rank 0 cannot read on "
        r".*: put checkpoint_dir on a filesystem every node shares",
    ):
        rt.resume({"model": torch.nn.Linear(4, 2)})


@pytest.mark.timeout(120)
def test_accumulating_two_batches_on_two_ranks_equals_one_big_batch():
    """Under DDP (no_sync on the inner micro-step), ranks and micro-steps weigh as one big batch."""
    accumulated = ddpkit.launch(workers.accumulated_run, nprocs=2, args=(2, 4))[0]
    big_batch = workers.accumulated_run(1, 8)
    assert accumulated["steps"] == big_batch["steps"] == 6  # 8, 8, 2 samples per step, twice
    for name, value in big_batch["weights"].items():
        assert torch.allclose(accumulated["weights"][name], value, atol=1e-6), name


@pytest.mark.timeout(120)
def test_accumulation_allreduces_once_per_group():
    """DDP no_sync on the inner micro-steps: 8 batches in groups of 4 are 2 allreduce rounds, not 8.

    The pass with groups of 1 shows the counting hook sees every round DDP makes.
    """
    runs = ddpkit.launch(workers.accumulation_allreduces, nprocs=2, args=([4, 1], 8))
    for rank, passes in runs.items():
        for run, (steps, rounds) in zip(passes, [(2, 2), (8, 8)]):
            buckets = run["buckets"]
            assert run["steps"] == steps, (rank, run)
            assert buckets.count(0) == rounds, (rank, buckets)  # one round per group
            assert len(buckets) == rounds * len(set(buckets)), (rank, buckets)  # every bucket each round


@pytest.mark.timeout(120)
def test_rt_setup_settles_buckets_last_layers_first_and_keeps_them():
    """Overlap under exact resume: the first bucket reduced holds the last layer, never the first,
    and the layout of step 1 is that of step 2 (no re-bucketing after the first backward)."""
    first, second = ddpkit.launch(workers.ddpkit_bucket_layout, nprocs=2)[0]
    assert first == second
    assert "0.weight" not in first[0] and "4.weight" in first[0], first
    assert first[-1] == ["0.bias", "0.weight"]
