"""BatchNorm statistics synced lazily (ddpkit.parallel.lazy_buffers): no per-step broadcast, parameters as
under DDP's broadcast, cross-rank averages wherever statistics are read or saved, exact resume."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import ddpkit

sys.path.insert(0, str(Path(__file__).parent))
from buffers_workers import train_bn  # noqa: E402

MEAN, VAR = "1.running_mean", "1.running_var"


def _launch(mode, checkpoint="", *, extra_buffer=False, freeze_at=None):
    return ddpkit.launch(train_bn, nprocs=2, args=(mode, checkpoint, 5, False, extra_buffer, freeze_at))


@pytest.mark.slow  # 34 s: make test-slow
@pytest.mark.timeout(300)
def test_statistics_stay_each_ranks_own_and_are_averaged_where_read_or_saved(tmp_path):
    full = _launch("full")
    assert full[0]["lazy"] and full[0]["broadcast"] is False
    own0, own1 = full[0]["own"], full[1]["own"]
    assert not torch.equal(own0[MEAN], own1[MEAN])  # trained apart, never broadcast
    for key in (MEAN, VAR):  # evaluate averaged them first
        assert torch.equal(full[0]["after"][key], (own0[key] + own1[key]) / 2)
        assert torch.equal(full[1]["after"][key], full[0]["after"][key])
    # DDP's broadcast kept (a buffer that is not BatchNorm's): the same parameters and rank 0 statistics
    broadcast = _launch("full", extra_buffer=True)[0]
    assert not broadcast["lazy"] and broadcast["broadcast"] is True
    assert all(torch.equal(broadcast["own"][k], v) for k, v in own0.items())
    # the checkpoint holds the averages (the worker asserts that saving left the live state as it was)
    ckpt = str(tmp_path / "c.pt")
    stop = _launch("stop", ckpt)
    model = ddpkit.checkpoint.read(ckpt)["user"]["model"]
    assert torch.equal(model[MEAN], (stop[0]["own"][MEAN] + stop[1]["own"][MEAN]) / 2)
    resumed = _launch("resume", ckpt)
    for rank in (0, 1):
        assert all(torch.equal(resumed[rank]["own"][k], v) for k, v in full[rank]["own"].items())
        assert all(torch.equal(resumed[rank]["after"][k], v) for k, v in full[rank]["after"].items())


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_run_that_saves_midway_ends_as_one_that_does_not(tmp_path):
    full = _launch("full")
    saved_run = _launch("save", str(tmp_path / "c.pt"))
    for rank in (0, 1):
        assert all(torch.equal(saved_run[rank]["after"][k], v) for k, v in full[rank]["after"].items())


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_layer_frozen_in_eval_mode_reads_averaged_statistics(tmp_path):
    ranks = _launch("full", str(tmp_path / "c.pt"), freeze_at=3)
    before = [ranks[r]["own_before_freeze"] for r in (0, 1)]
    assert not torch.equal(before[0], before[1])
    assert torch.equal(ranks[0]["after_frozen_step"], (before[0] + before[1]) / 2)
    assert torch.equal(ranks[1]["after_frozen_step"], ranks[0]["after_frozen_step"])
    assert torch.equal(ranks[0]["after_one_rank"][MEAN], ranks[1]["after_one_rank"][MEAN])
    assert not torch.equal(ranks[0]["after_one_rank"][MEAN], ranks[0]["after"][MEAN])  # rank 0's forward counted


def test_only_models_whose_buffers_are_all_plain_batchnorm_statistics_sync_lazily():
    from ddpkit.parallel import lazy_buffers

    plain = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Sequential(torch.nn.BatchNorm2d(2)))
    assert [name for name, _ in lazy_buffers.candidates(plain)] == ["1.0"]
    synced = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.SyncBatchNorm(2))
    assert lazy_buffers.candidates(synced) is None
    other = torch.nn.Sequential(torch.nn.BatchNorm1d(2))
    other.register_buffer("mask", torch.ones(2))
    assert lazy_buffers.candidates(other) is None
    assert lazy_buffers.candidates(torch.nn.Linear(2, 2)) is None


def test_a_checkpoints_statistics_from_every_ranks_copies_are_what_agree_and_average_make():
    from ddpkit.parallel import lazy_buffers

    torch.manual_seed(0)
    ranks = []
    for rank in range(2):
        model = torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
        syncer = lazy_buffers.LazyBuffers(lazy_buffers.candidates(model))
        for _, layer in syncer.layers:
            layer.running_mean.normal_()
            layer.running_var.uniform_(1, 2)
        syncer.dirty = {0, 1} if rank == 0 else {1}  # layer 0 trained on rank 0 alone
        ranks.append((syncer, [syncer.captured(), None]))
    own, averages = lazy_buffers.saved([captured for _, captured in ranks])
    for rank, (syncer, _) in enumerate(ranks):
        syncer.dirty = {0, 1}  # what agree() makes of it: the union
        assert own[rank][1] is None
        assert own[rank][0]["dirty"] == [0, 1]
        expected = syncer.state_dict()["values"]
        assert own[rank][0]["values"].keys() == expected.keys()
        assert all(torch.equal(own[rank][0]["values"][k], v) for k, v in expected.items())
    zero, one = ranks[0][0].state_dict()["values"], ranks[1][0].state_dict()["values"]
    assert averages[1] == {}
    assert averages[0].keys() == zero.keys()
    assert all(torch.equal(averages[0][k], (zero[k] + one[k]) / 2) for k in zero)
