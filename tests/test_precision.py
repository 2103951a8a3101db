"""Precision: autocast per name, fp16 loss scaling on CPU, skipped steps and checkpointed state."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.errors import DdpkitError, UsageError
from ddpkit.state.precision import PRECISIONS, Precision

CPU = torch.device("cpu")


def _model_and_optimizer(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(8, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train_step(precision: Precision, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> bool:
    with precision.autocast():
        loss = model(x).float().pow(2).mean()
    precision.backward(loss)
    return precision.step(optimizer)


def _batch(seed: int) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(seed))


def test_fp16_scaler_state_round_trips_through_weights_only_load(tmp_path) -> None:
    precision = Precision("fp16", CPU)
    # A short growth interval (through the public state API) lets the scale grow within a few steps.
    precision.scaler.load_state_dict({**precision.scaler.state_dict(), "growth_interval": 3})
    model, optimizer = _model_and_optimizer()
    results = [_train_step(precision, model, optimizer, _batch(i)) for i in range(8)]
    state = precision.state_dict()
    assert True in results
    assert state["scaler"]["scale"] != 65536.0 and state["scaler"]["_growth_tracker"] > 0

    path = tmp_path / "precision.pt"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=True)
    restored = Precision("fp16", CPU)
    restored.load_state_dict(loaded)
    assert restored.scaler.get_scale() == precision.scaler.get_scale()
    assert restored.scaler.state_dict() == precision.scaler.state_dict()

    # The restored scaler continues exactly where the original left off.
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for i in range(8, 12):
        stepped = _train_step(precision, model, optimizer, _batch(i))
        assert _train_step(restored, twin, twin_opt, _batch(i)) == stepped
    assert restored.scaler.state_dict() == precision.scaler.state_dict()
    torch.testing.assert_close(twin.weight, model.weight)


def test_inf_gradient_skips_step_and_halves_scale() -> None:
    precision = Precision("fp16", CPU)
    model, optimizer = _model_and_optimizer()
    assert _train_step(precision, model, optimizer, _batch(0)) is True
    precision.flush()
    scale = precision.scaler.get_scale()
    weight = model.weight.detach().clone()

    x = _batch(1)
    x[0, 0] = float("inf")
    assert _train_step(precision, model, optimizer, x) is False
    assert precision.scaler.get_scale() == scale  # the update waits for the next backward
    precision.flush()
    assert precision.scaler.get_scale() == scale / 2
    torch.testing.assert_close(model.weight, weight, rtol=0, atol=0)
    assert model.weight.grad is None  # zero_grad(set_to_none=True) ran even though it skipped

    assert _train_step(precision, model, optimizer, _batch(2)) is True
    assert not torch.equal(model.weight, weight)


def test_unscale_gives_true_gradients_for_clipping() -> None:
    model, _ = _model_and_optimizer()
    reference = copy.deepcopy(model)
    x = _batch(3)
    reference(x).pow(2).mean().backward()

    precision = Precision("fp16", CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision.backward(model(x).pow(2).mean())
    assert not torch.allclose(model.weight.grad, reference.weight.grad)  # still scaled
    precision.unscale_(optimizer)
    torch.testing.assert_close(model.weight.grad, reference.weight.grad)
    assert precision.step(optimizer) is True  # step after a manual unscale_ does not unscale twice


def test_bf16_autocast_on_cpu_makes_linear_output_bf16() -> None:
    precision = Precision("bf16", CPU)
    model, optimizer = _model_and_optimizer()
    with precision.autocast():
        out = model(_batch(0))
    assert out.dtype == torch.bfloat16
    assert model(_batch(0)).dtype == torch.float32  # only inside the context
    assert precision.scaler is None
    assert _train_step(precision, model, optimizer, _batch(1)) is True


def test_fp16_autocast_on_cpu_makes_linear_output_fp16() -> None:
    precision = Precision("fp16", CPU)
    model, _ = _model_and_optimizer()
    with precision.autocast():
        assert model(_batch(0)).dtype == torch.float16
    assert isinstance(precision.scaler, torch.amp.GradScaler) and precision.scaler.is_enabled()


def test_fp32_is_plain() -> None:
    precision = Precision("fp32", CPU)
    model, optimizer = _model_and_optimizer()
    reference, ref_opt = _model_and_optimizer()
    with precision.autocast():
        assert not torch.is_autocast_enabled("cpu")
        out = model(_batch(0))
    assert out.dtype == torch.float32 and precision.scaler is None
    assert _train_step(precision, model, optimizer, _batch(1)) is True
    reference(_batch(1)).pow(2).mean().backward()
    ref_opt.step()
    torch.testing.assert_close(model.weight, reference.weight, rtol=0, atol=0)
    assert model.weight.grad is None
    assert precision.state_dict() == {"precision": "fp32", "scaler": None}


def test_unknown_precision_lists_choices() -> None:
    assert PRECISIONS == ("fp32", "bf16", "fp16")
    with pytest.raises(UsageError, match="unknown precision 'fp8'; choose one of fp32, bf16, fp16"):
        Precision("fp8", CPU)


def test_loading_fp16_state_into_bf16_run_is_refused() -> None:
    state = Precision("fp16", CPU).state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    with pytest.raises(DdpkitError, match="written with precision 'fp16' and this run uses 'bf16'"):
        Precision("bf16", CPU).load_state_dict(loaded)
    with pytest.raises(DdpkitError, match="no precision state"):
        Precision("fp16", CPU).load_state_dict({"scale": 2.0})


def test_a_sharded_scaler_asks_every_rank_for_inf_before_a_fused_optimizer_steps(monkeypatch, tmp_path) -> None:
    """Under fsdp a fused optimizer (``AdamW(fused=True)``, common on CUDA) made ``scaler.step`` look for
    inf/nan in this rank's own gradient shards only (``_check_inf_per_device``), not ``ShardedGradScaler``'s
    ``unscale_``, which all-reduces what it finds: one rank skipped the step while the others took it."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        _sharded_scaler_steps(monkeypatch)
    finally:
        dist.destroy_process_group()


def _sharded_scaler_steps(monkeypatch) -> None:
    precision = Precision("fp16", CPU)
    precision.shard()
    model, _ = _model_and_optimizer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    assert optimizer._step_supports_amp_scaling  # the branch that skipped unscale_
    asked = []
    real = type(precision.scaler).unscale_
    monkeypatch.setattr(type(precision.scaler), "unscale_", lambda self, opt: asked.append(opt) or real(self, opt))
    assert _train_step(precision, model, optimizer, _batch(0)) is True
    assert asked == [optimizer]
    precision.flush()
    asked.clear()
    precision.backward(model(_batch(1)).pow(2).mean())
    precision.unscale_(optimizer)  # the script unscaled already (to clip): not a second time
    assert precision.step(optimizer) is True and len(asked) == 1


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_training_forward_outside_autocast_is_said_once(precision):
    """precision='bf16' casts inside rt.autocast() only: a loop without it trained in fp32, silently."""
    rt = ddpkit.init(seed=0, precision=precision)
    model = rt.setup(torch.nn.Linear(3, 2))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(2, 3))  # an evaluation first: not the training forward
    with pytest.warns(
        UserWarning, match=rf"^precision='{precision}' casts what runs inside `with rt.autocast\(\):`"
    ) as said:
        out = model(torch.randn(2, 3))
    assert out.dtype == torch.float32 and said[0].filename == __file__  # the script's line, not torch's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(2, 3))  # once
    rt.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_training_forward_inside_autocast_says_nothing(precision):
    rt = ddpkit.init(seed=0, precision=precision)
    model = rt.setup(torch.nn.Linear(3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with rt.autocast():
            out = model(torch.randn(2, 3))
        model(torch.randn(2, 3))  # the first was inside: nothing is watched after it
    assert out.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    rt.close()
