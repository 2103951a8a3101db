"""A trainable parameter the loss does not use: one process never notices, DDP stops at the next
forward with torch's traceback. ddpkit names the parameters, in one line, at the first step."""

from __future__ import annotations

import textwrap

import pytest
import torch

import ddpkit
import workers
from ddpkit.errors import UsageError
from helpers import ddpkit as run_ddpkit

REFUSAL = "2 trainable parameters of the model got no gradient in this step (head.weight, head.bias)"


@pytest.mark.timeout(120)
def test_a_head_the_loss_never_uses_is_named_at_the_first_step_under_ddp():
    runs = ddpkit.launch(workers.unused_head, nprocs=2)
    for rank, found in runs.items():
        assert found["steps"] == 0, (rank, found)  # refused before the optimizer took the step
        kind, message = found["error"]
        assert kind == "UsageError" and REFUSAL in message, (rank, message)
        assert "requires_grad_(False)" in message and "find_unused_parameters=True" in message, message
        assert "use_reentrant=False" in message, message  # torch's reentrant checkpoint leaves layers without one
    one = workers.unused_head()  # one process: nothing waits for the head, and nothing is refused
    assert one["steps"] == 4 and one["error"] is None, one


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fix", [(True, False), (False, True)], ids=["frozen", "find_unused_parameters"])
def test_each_fix_the_refusal_names_trains_to_the_end_as_one_process_does(fix):
    runs = ddpkit.launch(workers.unused_head, nprocs=2, args=fix)
    one = workers.unused_head(*fix)
    for rank, found in runs.items():
        assert found["steps"] == 4 and found["error"] is None, (rank, found)
        for name, value in one["body"].items():
            torch.testing.assert_close(found["body"][name], value, rtol=1e-6, atol=1e-7)


PLAIN_LOOP = """
import torch, torch.nn.functional as F
import ddpkit

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 2)
        self.b = torch.nn.Linear(8, 2)
        self.c = torch.nn.Linear(8, 2)
    def forward(self, x):
        return self.b(x)

rt = ddpkit.init(seed=0)
model = Net()
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for x, y in rt.loader(data, global_batch_size=16):   # torch's own backward and step, not rt's
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
rt.close()
"""


@pytest.mark.slow  # make test-slow: make test keeps the core of this family (its 15 minutes)
@pytest.mark.timeout(180)
def test_a_loop_of_its_own_optimizer_step_gets_the_same_line_at_its_step(tmp_path):
    """A loop of torch's own loss.backward() and optimizer.step(): its step is the run's too
    (steps.watch_direct_steps), so the parameters are named there, before the optimizer steps on
    gradients that were never exchanged, as at rt.step (before, torch stopped the second forward, and
    its traceback became one line)."""
    script = tmp_path / "plain_loop.py"
    script.write_text(textwrap.dedent(PLAIN_LOOP))
    done = run_ddpkit("run", "-n", "2", str(script), timeout=150)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "ddpkit: error:" in line]
    assert lines, done.stderr[-3000:]
    for line in lines:
        assert "4 trainable parameters of the model got no gradient in this step" in line, line
        assert "(a.weight, a.bias, c.weight, c.bias)" in line, line  # registration order, not the reducer's
    assert "Traceback" not in done.stderr and "Expected to have finished reduction" not in done.stderr


def test_rt_setups_keywords_are_ddpkits_or_ddps_and_anything_else_is_one_line():
    rt = ddpkit.init()
    try:
        model = torch.nn.Linear(2, 2)
        with pytest.raises(
            UsageError, match=r"unknown keyword 'find_unsued_parameters' \(did you mean 'find_unused_parameters'\?\)"
        ):
            rt.setup(model, find_unsued_parameters=True)  # one process: before, silently ignored
        with pytest.raises(
            UsageError, match=r"as its own keywords: rt.setup\(model, optimizer, find_unused_parameters=True\)"
        ):
            rt.setup(model, ddp_kwargs={"find_unused_parameters": True})
        with pytest.raises(UsageError, match="device_ids is ddpkit's to set"):
            rt.setup(model, device_ids=[0])
        with pytest.raises(UsageError, match="did you mean 'micro_shards'"):
            rt.setup(model, micro_shard=2)
        assert rt.setup(model, bucket_cap_mb=1, find_unused_parameters=True) is not None  # DDP's own pass
    finally:
        rt.close()


@pytest.mark.timeout(120)
def test_a_gan_and_two_optimizers_after_one_backward_are_never_refused():
    """The refusal asks DDP's reducer whether the last backward finished its exchange: D's step after a
    backward that never reached G, and a second optimizer after the same backward, pass."""
    runs = ddpkit.launch(workers.gan_and_split_optimizers, nprocs=2)
    assert runs[0]["steps"] == runs[1]["steps"] == 12  # 4 batches, three steps each
    for name, weights in runs[0]["weights"].items():
        assert torch.equal(weights, runs[1]["weights"][name]), name  # DDP kept the ranks equal


@pytest.mark.timeout(120)
def test_under_micro_shards_a_parameter_without_a_gradient_is_left_out_of_the_sum_at_the_same_bits():
    runs = ddpkit.launch(workers.unused_head, nprocs=2, args=(False, False, 2))
    one = workers.unused_head(False, False, 2)
    assert one["steps"] == 4 and one["error"] is None, one
    for rank, found in runs.items():
        assert found["steps"] == 4 and found["error"] is None, (rank, found)
        for name, value in one["body"].items():
            assert torch.equal(found["body"][name], value), (rank, name)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "setup, accumulate",
    [
        ({}, 1),
        pytest.param({}, 2, marks=pytest.mark.slow),
        pytest.param({"micro_shards": 2}, 1, marks=pytest.mark.slow),
    ],
)
def test_a_layer_unfrozen_after_setup_trains_on_the_average_of_its_gradients(setup, accumulate):
    """Gradual unfreezing: DDP builds its buckets from the parameters that train at rt.setup, so a layer
    unfrozen later stepped on each rank's own gradients (float64, 2 processes ended 8e-3 from one;
    micro-shards, which promises the same bits, 6e-3). DDP's run now averages them after each backward
    that exchanges (said once), micro-shards sums them along its tree: one process's result."""
    one = ddpkit.launch(workers.unfreezing, nprocs=1, args=(setup, accumulate))[0]
    two = ddpkit.launch(workers.unfreezing, nprocs=2, args=(setup, accumulate))[0]
    furthest = max(float((one["weights"][k] - two["weights"][k]).abs().max()) for k in one["weights"])
    if setup.get("micro_shards"):
        assert furthest == 0.0
    else:
        assert furthest < 1e-12
        assert len(two["warned"]) == 1
        assert two["warned"][0].startswith("DDP's buckets leave out what was frozen at rt.setup (0.weight, 0.bias)")
    assert one["warned"] == []  # one process: nothing left out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("setup", [{}, pytest.param({"micro_shards": 2}, marks=pytest.mark.slow)])
def test_a_parameter_of_the_optimizers_outside_the_model_is_averaged_as_the_models_are(setup):
    """Learned loss weights (multi-task uncertainty weighting): a parameter the optimizer holds but the
    model does not. DDP never saw it, so each rank stepped on its own gradient: the ranks' weights
    parted (2.4e-2 after 8 steps) and rank 0 ended 1.2e-2 from one process. DDP's run now averages
    it after each backward (said once); micro-shards summed it along its tree already."""
    one = ddpkit.launch(workers.loss_weights, nprocs=1, args=(setup,))[0]
    two = ddpkit.launch(workers.loss_weights, nprocs=2, args=(setup,))[0]
    assert torch.equal(two["log_vars"][0], two["log_vars"][1])
    furthest = max(float((one["weights"][k] - two["weights"][k]).abs().max()) for k in one["weights"])
    assert furthest == 0.0 if setup else furthest < 1e-12


@pytest.mark.timeout(240)
@pytest.mark.parametrize("setup", [{}, pytest.param({"micro_shards": 2}, marks=pytest.mark.slow)])
def test_a_parameter_outside_the_model_in_an_optimizer_of_its_own_is_exchanged_when_given_to_setup(setup):
    """The learned loss weights in an optimizer of their own, stepped by rt.step(optimizer, its_own):
    nothing exchanged their gradients, so the ranks' weights parted and 2 processes ended away from one
    (under micro_shards too), silently. Given to rt.setup(model, optimizer, its_own) they are exchanged as
    the first optimizer's are (one process's bits under micro_shards); not given, the step is refused
    in one line on one process as on two."""
    grouped = workers.loss_weights(setup)  # one process, one optimizer of two groups: the same SGD
    one = workers.loss_weights(setup, "given")
    two = ddpkit.launch(workers.loss_weights, nprocs=2, args=(setup, "given"))[0]
    assert all(torch.equal(one["weights"][k], grouped["weights"][k]) for k in grouped["weights"])
    assert torch.equal(two["log_vars"][0], two["log_vars"][1])
    furthest = max(float((one["weights"][k] - two["weights"][k]).abs().max()) for k in one["weights"])
    assert furthest == 0.0 if setup else furthest < 1e-12
    refusals = [workers.loss_weights(setup, "not")]
    if not setup:  # (the check is the run's, not the mode's: once on two processes)
        refusals.append(ddpkit.launch(workers.loss_weights, nprocs=2, args=(setup, "not"))[0])
    for said in refusals:
        refused = said["refused"]
        assert refused.startswith(
            "rt.step: an optimizer not given to rt.setup holds 1 parameter(s) outside the set-up models (of shapes [2])"
        )
        assert refused.endswith("rt.setup(model, optimizer, this_optimizer)") and "\n" not in refused


def test_under_a_quorums_average_of_every_stepped_parameter_an_optimizer_not_given_is_not_refused(monkeypatch):
    """A fault-tolerant replica's commit averages every parameter rt.step's optimizers hold (micro-shards
    aside), so a learned temperature's optimizer of its own was exchanged there: not refused."""
    from ddpkit.parallel import modes, replica

    fault_tolerant = replica.FaultTolerant.__new__(replica.FaultTolerant)
    fault_tolerant.micro_shards = False
    assert fault_tolerant.exchanges_every_stepped()
    fault_tolerant.micro_shards = True
    assert not fault_tolerant.exchanges_every_stepped()
    monkeypatch.setattr(modes.ProcessGroup, "exchanges_every_stepped", lambda self: True)
    rt = ddpkit.init(seed=0)
    try:
        model = torch.nn.Linear(4, 2)
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        scale = torch.nn.Parameter(torch.ones(()))
        own = torch.optim.SGD([scale], lr=0.1)
        rt.backward((model(torch.randn(3, 4)) * scale).sum())
        assert rt.step(optimizer, own) and rt.global_step == 1
    finally:
        rt.close()


def test_more_optimizers_given_to_setup_come_back_in_order_and_what_cannot_take_them_is_one_line():
    """rt.setup(model, head, body) returns them in order (torch's TypeError before); an infrequent sync,
    which keeps one inner optimizer's state per rank, refuses a second in one line, as it does what is
    not an optimizer."""
    rt = ddpkit.init(seed=0)
    try:
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        head, body = torch.optim.SGD(net[1].parameters(), lr=0.1), torch.optim.Adam(net[0].parameters())
        model, *given = rt.setup(net, head, body)
        assert given == [head, body] and rt._run.given == [head, body]
        other = torch.nn.Linear(4, 2)
        with pytest.raises(UsageError, match=r"^rt.setup: str after the model's optimizer is not an optimizer$"):
            rt.setup(other, torch.optim.SGD(other.parameters(), lr=0.1), "body")
        apart = torch.nn.Linear(4, 2)
        optimizers = [torch.optim.SGD(apart.parameters(), lr=0.1), torch.optim.SGD(apart.parameters(), lr=0.1)]
        with pytest.raises(UsageError) as refused:
            rt.setup(apart, *optimizers, sync="local-sgd", sync_every=2)
        assert str(refused.value).startswith("rt.setup(model, optimizer, ..., sync='local-sgd') takes one optimizer")
        assert len(rt._run.entries) == 1  # refused before anything was set up
    finally:
        rt.close()


@pytest.mark.parametrize("sync", ["local-sgd", "diloco"])
def test_an_infrequent_sync_refuses_an_optimizer_holding_parameters_outside_the_model(sync):
    """Local SGD and DiLoCo meet over the model's parameters: one of the optimizer's outside it would
    train apart on each rank for good (the ranks' loss weights 2.6e-2 apart). Refused in one line."""
    with pytest.raises(UsageError) as refused:
        workers.loss_weights({"sync": sync, "sync_every": 2})
    ddpkit.current().close()
    said = str(refused.value)
    assert said.startswith(f"sync={sync!r}: the optimizer holds 1 parameter(s) outside the model (of shape (2,))")
    assert "\n" not in said
