"""Batches as loops make them: a ``collate_fn`` that returns a namedtuple or a dataclass, and loaders
handed to ``ddpkit.evaluate`` / ``ddpkit.predict`` in place of their datasets. ``rt.shards`` rebuilt a
namedtuple from one generator (a traceback on 2 processes) and gave every micro-shard a dataclass whole
(1 and 2 processes apart); ``evaluate(model, loader)`` indexed the loader ("not subscriptable")."""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar

import numpy as np
import pytest
import torch

import ddpkit
import workers
from ddpkit.errors import UsageError
from ddpkit.loop.batch import concat_batches, map_tensors, to_device, zero_rows
from ddpkit.parallel.exact_tree import _cut_alike, _take


def test_a_namedtuple_and_a_dataclass_are_cut_moved_and_joined_in_their_type():
    pair = workers.PairBatch(torch.arange(8).view(4, 2), torch.arange(4))
    cut = _take(pair, 1, 2)
    assert type(cut) is workers.PairBatch and cut.y.tolist() == [1, 3] and cut.x.tolist() == [[2, 3], [6, 7]]
    assert type(map_tensors(lambda t: t + 1, pair)) is workers.PairBatch
    joined = concat_batches([pair, pair])
    assert type(joined) is workers.PairBatch and joined.y.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    made = workers.ClassBatch(torch.arange(6).view(3, 2), torch.arange(3), source="val")
    half = _take(made, 0, 2)
    assert type(half) is workers.ClassBatch and half.y.tolist() == [0, 2] and half.source == "val"
    padded = [
        workers.ClassBatch(torch.zeros(2, 5), torch.zeros(2)),
        workers.ClassBatch(torch.zeros(1, 3), torch.zeros(1)),
    ]
    assert not _cut_alike(made, padded) and _cut_alike(made, [_take(made, j, 2) for j in (0, 1)])


def test_a_dataclass_batch_is_moved_and_joined_field_by_field_in_its_type():
    made = workers.ClassBatch(torch.arange(6.0).view(3, 2), torch.arange(3), source="val")
    moved = to_device(made, torch.device("meta"))  # where a GPU would take it: every tensor field goes
    assert type(moved) is workers.ClassBatch and moved.x.is_meta and moved.y.is_meta and moved.source == "val"
    doubled = map_tensors(lambda t: t * 2, made)
    assert doubled.x.tolist() == [[0, 2], [4, 6], [8, 10]] and made.x[1, 0] == 2  # a new batch, not the old
    joined = concat_batches([made, workers.ClassBatch(torch.ones(1, 2), torch.tensor([7]), source="val")])
    assert type(joined) is workers.ClassBatch and joined.y.tolist() == [0, 1, 2, 7] and joined.x.shape == (4, 2)
    with pytest.raises(TypeError, match="str"):  # strict: a leaf that is not a tensor
        map_tensors(lambda t: t, made, strict=True)
    assert zero_rows(made).x.shape == (0, 2)

    @dataclasses.dataclass
    class Scaled:  # an InitVar that dataclasses.replace cannot give again: copied, its fields set
        x: torch.Tensor
        scale: InitVar[float]

        def __post_init__(self, scale: float) -> None:
            self.x = self.x * scale

    moved = to_device(Scaled(torch.ones(2), 3.0), torch.device("meta"))
    assert type(moved) is Scaled and moved.x.is_meta
    assert concat_batches([Scaled(torch.ones(2), 3.0)] * 2).x.tolist() == [3.0] * 4  # scaled once, not again


def test_an_object_whose_tensors_rt_shards_cannot_see_is_refused_in_one_line():
    class Batch:  # a class of the script's own, neither a dataclass nor a mapping
        def __init__(self) -> None:
            self.x, self.y = torch.zeros(4, 2), torch.zeros(4)

    with pytest.raises(UsageError, match=r"rt.shards cannot cut a Batch .* rt.shards\(batch.x, batch.y\)"):
        _take(Batch(), 0, 2)
    assert _take("a name for the batch", 0, 2) == "a name for the batch"  # the whole batch's: every shard's


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "kind", ["namedtuple", pytest.param("dataclass", marks=pytest.mark.slow)]
)  # (dataclass: make test-slow)
def test_namedtuple_and_dataclass_batches_end_at_the_same_bits_on_one_and_two_processes(kind):
    one = workers.batch_kinds(kind)
    two = ddpkit.launch(workers.batch_kinds, nprocs=2, args=(kind,))[0]
    assert all(torch.equal(value, two["state"][key]) for key, value in one["state"].items())
    assert one["metrics"] == two["metrics"] and one["metrics"]["count"] == 30  # the loss's last bit too
    assert torch.equal(one["predicted"], two["predicted"]) and len(one["predicted"]) == 30


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 4)).double().eval()


def test_evaluate_and_predict_read_a_loaders_dataset_every_sample_once_in_dataset_order(tmp_path):
    data = workers._pair_data(30)
    model = _model()
    rt = ddpkit.init(seed=0)
    try:
        made = rt.loader(data, global_batch_size=7, shuffle=True, drop_last=True, collate_fn=workers.collate_pairs)
        plain = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, drop_last=True)
        for loader, batch in ((made, 7), (plain, 4)):  # its batch a rank: the sums of the loss alike
            expected = ddpkit.evaluate(model, data, num_classes=4, batch_size=batch)
            assert ddpkit.evaluate(model, loader, num_classes=4) == expected  # every sample, its last too
            in_order = ddpkit.predict(model, data, batch_size=batch)
            assert torch.equal(ddpkit.predict(model, loader), in_order)  # the dataset's order, not the loader's
        written = ddpkit.predict_to_file(model, made, tmp_path / "p.npy")  # with the loader's collate_fn
        assert written is not None and np.array_equal(np.load(written), in_order.numpy())
    finally:
        rt.close()


def test_a_loader_that_reads_a_part_of_its_dataset_is_refused_in_one_line():
    data = workers._pair_data(30)
    rt = ddpkit.init(seed=0)
    try:
        part = torch.utils.data.DataLoader(data, batch_size=4, sampler=torch.utils.data.SubsetRandomSampler(range(10)))
        weighted = rt.loader(data, global_batch_size=4, weights=[1.0] * 30)
        unbatched = torch.utils.data.DataLoader(data, batch_size=None)
        drawn = torch.utils.data.DataLoader(data, batch_size=4, sampler=torch.utils.data.RandomSampler(data, True))
        bucketed = torch.utils.data.DataLoader(data, batch_sampler=[[0, 1], [2, 3]])  # a batch sampler of its own
        for loader, says in (
            (part, "reads the samples its SubsetRandomSampler picks, not every sample once"),
            (bucketed, "reads the batches its list makes, which may leave samples out"),
            (weighted, "this rt.loader draws samples by weight"),
            (unbatched, "does not batch"),
            (drawn, "reads the samples its RandomSampler picks"),
        ):
            with pytest.raises(UsageError, match=says) as raised:
                ddpkit.evaluate(_model(), loader, num_classes=4)
            assert "pass ddpkit.evaluate the dataset itself" in str(raised.value)
            with pytest.raises(UsageError, match=says):
                ddpkit.predict(_model(), loader)
    finally:
        rt.close()
