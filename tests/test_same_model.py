"""Ranks that hold different models: a checkpoint loaded on rank 0 alone after ``rt.setup`` trained
each rank's own weights to the end, and ``ddpkit.evaluate``/``predict`` of a model built unseeded (or
an EMA of weights that replicas train apart) joined several models' shards into one metric, silently.
Now the first ``rt.step`` and every evaluation compare each tensor's bits across ranks and say which."""

from __future__ import annotations

import pytest
import torch

import ddpkit
import workers
from ddpkit.parallel import same_model


@pytest.mark.timeout(120)
def test_weights_loaded_on_rank_0_alone_after_setup_are_refused_at_the_first_step():
    for rank, found in ddpkit.launch(workers.differing_ranks, nprocs=2, args=("loaded-on-main",)).items():
        assert found["steps"] == 0, (rank, found)  # before the optimizer took a step
        assert found["error"].startswith(
            "rt.step: the model's weights differ between ranks at the first step (rank 1's weight is not rank 0's)"
        ), found["error"]
        assert "not on rank 0 alone" in found["error"], found["error"]
    for rank, found in ddpkit.launch(workers.differing_ranks, nprocs=2, args=("loaded-everywhere",)).items():
        assert found["error"] is None and found["steps"] == 4, (rank, found)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["unseeded", "ema"])
def test_evaluate_and_predict_refuse_a_model_that_differs_between_ranks(case):
    runs = ddpkit.launch(workers.differing_ranks, nprocs=2, args=(case,))
    name = "weight" if case == "unseeded" else "module.weight"
    for rank, found in runs.items():
        assert found["error"] is not None and found["error"].startswith(
            f"ddpkit.evaluate: the model differs between ranks (rank 1's {name} is not rank 0's)"
        ), (rank, found["error"])
        assert "metrics" not in found
    assert not torch.equal(runs[0]["state"][name], runs[1]["state"][name])  # they do differ


@pytest.mark.timeout(120)
def test_a_seeded_model_evaluates_and_predicts_as_one_process_does():
    runs = ddpkit.launch(workers.differing_ranks, nprocs=2, args=("seeded",))
    one = workers.differing_ranks("seeded")
    for rank, found in runs.items():
        assert found["error"] is None, (rank, found["error"])
        assert found["metrics"]["count"] == 64 and found["metrics"]["accuracy"] == one["metrics"]["accuracy"]
        assert torch.equal(found["predicted"], one["predicted"]), rank


@pytest.mark.timeout(120)
def test_a_ddp_model_that_broadcasts_its_buffers_is_evaluated_with_rank_0s():
    """A buffer besides BatchNorm's keeps DDP's broadcast, so each rank's statistics are its own after
    the last forward: evaluate takes rank 0's first, as the DDP model's next forward would."""
    runs = ddpkit.launch(workers.differing_ranks, nprocs=2, args=("buffers",))
    assert runs[0]["error"] is None and runs[1]["error"] is None, runs
    model = workers._Counting()
    model.load_state_dict(runs[0]["state"])  # rank 0's model, on one process
    expected = ddpkit.evaluate(model, torch.utils.data.TensorDataset(*_digits_like()), num_classes=3)
    for rank, found in runs.items():
        assert torch.equal(found["state"]["net.1.running_mean"], runs[0]["state"]["net.1.running_mean"]), rank
        for metrics in (found["inner_metrics"], found["metrics"]):  # model.module, then the DDP model
            assert metrics["accuracy"] == expected["accuracy"], rank
            assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-6), rank


def _digits_like() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)  # workers.differing_ranks's data
    return torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.bfloat16, torch.complex128, torch.int64, torch.uint8, torch.bool]
)
def test_the_fingerprint_tells_one_bit_apart_in_any_order(dtype):
    base = torch.linspace(-3, 3, 101, dtype=torch.float64)
    one = (base > 0) if dtype == torch.bool else (base * 40 + 125 if not dtype.is_floating_point else base).to(dtype)
    other = one.clone()
    if dtype == torch.bool:
        other[0] = ~other[0]
    elif dtype.is_complex:  # its real part's next float
        other.view(torch.float64)[0] = torch.nextafter(one.real[0], torch.tensor(10.0, dtype=torch.float64))
    elif not dtype.is_floating_point:
        other[0] += 1
    else:
        other[0] = torch.nextafter(other[0], torch.tensor(10.0, dtype=dtype))  # the next float: one ulp
    module, moved = torch.nn.Module(), torch.nn.Module()
    module.register_buffer("t", one)
    moved.register_buffer("t", one.flip(0))  # an exact sum: the order the threads add in cannot change it
    changed = torch.nn.Module()
    changed.register_buffer("t", other)
    names, sums = same_model.fingerprint(module)
    assert names == ["buffer t"] and sums.dtype == torch.int64
    assert torch.equal(same_model.fingerprint(moved)[1], sums)
    assert not torch.equal(same_model.fingerprint(changed)[1], sums)
    assert same_model.differs(module) is None  # one process: nothing to compare, no collective


def test_the_fingerprint_names_buffers_and_leaves_out_parameters_not_made_yet():
    module = torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.BatchNorm1d(3))
    names, sums = same_model.fingerprint(module)
    assert names == [
        "1.weight",
        "1.bias",
        "buffer 1.running_mean",
        "buffer 1.running_var",
        "buffer 1.num_batches_tracked",
    ]
    assert len(sums) == 5
    module(torch.randn(4, 2))  # the forward makes the lazy layer's parameters
    assert same_model.fingerprint(module, buffers=False)[0] == ["0.weight", "0.bias", "1.weight", "1.bias"]
