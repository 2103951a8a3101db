"""A script's own ``optimizer.step()`` (and a hand-kept GradScaler's ``scaler.step(optimizer)``) is a step
of the run.

A loop that kept torch's ``loss.backward()`` and ``optimizer.step()`` beside ``rt.setup``, ``rt.loader``
and ``rt.checkpoint`` trained, but ddpkit never saw its steps: ``rt.global_step`` stayed 0, every
checkpoint took the name of step 0, and no loader was marked as training's, so a checkpoint kept no
position and the resumed run read its epoch again from the start (0.11 away from the uninterrupted run,
silently). Where the step cannot hold outside ``rt.step`` it is refused in one line.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ddpkit
from ddpkit._torch import unwrap
from ddpkit.errors import UsageError
from ddpkit.parallel.replica import FaultTolerant


def _data() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randn(80, 6, dtype=torch.float64, generator=generator), torch.randint(0, 3, (80,), generator=generator)
    )


def _train(where: str, stop: int = 0, scaler: bool = False) -> dict:
    """Two epochs of a hand loop (zero_grad, loss.backward, optimizer.step), a checkpoint every 3 steps;
    ``stop``: leave after that many steps, as a killed run would (its newest checkpoint stays)."""
    rt = ddpkit.init(seed=0, checkpoint_dir=where, resume="auto")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    grad_scaler = torch.amp.GradScaler("cpu", enabled=scaler)
    loader = rt.loader(_data(), global_batch_size=16, shuffle=True)
    state = {"model": model, "optimizer": optimizer}
    rt.resume(state)
    steps = 0
    names = []
    for _ in rt.epochs(2):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            grad_scaler.scale(loss).backward()
            grad_scaler.step(optimizer)
            grad_scaler.update()
            steps += 1
            if rt.global_step % 3 == 0:
                names.append(rt.checkpoint(state, blocking=True).name)
            if steps == stop:
                break
        if steps == stop:
            break
    return _ended(rt, model, names=names)


def _ended(rt: ddpkit.Runtime, model: torch.nn.Module, **more: object) -> dict:
    """What a run ended at: its step, its weights, and ``more``; the run is closed."""
    found = {"step": rt.global_step, "state": {k: v.clone() for k, v in unwrap(model).state_dict().items()}, **more}
    rt.close()
    return found


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "resumes",
    [
        pytest.param(((1, 1), (2, 1)), id="onto-1"),
        pytest.param(((2, 2), (1, 2)), id="onto-2", marks=pytest.mark.slow),  # 10 s more: make test-slow
    ],
)
def test_a_loop_of_its_own_optimizer_steps_counts_them_and_resumes_bitwise_on_any_world_size(tmp_path, resumes):
    onto = resumes[0][1]
    whole = (
        _train(str(tmp_path / "whole"))
        if onto == 1
        else ddpkit.launch(_train, nprocs=2, args=(str(tmp_path / "whole"),))[0]
    )
    assert whole["step"] == 10  # 5 batches an epoch
    assert whole["names"] == [f"ckpt-step{s:08d}.pt" for s in (3, 6, 9)]
    for world, resumed_on in resumes:
        where = str(tmp_path / f"stopped-{world}-{resumed_on}")
        if world == 1:
            _train(where, stop=5)
        else:
            ddpkit.launch(_train, nprocs=2, args=(where, 5))
        found = _train(where) if resumed_on == 1 else ddpkit.launch(_train, nprocs=2, args=(where,))[0]
        assert found["step"] == 10, (world, resumed_on)
        for key, value in whole["state"].items():
            if world == resumed_on:  # from step 3, inside epoch 0, where it stopped: the same bits
                assert torch.equal(found["state"][key], value), (world, key)
            else:  # float64 rounding of another number of processes
                torch.testing.assert_close(found["state"][key], value, rtol=1e-12, atol=1e-12)


def test_a_hand_kept_grad_scaler_steps_are_counted(tmp_path):
    found = _train(str(tmp_path / "scaled"), scaler=True)
    assert found["step"] == 10 and found["names"] == [f"ckpt-step{s:08d}.pt" for s in (3, 6, 9)]


def _one_step(rt, model, optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()


def test_own_optimizer_steps_where_they_cannot_hold_are_refused_in_one_line(monkeypatch):
    rt = ddpkit.init(seed=0, precision="fp16")
    model = torch.nn.Linear(6, 3)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(UsageError, match=r"^optimizer.step\(\) under precision='fp16' steps on gradients"):
        _one_step(rt, model, optimizer)
    rt.close()

    rt = ddpkit.init(seed=0)
    model = torch.nn.Linear(6, 3)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with rt.accumulate(model, 2), pytest.raises(UsageError, match=r"^optimizer.step\(\) inside rt.accumulate"):
        _one_step(rt, model, optimizer)
    monkeypatch.setattr(rt._run, "world", FaultTolerant.__new__(FaultTolerant))
    with pytest.raises(UsageError, match=r"^optimizer.step\(\) under --fault-tolerant: a step applies only once"):
        _one_step(rt, model, optimizer)
    monkeypatch.undo()
    rt.close()


def test_rt_step_and_optimizers_outside_the_run_are_counted_once_or_not_at_all():
    rt = ddpkit.init(seed=0)
    model = torch.nn.Linear(6, 3)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    other = torch.nn.Linear(2, 2)  # not set up: a probe, a meta-learning inner loop
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    _one_step(rt, model, optimizer)
    assert rt.global_step == 1
    other(torch.randn(3, 2)).sum().backward()
    other_optimizer.step()
    assert rt.global_step == 1
    rt.backward(model(torch.randn(4, 6)).sum())
    rt.step(optimizer)  # its optimizer's own step inside is this step, not a second one
    assert rt.global_step == 2
    rt.close()
    _one_step(rt, model, optimizer)  # after rt.close the hooks are gone: torch's own step, nothing else
    assert rt.global_step == 2


def test_two_optimizers_stepped_after_one_plain_backward_are_one_step_and_a_raising_step_is_over():
    """Muon + AdamW, or a model split over two optimizers: ``a.step(); b.step()`` after one backward is
    one step of the run, as ``rt.step(a, b)`` is (it counted two, so a periodic sync met at half its period)."""
    rt = ddpkit.init(seed=0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
    model = rt.setup(model)
    first = torch.optim.SGD(unwrap(model)[0].parameters(), lr=0.1)
    second = torch.optim.AdamW(unwrap(model)[1].parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(4, 6)).sum().backward()
        first.step()
        second.step()
    assert rt.global_step == 3

    def raising() -> float:
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        first.step(raising)  # its pre-hook ran, its post-hook never will
    model(torch.randn(4, 6)).sum().backward()
    first.step()  # not taken for a step inside the one that raised
    assert rt.global_step == 4
    rt.close()


def _lbfgs() -> dict:
    """LBFGS under micro_shards: the closure runs every shard's backward, the optimizer calls it up to
    ``max_iter`` times a step; dropout draws again at each call."""
    rt = ddpkit.init(seed=0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    model, optimizer = rt.setup(model, torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4), micro_shards=2)
    data = _data()
    data = torch.utils.data.TensorDataset(data.tensors[0].float(), data.tensors[1])
    calls = 0
    for x, y in rt.loader(data, global_batch_size=32):

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            nonlocal calls
            calls += 1
            optimizer.zero_grad()
            total = torch.zeros(())
            for xs, ys in rt.shards(x, y):
                loss = F.cross_entropy(model(xs), ys)
                rt.backward(loss)
                total += loss.detach()
            return total

        optimizer.step(closure)
    return _ended(rt, model, calls=calls)


@pytest.mark.timeout(120)
def test_an_optimizer_that_takes_a_closure_is_one_step_and_keeps_micro_shards_bits():
    one = _lbfgs()
    two = ddpkit.launch(_lbfgs, nprocs=2)[0]
    assert one["step"] == two["step"] == 3  # 80 samples, 32 a step: 3 steps however often LBFGS called back
    assert one["calls"] == two["calls"] > 3
    for key, value in one["state"].items():
        assert torch.equal(two["state"][key], value), key
