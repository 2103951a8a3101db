"""rt.backward(loss, count=n): a loss averaged over tokens trains to the same weights on any number of
processes and accumulated batches (and to the same bits under micro_shards), where the per-rank mean
of a plain rt.backward does not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ddpkit
import workers
from ddpkit.errors import UsageError


def _relative(a: dict, b: dict) -> float:
    flat_a = torch.cat([v.double().flatten() for v in a["weights"].values()])
    flat_b = torch.cat([v.double().flatten() for v in b["weights"].values()])
    return float((flat_a - flat_b).norm() / flat_a.norm())


def _equal(a: dict, b: dict) -> bool:
    return a["weights"].keys() == b["weights"].keys() and all(
        torch.equal(v, b["weights"][k]) for k, v in a["weights"].items()
    )


@pytest.fixture(scope="module")
def one_process():
    """One process, batches of 8 (float64): the mean over every token of the batch, whichever way it is weighted."""
    counted, plain = workers.counted_lm(True), workers.counted_lm(False)
    assert counted["steps"] == plain["steps"] == 12
    assert _relative(counted, plain) < 1e-13  # one process, one batch a step: the count changes only rounding
    return counted


@pytest.mark.timeout(180)
def test_a_token_mean_trains_to_one_processs_weights_on_two_processes_fsdp_and_accumulated_batches(one_process):
    two = ddpkit.launch(workers.counted_lm, nprocs=2)
    assert _relative(two[0], one_process) < 1e-13
    sharded = ddpkit.launch(workers.counted_lm_sharded, nprocs=2)  # fsdp averages as DDP does
    assert _relative(sharded[0], one_process) < 1e-13
    accumulated = workers.counted_lm(True, 2)  # two batches of 4 a step
    assert accumulated["steps"] == 12 and _relative(accumulated, one_process) < 1e-13
    # what count= fixes: each rank's (or batch's) mean weighed by its samples, not its tokens
    plain_two = ddpkit.launch(workers.counted_lm, nprocs=2, args=(False,))[0]
    assert _relative(plain_two, one_process) > 1e-3
    assert _relative(workers.counted_lm(False, 2), one_process) > 1e-3


@pytest.mark.timeout(240)
@pytest.mark.parametrize("worlds", [(2,), pytest.param((4,), marks=pytest.mark.slow)])  # (4 processes: 2 cores)
def test_under_micro_shards_counted_tokens_end_at_the_same_bits_on_1_2_and_4_processes(one_process, worlds):
    one = workers.counted_lm(True, 2, 4, "float32")  # four shards, two batches of 4 a step
    for nprocs in worlds:
        runs = ddpkit.launch(workers.counted_lm, nprocs=nprocs, args=(True, 2, 4, "float32"))
        assert _equal(runs[0], one), nprocs
    # and the shards' counts make the mean over every token of the step (float64, rounding apart)
    assert _relative(workers.counted_lm(True, 1, 2, "float64"), one_process) < 1e-13


def test_the_power_of_two_that_keeps_gradients_small_changes_no_bit(monkeypatch):
    """``c`` is chosen from the first counted backward's units (64 here); a run resumed elsewhere may choose
    another. A power of two scales every float exactly; a scale that is not one would round differently."""
    from ddpkit.loop import counted

    chosen = workers.counted_lm(True, 1, None, "float32")
    real = counted.weigh

    def weigh_with(scale):
        def weigh(state, *args, **kwargs):
            state.scale = scale if state.scale is None else state.scale
            return real(state, *args, **kwargs)

        return weigh

    monkeypatch.setattr(counted, "weigh", weigh_with(2.0**-7))
    assert _equal(workers.counted_lm(True, 1, None, "float32"), chosen)
    monkeypatch.setattr(counted, "weigh", weigh_with(3.0))
    assert not _equal(workers.counted_lm(True, 1, None, "float32"), chosen)


def _tiny(rt, **setup):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return rt.setup(model, **setup)


def test_two_optimizers_after_one_backward_and_clipping_first_divide_the_gradients_once():
    def train(split: bool, clip: bool):
        rt = ddpkit.init(seed=0)
        model = _tiny(rt)
        first = torch.optim.SGD(model[0].parameters(), lr=0.1)
        second = torch.optim.SGD(model[1].parameters(), lr=0.1)
        both = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(6, 4), torch.tensor([0, 1, -100, 1, -100, 0])
            rt.backward(F.cross_entropy(model(x), y, ignore_index=-100), count=(y != -100).sum())
            if clip:
                rt.clip_grad_norm_(model, 1e9)  # divides first; rt.step must not divide again
            if split:
                rt.step(first)
                rt.step(second)
            else:
                rt.step(both)
        found = [p.detach().clone() for p in model.parameters()]
        rt.close()
        return found

    reference = train(False, False)
    for split, clip in ((True, False), (False, True), (True, True)):
        assert all(torch.equal(a, b) for a, b in zip(train(split, clip), reference)), (split, clip)


def test_a_step_whose_tokens_are_all_ignored_keeps_the_weights_and_no_nan():
    rt = ddpkit.init(seed=0)
    try:
        model = _tiny(rt)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        before = [p.detach().clone() for p in model.parameters()]
        y = torch.full((3,), -100)
        loss = F.cross_entropy(model(torch.randn(3, 4)), y, ignore_index=-100)
        assert loss.isnan()  # torch's mean of no token
        rt.backward(loss, count=0)
        rt.step(optimizer)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    finally:
        rt.close()


@pytest.mark.parametrize(
    "count,match",
    [
        ("12", "a number or a one-element tensor; got str"),
        (torch.tensor([3, 4]), r"got a tensor of shape \(2,\) \(sum it"),
        (-1, "finite number >= 0; got -1.0"),
        (float("nan"), "finite number >= 0; got nan"),
        (True, "got bool"),
    ],
)
def test_a_count_that_is_not_a_number_of_units_is_one_line(count, match):
    rt = ddpkit.init(seed=0)
    try:
        model = _tiny(rt)
        with pytest.raises(UsageError, match=match) as refused:
            rt.backward(model(torch.randn(2, 4)).sum(), count=count)
        assert "\n" not in str(refused.value)
    finally:
        rt.close()


def test_counting_some_backwards_of_a_step_and_not_others_is_refused():
    rt = ddpkit.init(seed=0)
    try:
        model = _tiny(rt)
        rt.backward(model(torch.randn(2, 4)).sum(), count=2)
        with pytest.raises(UsageError, match="pass it to every rt.backward of a step"):
            rt.backward(model(torch.randn(2, 4)).sum())
    finally:
        rt.close()


def test_replicas_that_train_apart_and_fault_tolerant_ones_refuse_counts_in_one_line():
    from ddpkit.loop.counted import CALL
    from ddpkit.parallel.modes import Periodic
    from ddpkit.parallel.replica import FaultTolerant
    from test_fault_tolerant import _Quorum

    class Syncer:
        name = "diloco"

    with pytest.raises(UsageError, match=r"with sync='diloco' is not built yet .* or train with sync='every-step'"):
        Periodic(Syncer()).refuse(CALL)
    with pytest.raises(UsageError, match="under --fault-tolerant is not built yet"):
        FaultTolerant(_Quorum()).refuse(CALL)


@pytest.mark.slow  # make test-slow: make test keeps the core of this family (its 15 minutes)
@pytest.mark.timeout(180)
def test_counts_compose_with_fp16_compression_and_the_fp16_scaler(one_process):
    """Compression sends an average, which the count's weight undoes as DDP's; fp16's scaler multiplies by a
    power of two, which the step's division and the unscaling leave exact (no step skipped)."""
    compressed = ddpkit.launch(workers.counted_lm_compressed, nprocs=2)[0]
    plain = ddpkit.launch(workers.counted_lm_compressed, nprocs=2, args=(False,))[0]
    assert _relative(compressed, one_process) < 1e-4 < 1e-2 < _relative(plain, one_process)
    fp32 = workers.counted_lm(True, 2, None, "float32")
    fp16 = workers.counted_lm(True, 2, None, "float32", "fp16")
    assert fp16["scale"] == 2.0**16 and fp16["steps"] == 12  # the scaler never backed off
    assert _equal(fp16, fp32)


@pytest.mark.timeout(180)
def test_a_short_last_batch_that_leaves_a_rank_without_tokens_or_shards_still_steps_with_its_peers():
    """49 samples, 8 a step: the last batch has one sample, so under DDP rank 1 holds none (count 0, a NaN
    mean) and under micro_shards its shards are all empty (no backward at all); the step's units are rank 0's."""
    one = workers.counted_lm(True, 1, None, "float64", length=49)
    assert one["steps"] == 14
    two = ddpkit.launch(workers.counted_lm, nprocs=2, args=(True, 1, None, "float64", "fp32", 49))[0]
    assert _relative(two, one) < 1e-13
    shards_one = workers.counted_lm(True, 1, 2, "float32", length=49)
    shards_two = ddpkit.launch(workers.counted_lm, nprocs=2, args=(True, 1, 2, "float32", "fp32", 49))[0]
    assert _equal(shards_two, shards_one)


@pytest.mark.slow  # 12 s: make test-slow (make test steps a short last batch without a shard, above)
@pytest.mark.timeout(180)
def test_a_run_resumed_at_a_short_last_batch_that_leaves_a_rank_without_shards_ends_at_the_same_bits(tmp_path):
    """Stopped after step 6 of 7 on 2 processes (micro_shards=2, 49 samples): the resumed run's first step
    is the one-sample batch, where rank 1 has no shard and so no counted backward (the power of two c
    is chosen anew there): the resumed run ends at the uninterrupted one's bits."""
    ckpt = str(tmp_path / "ckpt")
    whole = ddpkit.launch(workers.counted_lm, nprocs=2, args=(True, 1, 2, "float32", "fp32", 49))[0]
    stopped = ddpkit.launch(workers.counted_lm, nprocs=2, args=(True, 1, 2, "float32", "fp32", 49, ckpt, 6))[0]
    assert stopped == {"stopped": 6}
    resumed = ddpkit.launch(workers.counted_lm, nprocs=2, args=(True, 1, 2, "float32", "fp32", 49, ckpt))[0]
    assert resumed["steps"] == whole["steps"] == 14 and _equal(resumed, whole)


@pytest.mark.slow  # 10 s: make test-slow
@pytest.mark.timeout(240)
def test_a_compiled_ddp_model_takes_counts_and_its_reducer_check(one_process):
    """compile=True under DDP (dynamo's DDP optimizer, AOT autograd): counts weigh the same, and the
    reducer's check that every parameter got a gradient does not refuse a compiled backward."""
    compiled = ddpkit.launch(workers.counted_lm_compiled, nprocs=2)[0]
    assert compiled["steps"] == 12 and _relative(compiled, one_process) < 1e-12


@pytest.mark.timeout(120)
def test_a_class_weighted_mean_counts_its_weights_and_trains_alike_on_one_and_two_processes():
    """F.cross_entropy(weight=w) divides by w[y].sum(), not by the samples: weighed by samples, 1 and 2
    processes end 2.6e-2 apart (training.md says so); with count=w[y].sum(), a float, within rounding."""
    one = workers.class_weighted(True)
    two = ddpkit.launch(workers.class_weighted, nprocs=2, args=(True,))[0]
    assert _relative(one, two) < 1e-6
    plain = workers.class_weighted(False), ddpkit.launch(workers.class_weighted, nprocs=2, args=(False,))[0]
    assert _relative(*plain) > 1e-3


@pytest.mark.slow  # make test-slow: make test keeps the core of this family (its 15 minutes)
@pytest.mark.timeout(120)
def test_a_summed_loss_divided_by_its_samples_with_the_learning_rate_times_the_batch_trains_alike():
    """A loss summed over the batch is weighed as a mean of the rank's samples: 2 processes stepped with
    half of one's gradient (SGD: 7.7e-3 apart). Divided by its samples, with the learning rate times the
    global batch, it takes one process's summed steps (bitwise on one) on any world size."""
    summed = workers.summed_loss(False), ddpkit.launch(workers.summed_loss, nprocs=2, args=(False,))[0]
    assert _relative(*summed) > 1e-3
    mean_one = workers.summed_loss(True)
    assert _equal(mean_one, summed[0])  # lr x 16 over the mean is the sum's step (a power of two: exact)
    assert _relative(mean_one, ddpkit.launch(workers.summed_loss, nprocs=2, args=(True,))[0]) < 1e-6
