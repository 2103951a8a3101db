"""SyncBatchNorm on CPU/gloo must train exactly like one BatchNorm2d on the whole batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

TOL = dict(atol=1e-5, rtol=1e-5)
C = 4


def _data(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(8, C, 3, 3, generator=gen) * 3 + 1.5,
        "g": torch.randn(8, C, 3, 3, generator=gen),  # upstream gradient: loss = sum(out * g)
        "x2": torch.randn(8, C, 3, 3, generator=gen) * 2 - 0.5,
        "weight": torch.rand(C, generator=gen) + 0.5,
        "bias": torch.randn(C, generator=gen),
    }


def _train_steps(bn: nn.Module, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One step with backward, one forward-only step, then eval on the first batch."""
    bn.train()
    x = parts["x"].clone().requires_grad_(True)
    out = bn(x)
    (out * parts["g"]).sum().backward()
    bn(parts["x2"])
    bn.eval()
    with torch.no_grad():
        out_eval = bn(parts["x"])
    return {
        "out": out.detach(),
        "grad_x": x.grad,
        "grad_w": bn.weight.grad,
        "grad_b": bn.bias.grad,
        "running_mean": bn.running_mean.clone(),
        "running_var": bn.running_var.clone(),
        "num_batches_tracked": bn.num_batches_tracked.clone(),
        "out_eval": out_eval,
    }


def _make(cls: type, data: dict[str, torch.Tensor], momentum: float | None) -> nn.Module:
    bn = cls(C, momentum=momentum)
    with torch.no_grad():
        bn.weight.copy_(data["weight"])
        bn.bias.copy_(data["bias"])
    return bn


def _sync_worker(data: dict[str, torch.Tensor], splits: list[int], momentum: float | None) -> dict:
    rt = ddpkit.init(backend="gloo", device="cpu")
    start = sum(splits[: rt.rank])
    rows = slice(start, start + splits[rt.rank])
    local = {key: data[key][rows] for key in ("x", "g", "x2")}
    bn = _make(SyncBatchNorm, data, momentum)
    result = _train_steps(bn, local)
    rt.close()
    return result


def _check_against_reference(splits: list[int], momentum: float | None) -> None:
    data = _data()
    results = ddpkit.launch(_sync_worker, nprocs=len(splits), args=(data, splits, momentum))
    ref = _train_steps(_make(nn.BatchNorm2d, data, momentum), data)

    for key in ("out", "grad_x"):
        got = torch.cat([results[r][key] for r in range(len(splits))])
        assert got.shape == ref[key].shape
        torch.testing.assert_close(got, ref[key], **TOL, msg=f"{key} differs from BatchNorm2d")
    for key in ("grad_w", "grad_b"):
        summed = sum(results[r][key] for r in range(len(splits)))
        torch.testing.assert_close(summed, ref[key], **TOL, msg=f"{key} summed over ranks differs")
    for rank, res in results.items():
        for key in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(res[key], ref[key], **TOL, msg=f"rank {rank} {key} differs")
        rows = slice(sum(splits[:rank]), sum(splits[: rank + 1]))
        torch.testing.assert_close(res["out_eval"], ref["out_eval"][rows], **TOL)
    for rank, size in enumerate(splits):
        assert results[rank]["out"].shape == (size, C, 3, 3)
        if 0 < size < len(data["x"]):  # local statistics differ from global ones: the test can fail
            rows = slice(sum(splits[:rank]), sum(splits[: rank + 1]))
            local_mean = data["x"][rows].mean(dim=(0, 2, 3))
            assert not torch.allclose(local_mean, data["x"].mean(dim=(0, 2, 3)), atol=1e-3)
        if size == 0:  # an empty rank contributes nothing to the parameter gradients
            assert torch.count_nonzero(results[rank]["grad_w"]) == 0


@pytest.mark.timeout(120)
def test_uneven_split_matches_single_process_batchnorm() -> None:
    _check_against_reference([5, 3], momentum=0.1)


@pytest.mark.timeout(120)
def test_rank_with_zero_samples_finishes_and_matches() -> None:
    # momentum=None: the cumulative average over num_batches_tracked, as in nn.BatchNorm.
    _check_against_reference([8, 0], momentum=None)


def test_world_of_one_train_and_eval_equal_batchnorm() -> None:
    data = _data(seed=1)
    for momentum in (0.3, None):
        got = _train_steps(_make(SyncBatchNorm, data, momentum), data)
        ref = _train_steps(_make(nn.BatchNorm2d, data, momentum), data)
        for key, value in ref.items():
            torch.testing.assert_close(got[key], value, **TOL, msg=f"{key} (momentum={momentum})")


def test_eval_mode_equals_batchnorm_eval() -> None:
    data = _data(seed=2)
    ref = _make(nn.BatchNorm2d, data, 0.1)
    with torch.no_grad():
        ref.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
        ref.running_var.copy_(torch.tensor([2.0, 0.5, 1.5, 3.0]))
    sync = convert_sync_batchnorm(ref, torch.device("cpu"))
    assert isinstance(sync, SyncBatchNorm)
    ref_copy = _make(nn.BatchNorm2d, data, 0.1)
    ref_copy.load_state_dict(sync.state_dict())
    sync.eval()
    ref_copy.eval()
    torch.testing.assert_close(sync(data["x"]), ref_copy(data["x"]), **TOL)
    assert int(sync.num_batches_tracked) == 0  # eval must not count batches


def _small_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Sequential(nn.Conv2d(8, 4, 3), nn.BatchNorm2d(4, affine=False, momentum=None, eps=1e-3)),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 6),
        nn.BatchNorm1d(6, track_running_stats=False),
    )
    with torch.no_grad():
        net[1].weight.uniform_(0.5, 1.5)
        net[1].running_mean.uniform_(-1, 1)
        net[1].num_batches_tracked.fill_(7)
    net[1].bias.requires_grad_(False)
    return net


def test_convert_replaces_every_batchnorm_and_keeps_values() -> None:
    before = _small_net()
    expected = {k: v.clone() for k, v in before.state_dict().items()}
    grads = {k: p.requires_grad for k, p in before.named_parameters()}
    net = convert_sync_batchnorm(before, torch.device("cpu"))

    norms = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(norms) == 3 and all(type(m) is SyncBatchNorm for m in norms)
    state = net.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    assert {k: p.requires_grad for k, p in net.named_parameters()} == grads
    inner = net[3][1]
    assert (inner.eps, inner.momentum, inner.affine, inner.weight) == (1e-3, None, False, None)
    assert net[6].track_running_stats is False and net[6].running_mean is None
    net.train()
    assert net(torch.randn(5, 3, 8, 8)).shape == (5, 6)


def _count_collectives() -> dict:
    """rt.setup with sync_batchnorm: how many collectives a BatchNorm layer makes per step, on which group."""
    import torch.distributed as dist

    from ddpkit.parallel import sync_batchnorm

    rt = ddpkit.init(backend="gloo", device="cpu")
    net = nn.Sequential(nn.Conv2d(2, C, 3), nn.BatchNorm2d(C), nn.ReLU(), nn.Conv2d(C, C, 3), nn.BatchNorm2d(C))
    model = rt.setup(net, sync_batchnorm=True)
    layers = [m for m in model.modules() if isinstance(m, SyncBatchNorm)]
    calls = {"all_gather": 0, "all_reduce": 0}
    for name in calls:
        real = getattr(sync_batchnorm.dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            if kwargs.get("group") is layers[0].process_group:
                calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(sync_batchnorm.dist, name, counted)
    before = SyncBatchNorm.collective_seconds
    model(torch.randn(4, 2, 7, 7)).sum().backward()
    waited = SyncBatchNorm.collective_seconds - before  # what ddpkit bench reads
    groups = {id(m.process_group) for m in layers}
    own_group = layers[0].process_group is not None and layers[0].process_group is not dist.group.WORLD
    rt.close()
    return {
        "calls": calls,
        "layers": len(layers),
        "one_group": len(groups) == 1,
        "own_group": own_group,
        "waited": waited,
    }


@pytest.mark.timeout(120)
def test_one_collective_forward_and_one_backward_per_layer_on_a_group_of_their_own():
    """Two per layer per step (torch's CUDA SyncBatchNorm makes as many); on CPU the statistics
    travel on their own group, so a layer's backward never queues behind DDP's gradient buckets."""
    result = ddpkit.launch(_count_collectives, nprocs=2)[0]
    assert result["layers"] == 2 and result["one_group"] and result["own_group"]
    assert result["calls"] == {"all_gather": 2, "all_reduce": 2}
    assert result["waited"] > 0


@pytest.mark.timeout(120)
def test_torchs_sync_batchnorm_converted_by_the_script_trains_as_the_option_on_cpu() -> None:
    """A script ported from plain DDP converts its BatchNorm with torch's convert_sync_batchnorm, which
    refuses CPU modules (one process: "expected input tensor to be on GPU"; two: "only work with GPU
    modules", both a traceback). ddpkit takes it for sync_batchnorm=True: the same bits as the option on
    2 processes, plain BatchNorm's on one."""
    import workers

    def same(a: dict, b: dict) -> bool:
        return a["weights"].keys() == b["weights"].keys() and all(
            torch.equal(v, b["weights"][k]) for k, v in a["weights"].items()
        )

    script = ddpkit.launch(workers.scripts_sync_batchnorm, nprocs=2, args=("script",))[0]
    assert same(script, ddpkit.launch(workers.scripts_sync_batchnorm, nprocs=2, args=("option",))[0])
    assert "1.running_mean" in script["weights"]
    assert same(workers.scripts_sync_batchnorm("script"), workers.scripts_sync_batchnorm("none"))


def test_torchs_sync_batchnorm_in_a_model_refuses_what_the_option_refuses() -> None:
    model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    rt = ddpkit.init(seed=0)
    try:
        with pytest.raises(ddpkit.UsageError, match="SyncBatchNorm"):
            rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_shards=2)
    finally:
        rt.close()
