"""Copies of the set-up model that scripts keep: the best epoch's (``copy.deepcopy``), SWA's
(``AveragedModel`` and ``update_bn``) and an EMA of ``model.module`` with its buffers. A copy of a
SyncBatchNorm model could not be made (its process group cannot be copied); under DDP each rank's
copy held its own BatchNorm statistics, so ``ddpkit.evaluate`` mixed two models and the checkpoint
kept rank 0's; under micro-shards ``update_bn`` was refused with a message about another loop."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import ddpkit
import workers
from ddpkit.parallel import lazy_buffers
from ddpkit.parallel.sync_batchnorm import SyncBatchNorm

COPIES = ("best", "swa", "ema")


def _same_on_every_rank(runs: dict) -> None:
    for name in COPIES:
        for rank, found in runs.items():
            assert found[name]["accuracy"] == runs[0][name]["accuracy"], (name, rank)
            for key, value in runs[0][name]["state"].items():
                assert torch.equal(found[name]["state"][key], value), (name, key, rank)


def _close(found: dict, expected: dict, *, bitwise: bool) -> None:
    for name in COPIES:
        assert found[name]["accuracy"] == expected[name]["accuracy"], name
        assert found[name]["state"].keys() == expected[name]["state"].keys(), name
        for key, value in expected[name]["state"].items():
            if bitwise:
                assert torch.equal(found[name]["state"][key], value), (name, key)
            else:
                torch.testing.assert_close(found[name]["state"][key], value, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(120)
def test_copies_of_a_synced_batchnorm_model_are_one_process_copies():
    runs = ddpkit.launch(workers.model_copies, nprocs=2, args=({"sync_batchnorm": True},))
    _same_on_every_rank(runs)
    _close(runs[0], workers.model_copies({"sync_batchnorm": True}), bitwise=False)  # float64: rounding only


@pytest.mark.timeout(180)
def test_copies_under_ddp_are_one_model_on_every_rank_and_resume_exactly(tmp_path):
    whole = ddpkit.launch(workers.model_copies, nprocs=2, args=({}, str(tmp_path / "whole")))
    _same_on_every_rank(whole)  # each rank's statistics trained apart: the copies hold their average
    saved = torch.load(sorted((tmp_path / "whole").glob("ckpt-*.pt"))[-1], weights_only=True)
    for key, value in saved["ema"].items():  # the checkpoint's EMA is the one every rank holds, not rank 0's own
        if torch.is_tensor(value):
            assert torch.equal(value, whole[1]["ema"]["state"][key.removeprefix("module.")]), key
    where = str(tmp_path / "stopped")
    ddpkit.launch(workers.model_copies, nprocs=2, args=({}, where, 1))
    resumed = ddpkit.launch(workers.model_copies, nprocs=2, args=({}, where))
    _same_on_every_rank(resumed)
    for name in ("swa", "ema"):  # the best epoch's copy lives outside the checkpoint
        for key, value in whole[0][name]["state"].items():
            assert torch.equal(resumed[0][name]["state"][key], value), (name, key)


@pytest.mark.timeout(120)
def test_copies_under_micro_shards_end_at_one_process_bits_and_update_bn_is_named():
    runs = ddpkit.launch(workers.model_copies, nprocs=2, args=({"micro_shards": 2},))
    one = workers.model_copies({"micro_shards": 2})
    _same_on_every_rank(runs)
    _close(runs[0], one, bitwise=True)
    for found in (*runs.values(), one):  # the same refusal on any world size, naming what to use instead
        assert "a copy of it (AveragedModel, copy.deepcopy) ran in training mode" in found["update_bn"]
        assert "AveragedModel(model, use_buffers=True)" in found["update_bn"]


class _Wrapper(torch.nn.Module):
    """DDP's shape for :func:`lazy_buffers.install`: the model as ``.module``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_a_copy_of_a_lazily_averaged_model_gets_a_syncer_of_its_own_layers():
    inner = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4), torch.nn.BatchNorm1d(4))
    wrapped = _Wrapper(inner)
    candidates = lazy_buffers.candidates(inner)
    assert candidates is not None
    syncer = lazy_buffers.install(wrapped, candidates)  # type: ignore[arg-type]
    for held in (copy.deepcopy(wrapped), copy.deepcopy(inner)):
        found = lazy_buffers.of(held)
        assert found is not None and found is not syncer and found.copied and not syncer.copied
        layers = [m for m in held.modules() if isinstance(m, torch.nn.BatchNorm1d)]
        assert [layer for _, layer in found.layers] == layers
        held.train()(torch.randn(3, 2))  # the copy's forward marks the copy's layers, not the model's
        assert found.dirty == {0, 1} and syncer.dirty == set()
    assert lazy_buffers.of(wrapped) is syncer


def test_a_copy_of_syncbatchnorm_shares_its_process_group():
    group = object()  # a process group cannot be copied: a copy would raise as ProcessGroup does
    layer = SyncBatchNorm(4, process_group=group)
    held = copy.deepcopy(torch.nn.Sequential(layer))[0]
    assert isinstance(held, SyncBatchNorm) and held is not layer
    assert held.process_group is group
    assert held.running_mean is not layer.running_mean and torch.equal(held.running_mean, layer.running_mean)
    assert not dist.is_initialized()


def test_a_copy_thrown_away_is_freed():
    """The best epoch's copy is replaced each time the accuracy improves: the syncers' registry must
    not keep the old ones alive (its values hold the layers it is keyed by)."""
    import gc
    import weakref

    inner = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4))
    wrapped = _Wrapper(inner)
    candidates = lazy_buffers.candidates(inner)
    assert candidates is not None
    lazy_buffers.install(wrapped, candidates)  # type: ignore[arg-type]
    held = copy.deepcopy(wrapped)
    gone = weakref.ref(held)
    layer = weakref.ref(held.module[1])
    assert lazy_buffers.of(held) is not None
    del held
    gc.collect()
    assert gone() is None and layer() is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch_size", [pytest.param(16, marks=pytest.mark.slow), 64])  # 64: a rank holds none
def test_copies_whose_forwards_meet_evaluate_where_ranks_hold_different_numbers_of_batches(batch_size):
    """Each rank evaluates whole batches, so their counts differ; a copy whose every forward ran a
    collective (DDP's broadcast of buffers inside an ``AveragedModel``, lazily synced statistics)
    left the rank with more batches waiting, or gloo aborting with "Received data size doesn't match"."""
    one = workers.copies_on_uneven_ranks(batch_size)
    two = ddpkit.launch(workers.copies_on_uneven_ranks, nprocs=2, args=(batch_size,))
    for name in ("broadcasting", "lazy"):
        assert two[0][name]["metrics"] == two[1][name]["metrics"] and two[0][name]["metrics"]["count"] == 40
        assert two[0][name]["predicted"].shape == (40, 3) and two[1][name]["predicted"] is None
        assert one[name]["metrics"]["count"] == 40
