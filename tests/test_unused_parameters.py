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
model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
for x, y in rt.loader(data, global_batch_size=16):   # torch's own backward and step, not rt's
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
rt.close()
"""


@pytest.mark.timeout(180)
def test_torchs_error_at_the_next_forward_is_one_line_with_the_parameters_names(tmp_path):
    """A loop of torch's own loss.backward() and optimizer.step() never reaches rt.step: torch stops the
    second forward, and its traceback (which counts the parameters in the reducer's order) becomes one line."""
    script = tmp_path / "plain_loop.py"
    script.write_text(textwrap.dedent(PLAIN_LOOP))
    done = run_ddpkit("run", "-n", "2", str(script), timeout=150)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "ddpkit: error:" in line]
    assert lines, done.stderr[-3000:]
    for line in lines:
        assert "4 trainable parameters of the model got no gradient in the previous step" in line, line
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
