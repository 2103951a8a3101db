"""A loader read pass after pass without ``rt.epochs``: ``for epoch in range(n)``, or the step-based
loop of nanoGPT and Hugging Face's ``max_steps`` (``next(it)``, a new ``iter(loader)`` at its end).
Each pass read the first epoch's order again, as torch's ``DistributedSampler`` does when
``set_epoch`` is forgotten, the trap ddpkit exists to remove."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ddpkit
import pass_workers


@pytest.fixture
def rt():
    runtime = ddpkit.init(seed=0)
    yield runtime
    runtime.close()


def _orders(rt, loop: str, passes: int = 3, plain_backward: bool = False) -> list[list[int]]:
    """The sample indices each pass of a shuffled loader reads, trained as ``loop`` says."""
    data = torch.utils.data.TensorDataset(torch.arange(12), torch.arange(12) % 2)
    net = torch.nn.Embedding(12, 2)
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = rt.loader(data, global_batch_size=4, shuffle=True)
    epochs = rt.epochs(passes) if loop == "rt.epochs" else range(passes)
    orders = []
    for epoch in epochs:
        if loop == "set_epoch":
            loader.set_epoch(epoch)
        elif loop == "sampler.set_epoch":  # torch's habit: DistributedSampler.set_epoch on loader.sampler
            loader.sampler.set_epoch(epoch)
        order = []
        for x, y in loader:
            order += x.tolist()
            if loop == "no step":
                continue
            loss = F.cross_entropy(model(x), y)
            loss.backward() if plain_backward else rt.backward(loss)
            rt.step(optimizer)
        orders.append(order)
    return orders


def test_each_pass_of_a_loop_without_rt_epochs_reads_the_next_epoch(rt):
    orders = _orders(rt, "range")
    assert len({tuple(order) for order in orders}) == 3  # three orders, not the first one three times
    assert all(sorted(order) == list(range(12)) for order in orders)
    rt.close()
    with ddpkit.init(seed=0) as again:
        assert _orders(again, "rt.epochs") == orders  # the epochs rt.epochs would set: 0, 1, 2


@pytest.mark.parametrize("loop", ["set_epoch", "sampler.set_epoch", "plain-backward"])
def test_set_epoch_each_epoch_or_a_plain_backward_reads_the_same_epochs(rt, loop):
    expected = _orders(rt, "range")
    rt.close()
    with ddpkit.init(seed=0) as again:
        found = _orders(again, "range", plain_backward=True) if loop == "plain-backward" else _orders(again, loop)
    assert found == expected  # set_epoch(epoch) is not counted twice; loss.backward() + rt.step moves on too


def test_a_sampler_of_no_loader_says_which_set_epoch_to_call():
    from ddpkit.loop.sampler import GlobalBatchSampler

    with pytest.raises(ddpkit.UsageError, match=r"belongs to no ddpkit loader; call loader.set_epoch\(epoch\)"):
        GlobalBatchSampler(10, global_batch_size=2).set_epoch(1)


def test_passes_that_train_nothing_and_a_probe_do_not_move_the_epoch_on(rt):
    orders = _orders(rt, "no step")  # an inspection loop, an evaluation loop: no step, one order
    assert orders[0] == orders[1] == orders[2]
    rt.close()
    with ddpkit.init(seed=0) as again:
        loader = again.loader(list(range(10)), global_batch_size=2, shuffle=True)
        probe = next(iter(loader)).tolist()  # a shape probe before training
        assert next(iter(loader)).tolist() == probe


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stop_at", [7, 10], ids=["mid-pass", "after-a-pass-last-batch"])
def test_a_step_based_loop_resumes_exactly_on_any_world_size(tmp_path, stop_at):
    """5 batches a pass: step 7 stops inside the second pass, step 10 after its last batch, before
    the new iter(loader) that the uninterrupted run begins the third pass with (epoch 2)."""
    whole = ddpkit.launch(pass_workers.step_based, nprocs=2, args=(str(tmp_path / "whole"), 17))[0]
    assert len(set(whole["seen"][:5])) == 5 and whole["seen"][5:10] != whole["seen"][:5]  # each pass anew
    stopped = str(tmp_path / "stopped")
    ddpkit.launch(pass_workers.step_based, nprocs=2, args=(stopped, 17, stop_at))
    with pytest.warns(UserWarning, match="written by 2 process"):
        resumed = pass_workers.step_based(stopped, 17)  # on one process: micro_shards=2, the same bits
    assert resumed["step"] == 17 and len(resumed["seen"]) == 17 - stop_at  # from the checkpoint of step stop_at
    for key, value in whole["weights"].items():
        assert torch.equal(resumed["weights"][key], value), key
