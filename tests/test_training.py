"""Training with real gloo processes: world-size invariance and bitwise exact resume."""

from __future__ import annotations

import pytest
import torch

import ddpkit

import workers


def _relative(a: dict, b: dict) -> float:
    flat_a = torch.cat([v.double().flatten() for k, v in sorted(a.items()) if v.is_floating_point()])
    flat_b = torch.cat([v.double().flatten() for k, v in sorted(b.items()) if v.is_floating_point()])
    return float((flat_a - flat_b).norm() / flat_a.norm())


@pytest.mark.timeout(300)
def test_same_samples_and_weights_for_1_2_3_processes():
    # 100 samples, global batch 12: 9 steps an epoch, the last one of 4 samples (2/1/1 on 3 ranks).
    runs = {world: ddpkit.launch(workers.train_steps, nprocs=world, args=(50,))[0] for world in (1, 2, 3)}
    reference = runs[1]
    assert reference["epoch"] == 5                                    # crossed five epoch boundaries
    for world in (2, 3):
        assert runs[world]["visited"] == reference["visited"], f"world {world} visited other samples"
        assert _relative(runs[world]["weights"], reference["weights"]) <= 1e-5
        for name, value in reference["weights"].items():   # every tensor on its own, too
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
def test_resumed_run_ends_with_bitwise_equal_weights(tmp_path):
    (tmp_path / "none").mkdir()
    uninterrupted = ddpkit.launch(workers.resumable_run, nprocs=2, args=(20, None, str(tmp_path / "none")))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    stopped = ddpkit.launch(workers.resumable_run, nprocs=2, args=(20, 11, str(ckpt)))
    assert stopped[0] == {"stopped": 11}
    assert sorted(p.name for p in ckpt.iterdir()) == ["ckpt-step00000011.pt", "ckpt-step00000011.pt.sha256"]
    resumed = ddpkit.launch(workers.resumable_run, nprocs=2, args=(20, None, str(ckpt)))
    assert resumed[0]["step"] == uninterrupted[0]["step"] == 20
    assert resumed[0]["note"] == "plain values survive too"
    for name, value in uninterrupted[0]["weights"].items():
        assert torch.equal(resumed[0]["weights"][name], value), name
