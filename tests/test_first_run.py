"""The scripts people already have, and the first run: the loops of pytorch/examples and nanoGPT.

What broke when such scripts were ported (issue 41), each in the loop people write: a model that
``.view()``s its micro-shard, a language model's evaluation, ``loss.backward()`` left in place,
reading ``rt.save``'s file with ``torch.load``, random data drawn after ``rt.setup``, torchrun's
flags, a restart after the last epoch, epochs counted from 1.
"""

from __future__ import annotations

import math
import subprocess
import textwrap

import pytest
import torch
import torch.nn.functional as F

import ddpkit
import first_run_workers as frw
from helpers import BIN, clean_env, master_port


# -- micro-shards: the same tensors on every world size -----------------------------------------------
class Flattens(torch.nn.Module):
    """nanoGPT's habit: ``.view()`` on its inputs and on the targets."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.linear(x.view(x.size(0), -1)), y.view(-1))


def test_a_model_that_views_its_micro_shard_runs_on_one_process():
    rt = ddpkit.init(seed=0)
    model = Flattens()
    data = torch.utils.data.TensorDataset(torch.randn(8, 2, 3), torch.randint(0, 3, (8, 1)))
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_shards=2)
    for x, y in rt.loader(data, global_batch_size=4):
        for xs, ys in rt.shards(x, y):
            assert xs.is_contiguous() and ys.is_contiguous()
            rt.backward(model(xs, ys))
        rt.step(optimizer)
    assert rt.global_step == 2
    rt.close()


# -- a language model's evaluation ------------------------------------------------------------------------
def _reference() -> dict:
    """Per token, by hand, in one process: every target that is not -100 once."""
    torch.manual_seed(0)
    model = frw.TinyLM()
    data = frw.token_data()
    with torch.no_grad():
        logits = model(data.tensors[0])
    targets = data.tensors[1]
    kept = targets != -100
    loss = F.cross_entropy(logits[kept].double(), targets[kept], reduction="sum")
    return {
        "count": int(kept.sum()),
        "correct": int((logits.argmax(-1)[kept] == targets[kept]).sum()),
        "loss": float(loss) / int(kept.sum()),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_a_language_models_loss_and_accuracy_count_every_token_once(world):
    reference = _reference()
    assert reference["count"] < frw.SAMPLES * frw.LENGTH  # padding is left out
    for last, first in ddpkit.launch(frw.sequence_metrics, nprocs=world).values():
        for metrics in (last, first):
            assert metrics["count"] == reference["count"] and metrics["correct"] == reference["correct"]
            assert math.isclose(metrics["loss"], reference["loss"], rel_tol=1e-6)
            assert sum(map(sum, metrics["confusion"])) == reference["count"]


def test_targets_that_do_not_fit_the_outputs_are_one_line():
    from ddpkit.errors import UsageError

    ddpkit.init(seed=0)
    model = frw.TinyLM()
    data = frw.token_data()
    with pytest.raises(UsageError, match=r"pass class_dim=-1") as said:
        ddpkit.evaluate(model, data, num_classes=frw.VOCAB)  # (B, T, V) read as (B, C, T)
    assert "\n" not in str(said.value)
    labels = torch.utils.data.TensorDataset(torch.randn(4, 3), torch.tensor([0, 1, 7, 1]))
    with pytest.raises(UsageError, match="a target is 7, outside 0 to num_classes - 1"):
        ddpkit.evaluate(torch.nn.Linear(3, 3), labels, num_classes=3)
    with pytest.raises(UsageError, match="class_dim"):
        ddpkit.evaluate(torch.nn.Linear(3, 3), labels, num_classes=3, class_dim=2)


def test_predict_keeps_sequence_outputs_in_order():
    ddpkit.init(seed=0)
    torch.manual_seed(0)
    model = frw.TinyLM()
    data = frw.token_data()
    out = ddpkit.predict(model, data, batch_size=4, to="all")
    tokens = data.tensors[0]
    with torch.no_grad():  # batch by batch as predict ran: a CPU's kernels may round other batch sizes apart
        assert torch.equal(out, torch.cat([model(tokens[i : i + 4]) for i in range(0, len(tokens), 4)]))


# -- loss.backward() left in place ------------------------------------------------------------------------
@pytest.mark.slow  # 6 s: make test-slow
@pytest.mark.timeout(120)
def test_loss_backward_in_place_of_rt_backward_is_said_once_at_the_step_it_changes():
    plain = ddpkit.launch(frw.plain_backward, nprocs=2, args=(False,))
    said = plain[0][0]
    assert len(said) == 1 and said[0].startswith(
        "rt.step: this step's gradients came from loss.backward(), "
        "not rt.backward(loss); this rank holds 2 of the batch's 3 samples"
    )
    assert plain[1][0] == []  # rank 0 says it, once
    weighted = ddpkit.launch(frw.plain_backward, nprocs=2, args=(True,))
    assert weighted[0][0] == [] and weighted[1][0] == []
    single = ddpkit.launch(frw.plain_backward, nprocs=1, args=(True,))[0][1]
    assert max(float((weighted[0][1][k] - single[k]).abs().max()) for k in single) <= 1e-6
    assert max(float((plain[0][1][k] - single[k]).abs().max()) for k in single) > 1e-6  # what the line warns of


def test_on_one_process_loss_backward_is_exact_and_nothing_is_said():
    said, _ = frw.plain_backward(False)
    assert said == []


# -- rt.save read the way people read checkpoints -----------------------------------------------------------
def test_what_rt_save_writes_reads_back_with_torch_load(tmp_path):
    rt = ddpkit.init(seed=0)
    model = torch.nn.Linear(3, 2)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    path = rt.save(  # read right after: written before it returns
        tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer, "epoch": 4, "user": "mine"}, blocking=True
    )
    loaded = torch.load(path, weights_only=True)  # imagenet's --resume, nanoGPT's sample.py
    fresh = torch.nn.Linear(3, 2)
    fresh.load_state_dict(loaded["model"])
    assert torch.equal(fresh.weight, model.weight) and loaded["epoch"] == 4
    torch.optim.SGD(fresh.parameters(), lr=0.1).load_state_dict(loaded["optimizer"])
    assert loaded["user"]["user"] == "mine"  # a user key named as ddpkit's own stays inside
    weights = rt.save(tmp_path / "mnist_cnn.pt", model)  # MNIST's torch.save(model.state_dict(), ...)
    again = torch.nn.Linear(3, 2)
    again.load_state_dict(torch.load(weights, weights_only=True))
    assert torch.equal(again.bias, model.bias) and weights.with_name(weights.name + ".sha256").exists()
    other = torch.nn.Linear(3, 2)
    rt.load(weights, other)  # and back through ddpkit, weights alone
    assert torch.equal(other.weight, model.weight)
    third = torch.nn.Linear(3, 2)
    rt.load(path, third)  # a checkpoint's "model" entry
    assert torch.equal(third.weight, model.weight)
    with pytest.raises(ddpkit.UsageError, match="writes one file of weights"):
        rt.save(tmp_path, model)
    rt.close()


# -- random data after setup --------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_draws_are_equal_before_setup_and_per_rank_after_it_as_init_says():
    ranks = ddpkit.launch(frw.random_around_setup, nprocs=2)
    (before0, after0), (before1, after1) = ranks[0], ranks[1]
    assert torch.equal(before0, before1) and not torch.equal(after0, after1)
    assert "drawn before ``rt.setup``" in ddpkit.init.__doc__


# -- epochs ----------------------------------------------------------------------------------------------
def test_epochs_count_from_start_and_a_restart_after_the_last_one_says_why_nothing_runs(tmp_path):
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,)))
    rt = ddpkit.init(seed=0, checkpoint_dir=tmp_path, resume="auto")
    model = torch.nn.Linear(3, 2)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = rt.loader(data, global_batch_size=4)
    state = {"model": model, "optimizer": optimizer}
    seen = []
    for epoch in rt.epochs(3, start=1):  # range(1, 4), as scripts counting from 1 write it
        seen.append(epoch)
        for x, y in loader:
            rt.backward(F.cross_entropy(model(x), y))
            rt.step(optimizer)
        rt.checkpoint(state)  # the last one: after the final epoch
    rt.close()
    assert seen == [1, 2, 3]
    rt = ddpkit.init(seed=0, checkpoint_dir=tmp_path, resume="auto")  # a worker died at exit
    model = torch.nn.Linear(3, 2)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rt.loader(data, global_batch_size=4)
    rt.resume({"model": model, "optimizer": optimizer})
    with pytest.warns(UserWarning, match=r"rt.epochs\(3\): the run resumed from .* had trained all 3 epochs"):
        assert list(rt.epochs(3, start=1)) == []
    rt.close()


# -- torchrun's flags -----------------------------------------------------------------------------------------
def test_torchruns_remaining_flags_are_passed_on_and_a_node_rank_without_nodes_is_refused():
    from ddpkit.cli.run import spec_of
    from ddpkit.distributed.torchrun import torchrun_args

    spec = spec_of(["--local-ranks-filter", "0", "--monitor_interval=2", "--role", "trainer", "-n", "2", "t.py"])
    args = torchrun_args(spec, store_dir="/tmp/x")
    assert {"--local-ranks-filter=0", "--monitor-interval=2", "--role=trainer"} <= set(args)
    with pytest.raises(ddpkit.UsageError, match="--node-rank 1 with one node"):
        torchrun_args(spec_of(["--node_rank", "1", "-n", "2", "t.py"]), store_dir="/tmp/x")


_PROBE = """
import os
print("MASTER", os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], flush=True)
"""


@pytest.mark.timeout(120)
def test_a_one_node_job_gives_the_master_asked_and_says_when_no_process_joined(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(_PROBE))
    port = master_port()
    done = subprocess.run(
        [
            str(BIN / "ddpkit"),
            "run",
            "-n",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            "--local-ranks-filter",
            "0",
            str(script),
        ],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=100,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(f"MASTER 127.0.0.1 {port}") == 1, done.stdout  # rank 0's output alone
    warned = [line for line in done.stderr.splitlines() if "joined a process group" in line]
    assert warned == [
        "ddpkit run: warning: none of the 2 processes joined a process group, so each ran the whole "
        "script on its own; call ddpkit.init() (or torch.distributed.init_process_group()) in the "
        "script, or run it with -n 1"
    ], done.stderr[-2000:]


@pytest.mark.parametrize("flag", ["--min-replicas=2", "--secret-file=x", "--quorum-timeout=5"])
def test_fault_tolerant_flags_without_fault_tolerance_are_one_line(capsys, flag):
    from ddpkit import cli

    assert cli.main(["run", flag, "-n", "1", "x.py"]) == 2  # (in this process)
    stderr = capsys.readouterr().err
    assert stderr.strip().count("\n") == 0
    assert "is for fault-tolerant jobs: add --fault-tolerant" in stderr
