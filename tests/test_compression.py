"""Gradient compression (fp16, bf16, PowerSGD) under DDP: it trains, it sends fewer bytes, and a
stopped-and-resumed PowerSGD run is bitwise equal to the uninterrupted one."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

import ddpkit
from ddpkit.parallel import auto
from ddpkit.parallel.compression import PowerSGDCompressor, check
from ddpkit.recipes.datasets import load_dataset

sys.path.insert(0, str(Path(__file__).parent))
import workers  # noqa: E402
from compression_workers import each_compression, mlp_on_digits  # noqa: E402


@pytest.mark.timeout(240)
def test_each_compression_trains_on_two_processes_and_halves_or_cuts_the_bytes():
    ranks = ddpkit.launch(each_compression, nprocs=2, args=([None, "fp16", "bf16", "powersgd"],))
    found = ranks[0]
    assert all(ranks[1][c]["digest"] == found[c]["digest"] for c in found)  # replicas stay equal
    plain = found["None"]
    steps, grad_bytes = plain["steps"], plain["grad_bytes"]
    assert plain["accuracy"] >= 0.93
    for choice in ("fp16", "bf16"):
        assert found[choice]["payload_bytes"] == steps * grad_bytes // 2, choice
        assert found[choice]["accuracy"] >= plain["accuracy"] - 0.02, choice
        assert found[choice]["digest"] != plain["digest"], choice  # the hook really ran
    sgd = found["powersgd"]
    assert sgd["iter"] == steps  # one PowerSGD iteration per step
    plain_part = 5 * grad_bytes  # powersgd_start=5 plain steps
    assert (sgd["payload_bytes"] - plain_part) * 10 < (steps - 5) * grad_bytes  # > 10x fewer bytes after
    assert sgd["accuracy"] >= 0.85  # the same class as uncompressed


@pytest.mark.timeout(240)
@pytest.mark.slow  # 30 s and more; the auto test resumes PowerSGD state bitwise in make test
@pytest.mark.parametrize("nprocs", [2, 3])
def test_powersgd_stopped_at_step_17_resumes_bitwise(tmp_path, nprocs):
    ckpt = str(tmp_path / "c.pt")
    full = ddpkit.launch(mlp_on_digits, nprocs=nprocs, args=("powersgd",))[0]
    assert ddpkit.launch(mlp_on_digits, nprocs=nprocs, args=("powersgd", "stop", ckpt))[0] == {"step": 17}
    saved = ddpkit.checkpoint.read(ckpt)["ddpkit"]["compression"]
    assert len(saved) == nprocs and all(rank[0]["iter"] == 17 and rank[0]["error"] for rank in saved)
    assert not torch.equal(saved[0][0]["error"][0], saved[1][0]["error"][0])  # each rank's own feedback
    resumed = ddpkit.launch(mlp_on_digits, nprocs=nprocs, args=("powersgd", "resume", ckpt))[0]
    assert resumed["digest"] == full["digest"] and resumed["steps"] == full["steps"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_powersgd_resumed_on_another_world_size_restarts_its_feedback_with_a_warning(tmp_path):
    ckpt = str(tmp_path / "c.pt")
    ddpkit.launch(mlp_on_digits, nprocs=2, args=("powersgd", "stop", ckpt))
    three = ddpkit.launch(mlp_on_digits, nprocs=3, args=("powersgd", "resume", ckpt))[0]
    assert any("error feedback of another world size" in w for w in three["warnings"]), three["warnings"]
    assert three["iter"] == three["steps"] > 17 and three["accuracy"] >= 0.85  # no second warm-up


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_powersgd_checkpoint_resumed_on_one_process_says_compression_is_gone(tmp_path):
    ckpt = str(tmp_path / "c.pt")
    ddpkit.launch(mlp_on_digits, nprocs=2, args=("powersgd", "stop", ckpt))
    one = mlp_on_digits(None, "resume", ckpt)
    assert any("trained with grad_compression='powersgd' and resumes without" in w for w in one["warnings"])
    assert one["steps"] == 2 * math.ceil(len(load_dataset("digits", "train").dataset) / 60)


def test_powersgd_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    made = PowerSGDCompressor(rank=2, start=3, device=torch.device("cpu"))
    made.state.iter = 9
    made.state.saved[0] = (torch.randn(10), torch.randn(4))  # feedback and factors of bucket 0
    made.state.rng.randint(1000)  # the stream has moved
    torch.save(made.state_dict(), tmp_path / "s.pt")
    loaded = PowerSGDCompressor(rank=2, start=3, device=torch.device("cpu"))
    loaded.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True), same_world=True, source="s.pt")
    assert loaded.state.iter == 9
    for got, want in zip(loaded.state.saved[0], made.state.saved[0]):
        assert torch.equal(got, want)
    assert loaded.state.rng.randint(10**9) == made.state.rng.randint(10**9)
    other_rank = PowerSGDCompressor(rank=4, start=3, device=torch.device("cpu"))
    with pytest.warns(UserWarning, match="powersgd_rank 2"):
        other_rank.load_state_dict(made.state_dict(), same_world=True, source="s.pt")
    assert other_rank.state.iter == 9 and not other_rank.state.saved
    earlier = {**made.state_dict(), "p": {}}
    del earlier["format"]  # what torch's hook left in ddpkit's checkpoints
    with pytest.warns(UserWarning, match="an earlier ddpkit's layout: it starts afresh"):
        loaded.load_state_dict(earlier, same_world=True, source="s.pt")
    assert loaded.state.iter == 9 and not loaded.state.saved


class _Bucket:
    """What DDP hands a communication hook: one flat buffer, the gradients as views into it."""

    def __init__(self, tensors):
        self.flat = torch.cat([t.reshape(-1) for t in tensors])
        self.views, at = [], 0
        for t in tensors:
            self.views.append(self.flat[at : at + t.numel()].view(t.shape))
            at += t.numel()

    def buffer(self):
        return self.flat

    def gradients(self):
        return self.views

    def index(self):
        return 0

    def is_last(self):
        return True


def _reference_step(m, q_rows, feedback):
    """PowerSGD on one matrix in a world of one, written out: (sent back, feedback, Q rows)."""
    m = m + feedback
    p_rows = q_rows @ m.t()
    for i in range(p_rows.shape[0]):
        p_rows[i] /= p_rows[i].norm()
        p_rows[i + 1 :] -= (p_rows[i + 1 :] @ p_rows[i])[:, None] * p_rows[i]
    q_rows = p_rows @ m
    sent = p_rows.t() @ q_rows
    return sent, m - sent, q_rows


def test_powersgd_sends_the_rank_r_sketch_keeps_the_rest_as_feedback_and_vectors_whole(tmp_path, monkeypatch):
    import numpy as np
    import torch.distributed as dist

    from ddpkit.parallel import powersgd
    from ddpkit.parallel.powersgd import PowerSGD

    # the algorithm on small matrices: every matrix compressed, at the rank asked
    monkeypatch.setattr(powersgd, "MIN_COMPRESSION", 2)
    monkeypatch.setattr(powersgd, "SMALL_MATRIX", 0)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    torch.manual_seed(0)
    sgd = PowerSGD(rank=2, start=0, device=torch.device("cpu"))
    sgd.group = dist.new_group()
    seed = np.random.RandomState(0).randint(1_000_000_000)  # the stream's first draw
    q_rows = torch.randn(2 * 40, generator=torch.Generator().manual_seed(int(seed))).view(2, 40)
    feedback = torch.zeros(30, 40)
    for step in range(3):
        weight, bias, zero = torch.randn(30, 40), torch.randn(30), torch.zeros(20, 40)
        bucket = _Bucket([weight, bias, zero])
        out = sgd.hook(bucket).wait()
        assert out is bucket.flat
        sent, feedback, q_rows = _reference_step(weight, q_rows, feedback)
        assert torch.allclose(bucket.views[0], sent, atol=1e-5), step
        assert torch.linalg.matrix_rank(bucket.views[0]) == 2
        assert torch.equal(bucket.views[1], bias)  # vectors travel whole
        assert torch.equal(bucket.views[2], zero)  # a zero gradient stays zero, no NaN
        assert torch.allclose(sgd.buckets[0].error[:1200].view(30, 40), feedback, atol=1e-5), step
    assert sgd.iter == 3
    assert sgd.payload_elements == 3 * (2 * (30 + 40) + 2 * (20 + 40) + 30)  # factors and the bias


def test_which_matrices_powersgd_compresses_and_at_what_rank():
    from ddpkit.parallel.powersgd import _is_matrix, matrix_rank, payload_elements
    from ddpkit.recipes.models import build_model

    small, large = torch.Size([512, 64]), torch.Size([512, 256, 3, 3])
    assert matrix_rank(large, 2) == 2
    assert not _is_matrix(small, 2)  # under 64K elements: whole, however small its factors would be
    assert _is_matrix(large, 2) and _is_matrix(torch.Size([256, 256]), 2) and not _is_matrix(torch.Size([256]), 2)
    assert not _is_matrix(torch.Size([16384, 4]), 2)  # factors of rank 2 would be half of it: sent whole
    convnet = build_model("convnet", num_classes=10, in_channels=1, image_size=8)
    shapes = [p.shape for p in convnet.parameters()]
    assert payload_elements(shapes, 2) == sum(s.numel() for s in shapes)  # the digits ConvNet: nothing worth it
    resnet = [p.shape for p in build_model("resnet18", num_classes=10, in_channels=3, image_size=32).parameters()]
    sent = 4 * payload_elements(resnet, 2)
    assert 1.10e6 < sent < 1.12e6  # of 44.7 MB: ResNet-18 at ~1/40


def test_powersgd_hands_an_error_in_its_callbacks_to_the_backward_pass(tmp_path, monkeypatch):
    import torch.distributed as dist

    from ddpkit.parallel import powersgd

    monkeypatch.setattr(powersgd, "MIN_COMPRESSION", 2)  # the 30 x 40 matrix is compressed
    monkeypatch.setattr(powersgd, "SMALL_MATRIX", 0)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    sgd = powersgd.PowerSGD(rank=2, start=0, device=torch.device("cpu"))
    sgd.group = dist.new_group()

    def broken(p):
        raise ValueError("orthogonalisation failed")

    monkeypatch.setattr(powersgd, "_orthonormal_rows", broken)
    future = sgd.hook(_Bucket([torch.randn(30, 40)]))  # run on the backend's thread: no hang
    with pytest.raises(ValueError, match="orthogonalisation failed"):
        future.wait()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"choice": "int8"}, "unknown grad_compression 'int8'; choose none, fp16, bf16, powersgd, auto"),
        ({"choice": "powersgd", "rank": 0}, "powersgd_rank must be a whole number of at least 1"),
        ({"choice": "powersgd", "start": 1}, "powersgd_start must be at least 2"),
        ({"choice": "powersgd", "precision": "fp16"}, "use precision='bf16', or grad_compression='fp16'"),
        ({"choice": "fp16", "compile": True}, "grad_compression with compile=True is not supported yet"),
    ],
)
def test_bad_choices_are_one_line_errors(kwargs, message):
    args = {
        "choice": None,
        "rank": 2,
        "start": None,
        "backend": "gloo",
        "device": torch.device("cpu"),
        "precision": "fp32",
        "compile": False,
        **kwargs,
    }
    with pytest.raises(ddpkit.UsageError) as caught:
        check(args.pop("choice"), **args)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_setup_refuses_a_bad_choice_and_warns_that_one_process_sends_nothing():
    rt = ddpkit.init()
    with pytest.raises(ddpkit.UsageError, match="unknown grad_compression"):
        rt.setup(torch.nn.Linear(2, 2), grad_compression="topk")
    with pytest.warns(UserWarning, match="has no effect with one process"):
        rt.setup(torch.nn.Linear(2, 2), grad_compression="powersgd")
    with pytest.raises(ddpkit.UsageError, match="compile=True is not supported yet"):
        rt.setup(torch.compile(torch.nn.Linear(2, 2)), grad_compression="fp16")  # compiled before setup
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rt.setup(torch.nn.Linear(2, 2))


@pytest.mark.slow  # 8 s: make test-slow; make test keeps each compression on two processes
@pytest.mark.timeout(180)
def test_auto_measures_then_chooses_none_on_loopback_the_same_on_every_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    runs = ddpkit.launch(workers.auto_compression, nprocs=2, args=(8,))
    first, second = runs[0]["decision"], runs[1]["decision"]
    assert first == second and runs[0]["decided_at"] == 6  # 5 timed plain steps, then the choice
    # the probe may see no difference between a one-element call and the gradients' bytes on a fast
    # loopback (None: the link counts as free, so only the calls' latency separates the choices)
    assert first["link_bytes_per_s"] is None or first["link_bytes_per_s"] > 0
    assert first["step_s"] > 0 and first["latency_s"] > 0
    assert set(first["predicted_step_s"]) == {"none", "bf16", "powersgd"}
    # the choice follows from its own measurements (which compression wins on loopback depends on
    # how busy the machine is: BENCHMARKS.md records what it chose on an idle one)
    best = min(("bf16", "powersgd"), key=first["predicted_step_s"].get)
    gain = first["step_s"] / first["predicted_step_s"][best]
    assert first["choice"] == (best if gain >= auto.MIN_GAIN else "none")
    # a resumed run keeps the saved decision (it has one from its first step: deciding anew would
    # take 5 timed steps more) and ends bitwise where the uninterrupted one does; both decide none
    (tmp_path / "ckpt").mkdir()
    never = float("inf")
    stopped = ddpkit.launch(workers.auto_compression, nprocs=2, args=(10, str(tmp_path / "ckpt"), 7, never))
    resumed = ddpkit.launch(workers.auto_compression, nprocs=2, args=(10, str(tmp_path / "ckpt")))
    whole = ddpkit.launch(workers.auto_compression, nprocs=2, args=(10, None, None, never))
    assert resumed[0]["decided_at"] == 8 and resumed[0]["decision"] == stopped[0]["decision"]
    assert whole[0]["decision"]["choice"] == "none"
    assert all(torch.equal(a, b) for a, b in zip(resumed[0]["weights"], whole[0]["weights"]))


def test_auto_chooses_what_predicts_the_shortest_step(monkeypatch):
    """The choice from recorded numbers: a 100 Mbit/s link and a 45 MB model take PowerSGD; loopback none."""
    from ddpkit.parallel import auto

    class Fake(auto.AutoCompressor):
        def __init__(self, link, step):  # no link timing: the numbers are given
            self.grad_bytes, self.powersgd_bytes = 44_726_568, 330_000
            self.latency_s, self.link_bytes_per_s = 0.0003, link
            self.model, self.make, self.chosen, self.decision = None, lambda c: None, None, None
            self.step_ends = [i * step for i in range(auto.MEASURE_STEPS + 1)]

    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None: t)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(auto, "_buckets", lambda model: 3)
    slow = Fake(11.4e6, 4.05)  # the recorded 100 Mbit/s row: 4 s a step
    slow._decide()
    assert slow.decision["choice"] == "powersgd"
    assert slow.decision["predicted_step_s"]["powersgd"] < 0.2 < 2.0 < slow.decision["predicted_step_s"]["bf16"]
    fast = Fake(2.0e9, 0.3)  # loopback: 45 MB in 22 ms of a 300 ms step
    fast._decide()
    assert fast.decision["choice"] == "none"
