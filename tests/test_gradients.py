"""The gradients a script finds between rt.backward and rt.step: whole after a micro-shards loop, made
final by rt.unscale_gradients, and a change to them before they are (torch.nn.utils.clip_grad_norm_
kept from a plain PyTorch script, under fp16, counts or --fault-tolerant) refused in one line instead of
training on the wrong numbers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ddpkit
import ddpkit.runtime
import workers
from ddpkit.errors import UsageError


def _equal(a: dict, b: dict) -> bool:
    return a["weights"].keys() == b["weights"].keys() and all(
        torch.equal(v, b["weights"][k]) for k, v in a["weights"].items()
    )


def _relative(a: dict, b: dict) -> float:
    flat_a = torch.cat([v.double().flatten() for v in a["weights"].values()])
    flat_b = torch.cat([v.double().flatten() for v in b["weights"].values()])
    return float((flat_a - flat_b).norm() / flat_a.norm())


def _refused(match: str, *args: Any) -> None:
    """``workers.clipped_lm(*args)`` stops at its first rt.step with ``match``, before any optimizer step."""
    with pytest.raises(UsageError, match=match) as refused:
        workers.clipped_lm(*args)
    assert "\n" not in str(refused.value)
    runtime = ddpkit.runtime.current()
    assert runtime is not None and runtime.global_step == 0  # refused before the optimizer took it
    runtime.close()


@pytest.mark.timeout(120)
def test_torchs_clip_of_gradients_fp16_or_counts_still_divide_is_refused_in_one_line():
    """What a plain PyTorch script's torch.nn.utils.clip_grad_norm_ would clip: fp16's gradients 65536
    times too large (every step clipped to almost nothing), or counted ones not yet divided by the
    step's units (a norm twice as large on two processes as on one)."""
    fp16 = r"rt.step: the script changed the gradients after rt.backward while they still awaited fp16's division"
    _refused(
        fp16 + r" by its loss scale \(65536\).*clip with rt.clip_grad_norm_\(model, max_norm\)",
        "torch",
        False,
        None,
        "fp16",
        "float32",
    )
    counts = (
        r"awaited the division by every rank's units \(rt.backward\(count=...\)\).*call rt.unscale_gradients\(\) first"
    )
    _refused(counts, "torch", True)
    _refused(counts, "torch", True, None, "fp16", "float32")  # both: fp16's scale unscaled by the script is not enough
    _refused(counts, "scaler", True, None, "fp16", "float32")


@pytest.mark.timeout(120)
def test_after_unscale_gradients_torchs_clip_is_rt_clip_grad_norm_bit_for_bit():
    """rt.unscale_gradients() makes the gradients final; then torch's own clip (or the script's own
    unscaling through rt.precision.scaler, fp16 alone) is exactly rt.clip_grad_norm_."""
    for args in (
        ("unscale", False, None, "fp16", "float32"),
        ("scaler", False, None, "fp16", "float32"),
        ("unscale", True),
    ):
        mine, ours = workers.clipped_lm(*args), workers.clipped_lm("rt", *args[1:])
        assert _equal(mine, ours) and mine["norms"] == ours["norms"], args
        assert max(mine["norms"]) > 0.3  # the clip did clip
    plain = workers.clipped_lm("torch")  # fp32 without counts: final after the backward, as in plain PyTorch
    assert _equal(plain, workers.clipped_lm("rt"))
    # an accumulation group: nothing on the micro-step that does not sync, the group's mean on the last
    accumulated = workers.clipped_lm("unscale", True, None, "fp32", "float64", 2)
    assert _relative(accumulated, workers.clipped_lm("rt", True)) < 1e-13


@pytest.mark.timeout(180)
def test_torchs_clip_after_the_shards_loop_clips_their_sum_the_same_bits_on_1_and_2_processes():
    """The loop over rt.shards ends with the shards' sum along the tree (they were None before rt.step,
    and torch's clip clipped nothing, its norm 0), so a script's own clip clips the step's gradient."""
    one = workers.clipped_lm("torch", False, 2)
    assert min(one["norms"]) > 0 and max(one["norms"]) > 0.3
    assert (
        _equal(one, workers.clipped_lm("rt", False, 2)) and one["norms"] == workers.clipped_lm("rt", False, 2)["norms"]
    )
    two = ddpkit.launch(workers.clipped_lm, nprocs=2, args=("torch", False, 2))
    assert _equal(two[0], one) and two[0]["norms"] == one["norms"]
    counted = ddpkit.launch(workers.clipped_lm, nprocs=2, args=("unscale", True, 2))  # counts: after unscale_gradients
    assert _equal(counted[0], workers.clipped_lm("unscale", True, 2))


def _model_and_step(precision: str = "fp32"):
    rt = ddpkit.init(seed=0, precision=precision)
    model = torch.nn.Linear(4, 2)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return rt, model, optimizer


def test_a_backward_after_the_gradients_were_made_final_is_refused_where_it_would_mix_them():
    rt, model, optimizer = _model_and_step("fp16")
    rt.backward(model(torch.randn(3, 4)).sum())
    rt.clip_grad_norm_(model, 1.0)
    with pytest.raises(UsageError, match=r"rt.backward after rt.clip_grad_norm_ \(fp16's division by its loss scale"):
        rt.backward(model(torch.randn(3, 4)).sum())
    rt.close()
    rt, model, optimizer = _model_and_step()  # fp32, no counts: clipping changed nothing owed, as in plain PyTorch
    rt.backward(model(torch.randn(3, 4)).sum())
    rt.clip_grad_norm_(model, 1.0)
    rt.backward(model(torch.randn(3, 4)).sum())
    assert rt.step(optimizer)
    rt.backward(model(torch.randn(3, 4)).sum(), count=3)  # a new step: a backward after its unscale is refused
    rt.unscale_gradients()
    with pytest.raises(UsageError, match=r"after rt.unscale_gradients \(the division by every rank's units"):
        rt.backward(model(torch.randn(3, 4)).sum(), count=3)
    rt.close()


def test_gradients_set_to_none_or_changed_once_final_are_no_change_to_refuse():
    rt, model, optimizer = _model_and_step("fp16")
    rt.backward(model(torch.randn(3, 4)).sum())
    model.bias.grad = None  # dropped, not changed: the step goes on without it
    assert rt.step(optimizer)
    rt.backward(model(torch.randn(3, 4)).sum())
    rt.unscale_gradients(optimizer)
    model.weight.grad.mul_(0.5)  # final: the script's to change
    assert rt.step(optimizer)
    rt.backward(model(torch.randn(3, 4)).sum())
    model.weight.grad.mul_(0.5)  # between two backwards of a step: found at the second
    with pytest.raises(UsageError, match="^rt.backward: the script changed the gradients"):
        rt.backward(model(torch.randn(3, 4)).sum())
    rt.close()


def test_unscale_gradients_under_fp16_needs_the_optimizer():
    rt = ddpkit.init(seed=0, precision="fp16")
    model = rt.setup(torch.nn.Linear(4, 2))
    rt.backward(model(torch.randn(3, 4)).sum())
    with pytest.raises(
        UsageError, match=r"pass the optimizer to rt.setup\(model, optimizer\), or to rt.unscale_gradients"
    ):
        rt.unscale_gradients()
    rt.close()


class _Quorum:
    """A step's quorum that averages by adding 1 (so an average made twice shows) and records its commits."""

    def __init__(self) -> None:
        self.checked: list[bool] = []

    def in_quorum(self) -> bool:
        return True

    def average(self, tensor: torch.Tensor, **_: Any) -> None:
        tensor.add_(1.0)

    def should_commit(self, *, checked: bool = False) -> bool:
        self.checked.append(checked)
        return True


def test_a_fault_tolerant_replica_averages_before_a_clip_once_and_its_commit_is_then_checked():
    """Under --fault-tolerant rt.clip_grad_norm_ clipped each replica's own gradients before the commit
    averaged them (1.2e-2 from one process with clipping, where the mode promises 1e-5): complete()
    averages them first, the commit does not again, and asks its question checked (the script's calls
    came between)."""
    from ddpkit.parallel.options import SetupOptions
    from ddpkit.parallel.replica import FaultTolerant

    quorum = _Quorum()
    replica = FaultTolerant(quorum)
    model = replica.prepare(torch.nn.Linear(2, 1, bias=False), SetupOptions())
    (weight,) = model.parameters()
    weight.grad = torch.zeros_like(weight)
    assert replica.finishes_at_step() == "the average over the step's replicas (--fault-tolerant)"
    replica.complete([weight], stepping=True)  # rt.step's: left to the commit, right before its question
    assert weight.grad.sum() == 0
    replica.complete([weight])
    assert torch.equal(weight.grad, torch.ones_like(weight)) and replica.finishes_at_step() is None
    assert replica.commit([weight], None) and torch.equal(weight.grad, torch.ones_like(weight))
    assert quorum.checked == [False]
    assert replica.commit([weight], None) and torch.equal(weight.grad, torch.full_like(weight, 2.0))
    assert quorum.checked == [False, True]  # a step averaged by its commit alone: nothing came between
