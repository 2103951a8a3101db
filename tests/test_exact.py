"""``rt.setup(micro_shards=M)``: the same bits on 1, 2 and 4 processes, and the loops that break it refused.

The property is exactness, so the multi-process tests compare with ``torch.equal``: one process
and DDP x2 (and x4, slow) end at the same parameters, BatchNorm running statistics, sample
counts and dropout draws; a run stopped on two processes and resumed on one ends where the
uninterrupted one-process run ends.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import ddpkit
import workers
from ddpkit.errors import UsageError
from ddpkit.parallel import exact_exchange, exact_tree


def _same(a: dict, b: dict) -> list[str]:
    """Names of the tensors that differ in any bit."""
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


# -- the tree ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shards,world", [(8, 2), (8, 4), (6, 2), (4, 4), (2, 2)])
def test_ranks_partial_sums_complete_the_single_process_tree_bit_for_bit(shards, world):
    g = torch.Generator().manual_seed(shards * 10 + world)
    leaves = [
        torch.randn(1000, generator=g) * 10 ** torch.randint(-3, 4, (1,), generator=g).item() for _ in range(shards)
    ]
    whole = exact_tree.tree_sum(leaves)
    partials = [exact_tree.tree_sum(leaves[r::world]) for r in range(world)]
    assert torch.equal(exact_tree.tree_sum(partials), whole)
    # and the order matters: a left-to-right sum is another float (else the test proves nothing)
    assert not torch.equal(sum(leaves[1:], leaves[0]), whole) or shards == 2


def test_tree_sum_skips_empty_leaves():
    assert exact_tree.tree_sum([None, None]) is None
    assert exact_tree.tree_sum([1.0, None, 2.0, None]) == 3.0


# -- one process ---------------------------------------------------------------------------------------


def _bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _data(n: int = 40) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def test_one_process_step_is_the_batch_mean_gradient_and_the_shards_running_statistics():
    """M=2 on one process: the gradient of the batch's mean loss (each shard normalised on its own)
    and the running statistics two plain forwards of the shards would leave."""
    threads = torch.get_num_threads()
    rt = ddpkit.init(seed=0)
    try:
        net = _bn_net()
        plain = _bn_net()
        net, opt = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.0), micro_shards=2)
        loader = rt.loader(_data(), global_batch_size=10)
        x, y = next(iter(loader))
        losses = []
        for xs, ys in rt.shards(x, y):
            loss = F.cross_entropy(net(xs), ys)
            losses.append(loss * len(ys) / len(y))
            rt.backward(loss)
        seen = []
        opt.register_step_pre_hook(lambda *_: seen.extend(p.grad.clone() for p in net.parameters()))
        rt.step(opt)
        expected = sum(F.cross_entropy(plain(x[j::2]), y[j::2]) * len(y[j::2]) / len(y) for j in range(2))
        expected.backward()
        assert len(seen) == 6  # two Linear layers and the BatchNorm, weight and bias each
        for mine, theirs in zip(seen, plain.parameters()):
            assert torch.allclose(mine, theirs.grad, rtol=1e-5, atol=1e-7)
        bn, plain_bn = net[1], plain[1]
        assert int(bn.num_batches_tracked) == 2 == int(plain_bn.num_batches_tracked)
        assert torch.allclose(bn.running_mean, plain_bn.running_mean, rtol=1e-6, atol=1e-7)
        assert torch.allclose(bn.running_var, plain_bn.running_var, rtol=1e-6, atol=1e-7)
        assert not torch.equal(bn.running_mean, torch.zeros(8))
        assert torch.get_num_threads() == exact_tree.threads_for(2)
    finally:
        rt.close()
    assert torch.get_num_threads() == threads  # rt.close gives the process its own count back


def _drop_batch(rt) -> None:
    """Forget a refused batch's shards (what a script cannot do: its run ends at the error)."""
    exact = next(m for m in rt._run.modes if m.name == "micro-shards").exact
    exact._forget_step()


def test_loops_that_would_break_exactness_are_refused_in_one_line():
    rt = ddpkit.init(seed=0)
    try:
        net, opt = rt.setup(_bn_net(), None, micro_shards=2), None
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        loader = rt.loader(_data(), global_batch_size=10)
        batches = iter(loader)
        x, y = next(batches)
        with pytest.raises(UsageError, match="inside `for shard in rt.shards"):
            net(x)  # a training forward outside the shards
        with pytest.raises(UsageError, match="rt.backward inside"):
            rt.backward(F.cross_entropy(_bn_net().eval()(x), y))
        shards = rt.shards(x, y)
        xs, ys = next(shards)
        rt.backward(F.cross_entropy(net(xs), ys))
        with pytest.raises(UsageError, match="before every shard"):
            rt.step(opt)  # `break` after the first shard
        shards.close()
        with pytest.raises(UsageError, match="previous batch were not stepped"):
            next(rt.shards(x, y))
        _drop_batch(rt)
        with pytest.raises(UsageError, match="without rt.backward"):
            for _ in rt.shards(x, y):
                pass
        _drop_batch(rt)
        for xs, ys in rt.shards(x, y):
            loss = F.cross_entropy(net(xs), ys)
            rt.backward(loss)
            with pytest.raises(UsageError, match="twice on one shard"):
                rt.backward(F.cross_entropy(net[3](torch.relu(net[0](xs).detach())), ys))
        assert rt.step(opt)
        with rt.accumulate(net, 2):  # a group's first batch, whose second shard never runs
            shards = rt.shards(x, y)
            xs, ys = next(shards)
            rt.backward(F.cross_entropy(net(xs), ys))
            shards.close()
        with rt.accumulate(net, 2), pytest.raises(UsageError, match="before every shard of the previous one"):
            rt.shards(x, y)
        _drop_batch(rt)
        with pytest.raises(UsageError, match="built for one model"):
            rt.setup(_bn_net(), micro_shards=2)
        net.eval()
        net(x)  # evaluation forwards are free
    finally:
        rt.close()


@pytest.mark.parametrize(
    "options,match",
    [
        ({"world_size": 3}, "power-of-two number of processes"),
        ({"world_size": 4, "micro_shards": 2}, "power-of-two number of processes that divides it"),
        ({"sync_batchnorm": True}, "sync_batchnorm=True"),
        ({"grad_compression": "powersgd"}, "grad_compression='powersgd'"),
        ({"strategy": "fsdp"}, "strategy='fsdp'"),
        ({"sync": "diloco"}, "sync='diloco'"),
        ({"ddp_kwargs": {"find_unused_parameters": True}}, "DDP arguments"),
        ({"micro_shards": 0}, "at least 1"),
        ({"micro_shards": 6}, "must be a power of two .* got 6; use 4 or 8"),
    ],
)
def test_what_micro_shards_does_not_combine_with_is_one_line(options, match):
    args = {
        "micro_shards": 4,
        "world_size": 2,
        "sync_batchnorm": False,
        "grad_compression": None,
        "strategy": "ddp",
        "sync": "every-step",
        "ddp_kwargs": {},
        **options,
    }
    shards = args.pop("micro_shards")
    with pytest.raises(UsageError, match=match) as caught:
        exact_tree.check(shards, **args)
    assert "\n" not in str(caught.value)


def test_rt_shards_without_micro_shards_and_through_rt_setup_are_refused():
    rt = ddpkit.init(seed=0)
    try:
        with pytest.raises(UsageError, match="micro_shards=M"):
            rt.shards(torch.zeros(2))
        with pytest.raises(UsageError, match="grad_compression"):
            rt.setup(_bn_net(), micro_shards=2, grad_compression="fp16")
    finally:
        rt.close()


class _RunningNorm(torch.nn.Module):
    """An input normaliser with a running mean of its own (in place, in forward, once ``updating``), and a
    constant mask."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("mask", torch.ones(4))  # read, never changed
        self.updating = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.updating:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return (x - self.mean) * self.mask


def test_a_buffer_of_the_models_own_changed_by_the_shards_forwards_is_refused_before_the_step():
    """Each process would keep its own shards' updates of it: 1 and 2 processes ended apart (a count of
    the samples seen 128 against 64, the weights 1e-3 apart), silently. BatchNorm's statistics and a
    buffer that is only read take part as before."""
    rt = ddpkit.init(seed=0)
    try:
        norm = _RunningNorm()
        model = torch.nn.Sequential(norm, torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
        data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_shards=2)
        batches = iter(rt.loader(data, global_batch_size=8))
        x, y = next(batches)
        for xs, ys in rt.shards(x, y):
            rt.backward(F.cross_entropy(model(xs), ys))
        assert rt.step(optimizer)
        norm.updating = True
        x, y = next(batches)
        refused = r"^micro_shards: the forward of the shards changed the model's buffer '0.mean' in place"
        with pytest.raises(UsageError, match=refused) as caught:
            for xs, ys in rt.shards(x, y):
                rt.backward(F.cross_entropy(model(xs), ys))
        assert "\n" not in str(caught.value) and rt.global_step == 1
    finally:
        rt.close()


@pytest.mark.parametrize(
    "call",
    [
        "rt.all_reduce",
        "rt.all_gather",
        "rt.log",
        "rt.barrier",
        "rt.should_stop",
        "ddpkit.all_reduce",
        "ddpkit.all_gather_object",
    ],
)
def test_the_scripts_collectives_and_rt_log_inside_a_shard_are_one_line_on_one_process_too(call):
    """Inside a shard they would combine it with other ranks' shards (one process has none to combine),
    and a rank with no shard of a short last batch would never call them: refused on any number of
    processes, so one process tells what two would. After the shard loop they run."""
    calls = {
        "rt.all_reduce": lambda rt, loss: rt.all_reduce(loss.detach()),
        "rt.all_gather": lambda rt, loss: rt.all_gather(loss.detach().reshape(1)),
        "rt.log": lambda rt, loss: rt.log({"loss": loss}),
        "rt.barrier": lambda rt, loss: rt.barrier(),
        "rt.should_stop": lambda rt, loss: rt.should_stop(bool(loss.isnan())),
        "ddpkit.all_reduce": lambda rt, loss: ddpkit.all_reduce(loss.detach()),
        "ddpkit.all_gather_object": lambda rt, loss: ddpkit.all_gather_object(float(loss.detach())),
    }
    rt = ddpkit.init(seed=0, trackers=())
    try:
        model = torch.nn.Linear(6, 3)
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_shards=2)
        batches = iter(rt.loader(_data(), global_batch_size=8))
        x, y = next(batches)
        total = torch.zeros(())
        for xs, ys in rt.shards(x, y):
            loss = F.cross_entropy(model(xs), ys)
            rt.backward(loss)
            total += loss.detach()
        assert rt.step(optimizer)
        calls[call](rt, total)  # after the shard loop: runs
        x, y = next(batches)
        with pytest.raises(
            UsageError, match=rf"^{re.escape(call)} inside `for shard in rt\.shards\(\.\.\.\)`"
        ) as caught:
            for xs, ys in rt.shards(x, y):
                loss = F.cross_entropy(model(xs), ys)
                calls[call](rt, loss)
        assert "\n" not in str(caught.value) and "call it once after the shard loop" in str(caught.value)
        assert rt.global_step == 1
        _drop_batch(rt)
    finally:
        rt.close()


# -- several processes ------------------------------------------------------------------------------------


def _same_bits(a: dict, b: dict) -> bool:
    return a["weights"].keys() == b["weights"].keys() and all(
        torch.equal(v, b["weights"][k]) for k, v in a["weights"].items()
    )


@pytest.mark.slow  # 5 s: make test keeps the stream's (the same cut)
@pytest.mark.timeout(240)
def test_a_collate_that_pads_to_the_longest_makes_each_shard_as_one_process_does():
    """A collate_fn that pads each batch to its longest sample (Hugging Face's DataCollatorWithPadding)
    padded a rank's batch to its own longest: a shard cut from it had another width on each world size,
    its dropout masks another shape, and 1 and 2 processes ended 1e-2 apart. The loader collates each
    shard's samples on its own too, and rt.shards hands those out: the same bits, with workers, a
    dict or its tensors, and accumulation."""
    one = workers.padded_lm()
    assert _same_bits(ddpkit.launch(workers.padded_lm, nprocs=2, args=("keys", 2))[0], one)  # persistent workers
    assert _same_bits(workers.padded_lm("keys"), one)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("data, num_workers", [("shards", 2), pytest.param("stream", 0, marks=pytest.mark.slow)])
def test_a_collate_that_pads_to_the_longest_makes_each_shard_of_a_stream_alike(data, num_workers):
    """The same for streams: a ddpkit.Shards stream read by two workers (whose shards lie end to end
    in a rank's batch; the pieces of a batch padded each to its own longest had raised torch.cat's
    traceback) and a plain one (dealt out in turn), on 1 and 2 processes: the same bits."""
    one = workers.padded_lm("keys", num_workers, data=data)
    two = ddpkit.launch(workers.padded_lm, nprocs=2, args=("keys", num_workers, 1, False, data))[0]
    assert _same_bits(two, one)
    assert not _same_bits(workers.padded_lm("keys", num_workers, fixed=True, data=data), one)  # the padding shows


@pytest.mark.slow  # 3 s: make test pads the shards of one batch a step (above)
@pytest.mark.timeout(240)
def test_a_collate_that_pads_to_the_longest_makes_each_shard_alike_through_accumulation():
    accumulated = workers.padded_lm("dict", 0, 2)
    assert _same_bits(ddpkit.launch(workers.padded_lm, nprocs=2, args=("dict", 0, 2))[0], accumulated)


def test_shards_of_copies_of_a_batch_padded_to_its_longest_are_refused_and_of_a_fixed_width_cut():
    with pytest.raises(UsageError, match=r"^rt.shards: the loader's collate_fn pads each batch to its longest sample"):
        workers.padded_lm("copies")
    ddpkit.runtime.current().close()
    assert _same_bits(workers.padded_lm("copies", fixed=True), workers.padded_lm("keys", fixed=True))


@pytest.mark.timeout(240)
def test_one_process_and_ddp_x2_end_at_the_same_bits():
    """BatchNorm2d and a cumulative BatchNorm1d, dropout, momentum, an uneven last batch: equal bits."""
    one = ddpkit.launch(workers.exact_run, nprocs=1, args=(2, 2))[0]
    two = ddpkit.launch(workers.exact_run, nprocs=2, args=(2, 2))[0]
    assert one["steps"] == two["steps"] == 2 * 30
    assert _same(one["state"], two["state"]) == []
    assert one["accuracy"] == two["accuracy"] > 0.8
    assert one["train_loss"] == pytest.approx(two["train_loss"], rel=1e-12)
    assert one["threads"] == two["threads"] == exact_tree.threads_for(2)


@pytest.mark.slow  # make test-slow: make test keeps the core of this family (its 15 minutes)
@pytest.mark.timeout(240)
def test_a_rank_whose_shards_are_empty_still_steps_and_clipping_sees_the_summed_gradients():
    """97 samples in global batches of 48: the last batch's one sample is rank 0's; rank 1 has no
    shard, yet takes part in the exchange (else rank 0 would wait forever) and counts the step.
    The exchange's buckets are small, so most are sent while the last shard's backward runs.
    rt.clip_grad_norm_ clips the tree's sum (a run without clipping ends elsewhere)."""
    one = ddpkit.launch(workers.exact_run, nprocs=1, args=(2, 2, None, None, "fp32", 97, 0.05))[0]
    # buckets of 256 bytes: rank 0 hands them over during its backward, rank 1 all at rt.step
    two = ddpkit.launch(workers.exact_run, nprocs=2, args=(2, 2, None, None, "fp32", 97, 0.05, 256))[0]
    assert one["steps"] == two["steps"] == 2 * 3
    assert _same(one["state"], two["state"]) == []
    unclipped = workers.exact_run(2, 2, None, None, "fp32", 97, None)  # one process: this one
    assert _same(one["state"], unclipped["state"]) != []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_processes_and_a_resume_on_another_world_size_end_at_the_same_bits(tmp_path):
    """M=4 on 1, 2 and 4 processes; and stopped mid-epoch on 2 processes, resumed on 1."""
    one = ddpkit.launch(workers.exact_run, nprocs=1, args=(4, 2))[0]
    four = ddpkit.launch(workers.exact_run, nprocs=4, args=(4, 2, None, None, "fp32", None, None, 4096))[0]
    assert _same(one["state"], four["state"]) == []
    ckpt = str(tmp_path / "ckpt")
    stopped = ddpkit.launch(workers.exact_run, nprocs=2, args=(4, 2, 37, ckpt))[0]
    assert stopped["stopped_at"] == 37
    resumed = ddpkit.launch(workers.exact_run, nprocs=1, args=(4, 2, None, ckpt))[0]
    assert resumed["steps"] == one["steps"]
    assert _same(one["state"], resumed["state"]) == []


@pytest.mark.parametrize(
    "flags,line",
    [
        (
            ["--micro-shards", "2", "--nproc", "3", "--global-batch", "48"],
            "--micro-shards 2 is exact on a power-of-two number of processes that divides it (1, 2, 4, ...); this run "
            "has 3: change the number of processes, or --micro-shards to a multiple of 3",
        ),
        (
            ["--micro-shards", "2", "--nproc", "2", "--sync-bn"],
            "--micro-shards does not combine with --sync-batchnorm (SyncBatchNorm mixes the statistics of every rank, "
            "so they change with the world size); drop sync_batchnorm",
        ),
        (
            ["--micro-shards", "2", "--grad-compression", "fp16"],
            "--micro-shards does not combine with --grad-compression fp16",
        ),
        (
            ["--micro-shards", "2", "--sync", "diloco", "--sync-every", "4"],
            "--micro-shards does not combine with --sync diloco",
        ),
        (["--micro-shards", "2", "--strategy", "fsdp"], "--micro-shards does not combine with --strategy fsdp"),
        (["--micro-shards", "128"], "--micro-shards 128 cuts a global batch of 64 samples"),
        (["--micro-shards", "6"], "--micro-shards must be a power of two (1, 2, 4, 8, ...)"),
    ],
)
def test_ddpkit_train_refuses_micro_shards_it_cannot_make_exact_naming_the_flags(tmp_path, flags, line):
    from ddpkit.cli.train import train_config

    with pytest.raises(UsageError) as caught:
        train_config([*flags, "--out", str(tmp_path / "o")])
    assert str(caught.value).startswith(line) and "\n" not in str(caught.value)


def test_ddpkit_train_with_micro_shards_turns_sync_bn_off_and_records_it(tmp_path):
    from ddpkit.cli.train import train_config
    from ddpkit.recipes.datasets import load_dataset
    from ddpkit.recipes.models import build_model
    from ddpkit.recipes.train import recipe_of, sync_bn_default

    config = train_config(["--micro-shards", "2", "--nproc", "2", "--out", str(tmp_path / "o")])
    convnet = build_model("convnet", num_classes=10, in_channels=1, image_size=8)
    assert sync_bn_default(config, convnet, world_size=2) is False
    assert recipe_of(config, load_dataset("digits", "train"))["micro_shards"] == 2


# -- ddpkit bench --micro-shards ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags,line",
    [
        (["--modes", "single,ddp", "--nproc", "3"], "--micro-shards 2 is exact on a power-of-two number of processes"),
        (["--modes", "dp"], "--micro-shards does not combine with --modes dp or fsdp"),
        (
            ["--modes", "ddp", "--grad-compression", "powersgd"],
            "--micro-shards does not combine with --grad-compression",
        ),
        (["--modes", "ddp", "--sync-bn", "on"], "--micro-shards does not combine with --sync-batchnorm on"),
        (["--modes", "ddp", "--compare-raw"], "--micro-shards does not combine with --compare-raw"),
        (
            ["--modes", "ddp", "--data-format", "shards", "--batch-size", "3", "--nproc", "1"],
            "--micro-shards 2 cuts a --data-format shards global batch of 3",
        ),
        (["--modes", "ddp", "--sync", "diloco", "--sync-every", "4"], "--micro-shards does not combine with --sync"),
    ],
)
def test_bench_refuses_what_micro_shards_does_not_combine_with(flags, line):
    from ddpkit.bench.flags import parse_settings

    with pytest.raises(UsageError) as caught:
        parse_settings([*flags, "--micro-shards", "2"])
    assert str(caught.value).startswith(line) and "\n" not in str(caught.value)


def test_bench_rows_carry_micro_shards_and_a_link_bound_one_is_never_told_to_compress():
    """Every planned row trains with the micro-shards; where the link bounds such a row, the diagnosis
    names only what combines with exactness (a bigger batch), never compression or an infrequent sync."""
    from ddpkit.bench.diagnose import diagnose, recommendations
    from ddpkit.bench.flags import parse_settings
    from ddpkit.bench.plan import Configuration, plan

    settings = parse_settings(["--modes", "single,ddp,ddp-amp", "--nproc", "1,2", "--micro-shards", "2"])
    rows = plan(settings, gpus=0)
    assert rows and all(c.micro_shards == 2 for c in rows) and rows[-1].name.endswith("-ms2")
    from test_bench import _recorded

    plain = _recorded("link-100mbit-resnet18", Configuration("ddp", 1, "fp32", hosts=2))
    exact_row = _recorded("link-100mbit-resnet18", Configuration("ddp", 1, "fp32", hosts=2, micro_shards=2))
    assert any("grad_compression" in f for f in recommendations(plain, [plain]))  # else this proves nothing
    assert exact_row["micro_shards"] == 2
    fixes = recommendations(exact_row, [exact_row])
    assert fixes and all("grad_compression" not in f and "sync" not in f for f in fixes)
    said = diagnose(exact_row, [exact_row])
    assert said.startswith("bound by the link (") and "compression" not in said and "diloco" not in said


@pytest.mark.slow  # make test-slow: make test keeps the core of this family (its 15 minutes)
@pytest.mark.timeout(240)
def test_bench_measures_a_micro_shard_row_with_its_exchange_in_the_backward(tmp_path):
    """The worker's marks put the exchange's wait where DDP's allreduce sits, and the diagnosis reads it."""
    from ddpkit.bench.plan import BenchSettings, Configuration
    from ddpkit.bench.run import measure
    from ddpkit.recipes.models import build_model

    settings = BenchSettings(model="convnet", data="digits", batch=16, steps=4, warmup=1, out=str(tmp_path))
    row = measure(Configuration("ddp", 2, "fp32", micro_shards=2), settings, tmp_path / "row.json")
    assert row["micro_shards"] == 2 and row["samples_per_second"] > 0
    # BatchNorm statistics (one all_gather), then at 2 processes one allreduce a bucket (the tree's top is a + b)
    convnet = build_model("convnet", num_classes=10, in_channels=1, image_size=8)  # digits' shapes
    buckets = len(exact_exchange.plan_buckets(list(convnet.parameters())))
    assert buckets >= 1
    assert row["comm"]["calls_per_step"] == 1 + buckets
    assert row["comm_overlap"] is not None
    # a tiny payload on loopback: its call may time no longer than the latency call (transfer 0)
    assert row["comm"]["allreduce_seconds"] > 0 and row["comm"]["transfer_s"] >= 0 and row["breakdown"]["backward"] > 0
    assert 0.25 < row["compute_scaling_2x"] < 8.0  # a shard's compute on twice the shard, probed (ms on 2 busy cores)


def test_fp16_scaler_clipping_and_loader_workers_combine_with_micro_shards():
    """fp16 scales every shard's loss alike; clipping unscales the tree's sum once; workers feed batches."""
    rt = ddpkit.init(seed=0, precision="fp16")
    try:
        net = _bn_net()
        before = [p.detach().clone() for p in net.parameters()]
        net, opt = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1), micro_shards=2)
        norms = []
        for x, y in rt.loader(_data(), global_batch_size=10, num_workers=2):
            for xs, ys in rt.shards(x, y):
                with rt.autocast():
                    loss = F.cross_entropy(net(xs), ys)
                rt.backward(loss)
            norms.append(float(rt.clip_grad_norm_(net, 1.0)))
            rt.step(opt)
        assert len(norms) == 4 and all(0 < n < 100 for n in norms)  # unscaled: the scale is 65536
        assert any(not torch.equal(a, b) for a, b in zip(before, net.parameters()))
    finally:
        rt.close()


def test_rt_shards_refuses_a_batch_rt_loader_did_not_cut_and_an_uneven_shards_stream():
    rt = ddpkit.init(seed=0)
    try:
        net, opt = rt.setup(_bn_net(), torch.optim.SGD(_bn_net().parameters(), lr=0.1), micro_shards=4)
        x, y = next(iter(torch.utils.data.DataLoader(_data(), batch_size=8)))
        with pytest.raises(UsageError, match="needs a batch from rt.loader"):
            rt.shards(x, y)
        with pytest.raises(UsageError, match="shards of less than one sample; raise global_batch_size to at least 4"):
            rt.shards(*next(iter(rt.loader(_data(), global_batch_size=3))))
        stream = ddpkit.Shards.from_dataset(_data(), shards=4)
        x, y = next(iter(rt.loader(stream, global_batch_size=10)))
        with pytest.raises(UsageError, match="make global_batch_size a multiple of 4"):
            rt.shards(x, y)
    finally:
        rt.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["plain", pytest.param("shards", marks=pytest.mark.slow)])
def test_streams_end_at_the_same_bits_on_one_and_two_processes(kind):
    """A plain IterableDataset (every rank reads it whole, keeps every W-th sample) and a
    ddpkit.Shards stream (each rank reads its own columns: shards lie end to end, so the tree pairs
    neighbours first); micro_shards=4, so each rank sums two shards before the exchange; BatchNorm,
    dropout, a short last batch that leaves a rank without samples."""
    one = ddpkit.launch(workers.exact_stream_run, nprocs=1, args=(kind, 4))[0]
    two = ddpkit.launch(workers.exact_stream_run, nprocs=2, args=(kind, 4))[0]
    assert one["steps"] == two["steps"] == 2 * 7  # 104 samples in batches of 16: 7 a pass, the last of 8
    assert _same(one["state"], two["state"]) == []
    assert one["samples"] == two["samples"] == 208


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,local_shards", [(4, 2), (2, 1), (2, 2)])
def test_the_exchange_sums_along_the_one_process_tree_bit_for_bit(world, local_shards):
    """Recursive halving then doubling, in buckets handed over out of order: the same bits as one
    process's tree, a parameter no shard reached stays None, one reached on one rank only is that
    rank's sum, and ``-0.0`` survives (an absent gradient is never added as a zero)."""
    out = ddpkit.launch(workers.tree_exchange_bits, nprocs=world, args=(local_shards,))
    for rank in range(world):
        got, want = out[rank]["sums"], out[rank]["one_process"]
        assert [g is None for g in got] == [w is None for w in want] == [False, False, True, False, False]
        assert all(torch.equal(g, w) for g, w in zip(got, want) if w is not None), rank
    assert out[0]["buckets"] > 2
    # two ranks: one allreduce a bucket, its counts in the message; more: halving and doubling's rounds
    assert out[0]["rounds"] == (out[0]["buckets"] if world == 2 else 2 * (world.bit_length() - 1) * out[0]["buckets"])
    sign_bit = torch.tensor(-(2**31), dtype=torch.int32)
    assert any(bool((w == sign_bit).any()) for w in out[0]["one_process"] if w is not None)  # -0.0 is there


@pytest.mark.slow  # 6 s: make test-slow; make test keeps 4 processes with micro_shards in test_counted
@pytest.mark.timeout(240)
def test_four_ranks_read_reversed_bits_slots_from_the_first_pass_after_setup_with_micro_shards():
    """Under micro-shards on 4 ranks, neighbouring ranks (one node's) hold the shards the tree adds first:
    ranks 1 and 2 trade their strided parts, from the first pass begun after rt.setup; without it, none do."""
    shards = ddpkit.launch(workers.loader_slots, nprocs=4, args=(4,))
    plain = ddpkit.launch(workers.loader_slots, nprocs=4, args=(None,))
    for rank, slot in enumerate([0, 2, 1, 3]):
        assert shards[rank]["before"] == plain[rank]["before"] == (rank, [float(rank), float(rank + 4)])
        assert shards[rank]["after"] == (slot, [float(slot), float(slot + 4)])
        assert plain[rank]["after"] == (rank, [float(rank), float(rank + 4)])


@pytest.mark.timeout(240)
def test_two_ranks_sum_into_the_same_buffers_every_step_and_let_autograds_gradients_go_after_the_step():
    """A step's gradients are views of buckets kept from step to step (a fresh 44 MB a step costs more than
    the copy into it), and the last shard's own gradients are held until the optimizer stepped, then let go."""
    out = ddpkit.launch(workers.exact_step_buffers, nprocs=2, args=(3,))
    for rank in (0, 1):
        buffers, grads, held = out[rank]["buffers"], out[rank]["grads"], out[rank]["held"]
        assert buffers == [True, True, True], rank  # the same tensors, step after step
        assert grads[0] == grads[2], rank  # the same views' places, step after step
        assert held == [len(grads[0]), 0] * 3, rank


TORCH_SAYS_NO_KERNEL = """
import ddpkit
from ddpkit.errors import translate_uncaught
from ddpkit.parallel.exact import no_deterministic_kernel

rt = ddpkit.init()
translate_uncaught(no_deterministic_kernel)  # what rt.setup(micro_shards=...) registers on CUDA
raise RuntimeError("index_add_cuda_ does not have a deterministic implementation, but you set "
                   "'torch.use_deterministic_algorithms(True)'. You can turn off ...")
"""


@pytest.mark.timeout(120)
def test_torchs_no_deterministic_kernel_error_becomes_one_line_and_exit_2(tmp_path):
    """The CUDA error itself needs a GPU (tests/test_gpu.py raises it for real); its report does not."""
    from helpers import ddpkit as ddpkit_cli

    script = tmp_path / "no_kernel.py"
    script.write_text(TORCH_SAYS_NO_KERNEL)
    result = ddpkit_cli("run", "-n", "1", str(script), timeout=100)
    assert result.returncode == 2, result.stderr
    assert (
        "ddpkit: error: micro_shards runs deterministic CUDA kernels only, and index_add_cuda_ has none"
        in result.stderr
    )
    assert "Traceback" not in result.stderr
    from ddpkit.parallel.exact import no_deterministic_kernel

    assert no_deterministic_kernel(RuntimeError("CUDA out of memory")) is None  # other errors keep their traceback
    assert no_deterministic_kernel(ValueError("x does not have a deterministic implementation")) is None
    # torch 2.11's words on an H200, where the op comes with its input (the first GPU check missed them)
    said = no_deterministic_kernel(
        RuntimeError(
            "_histc_cuda with floating point input does not have a deterministic implementation, but you set "
            "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this operation"
        )
    )
    assert said is not None and "and _histc_cuda with floating point input has none;" in str(said)
    # a language model's F.cross_entropy on (N, C, T) scores: nll_loss2d adds with atomicAdd
    said = no_deterministic_kernel(
        RuntimeError("nll_loss2d_forward_out_cuda_template does not have a deterministic implementation, but you set")
    )
    assert said is not None and "flatten per-position scores (N, C, T) to rows for F.cross_entropy" in str(said)


def test_per_position_scores_as_rows_give_cross_entropys_loss_and_gradient():
    """What ddpkit's own losses and evaluate's per-token loss use, so that micro_shards' deterministic
    CUDA kernels take a language model (nll_loss2d, for (N, C, T), has none)."""
    from ddpkit._tensors import position_rows

    torch.manual_seed(0)
    scores = torch.randn(3, 7, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (3, 5))
    targets[0, :2] = -100  # padding
    direct = torch.nn.functional.cross_entropy(scores, targets)
    (grad_direct,) = torch.autograd.grad(direct, scores)
    rows = torch.nn.functional.cross_entropy(*position_rows(scores, targets))
    (grad_rows,) = torch.autograd.grad(rows, scores)
    assert rows.item() == pytest.approx(direct.item(), rel=1e-14) and torch.allclose(grad_rows, grad_direct)
    flat = torch.randn(4, 7)
    assert position_rows(flat, targets[0, :4])[0] is flat


def test_bench_compare_exact_puts_a_micro_shard_twin_beside_each_plain_ddp_row():
    from ddpkit.bench.flags import parse_settings
    from ddpkit.bench.plan import plan
    from ddpkit.bench.run import exact_ratio

    settings = parse_settings(["--modes", "single,ddp,ddp-amp", "--nproc", "2,3,4", "--compare-exact"])
    rows = [(c.mode, c.nproc, c.micro_shards, c.reason is None) for c in plan(settings, gpus=0)]
    assert rows == [
        ("single", 1, None, True),
        ("ddp", 2, None, True),
        ("ddp", 2, 2, True),
        ("ddp", 3, None, True),
        ("ddp", 3, 3, False),  # not a power of two: shown as not applicable
        ("ddp", 4, None, True),
        ("ddp", 4, 4, True),
        ("ddp-amp", 2, None, True),
        ("ddp-amp", 3, None, True),
        ("ddp-amp", 4, None, True),
    ]
    plain = {"mode": "ddp", "nproc": 2, "precision": "fp32", "hosts": None, "samples_per_second": 100.0}
    assert exact_ratio(plain, {**plain, "micro_shards": 2, "samples_per_second": 97.0}) == 0.97
    assert exact_ratio(plain, {**plain, "nproc": 4, "micro_shards": 4, "samples_per_second": 97.0}) is None
    for flags, line in [
        (
            ["--compare-exact", "--modes", "ddp", "--micro-shards", "2"],
            "--compare-exact adds micro-shard rows beside plain ones",
        ),
        (["--compare-exact", "--modes", "single"], "--compare-exact compares ddp rows"),
    ]:
        with pytest.raises(UsageError, match=line):
            parse_settings(flags)


@pytest.mark.timeout(300)
def test_accumulation_over_three_batches_ends_at_the_same_bits_on_one_and_two_processes():
    """rt.accumulate(model, 3) with micro_shards=2: each shard's gradient adds up over the group's
    batches before the tree; BatchNorm statistics follow batch by batch; an uneven last group."""
    one = ddpkit.launch(workers.exact_run, nprocs=1, args=(2, 1, None, None, "fp32", None, None, None, 3))[0]
    two = ddpkit.launch(workers.exact_run, nprocs=2, args=(2, 1, None, None, "fp32", None, None, 256, 3))[0]
    assert one["steps"] == two["steps"] == 10  # 30 batches of an epoch, 3 a step
    assert _same(one["state"], two["state"]) == []
    assert one["accuracy"] == two["accuracy"] > 0.5


def test_a_checkpoint_inside_an_accumulation_group_with_micro_shards_is_one_line(tmp_path):
    rt = ddpkit.init(seed=0, checkpoint_dir=str(tmp_path / "ckpt"))
    try:
        net = torch.nn.Linear(6, 3)
        net, opt = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1), micro_shards=2)
        for x, y in rt.loader(_data(), global_batch_size=8):
            with rt.accumulate(net, 2):
                for xs, ys in rt.shards(x, y):
                    rt.backward(F.cross_entropy(net(xs), ys))
                with pytest.raises(UsageError, match="checkpoint after the rt.step of the group's last batch"):
                    rt.checkpoint({"model": net, "optimizer": opt})
                break
    finally:
        rt.close()
    assert not any((tmp_path / "ckpt").glob("*")) if (tmp_path / "ckpt").exists() else True


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_compiled_model_ends_at_the_same_bits_on_one_two_and_four_processes():
    """rt.setup(..., micro_shards=4, compile=True): torch.compile traces the shards' BatchNorm hooks
    (no graph break); one, two and four processes run the same compiled kernels on the same threads."""
    one = ddpkit.launch(workers.exact_stream_run, nprocs=1, args=("plain", 4, 256, True))[0]
    two = ddpkit.launch(workers.exact_stream_run, nprocs=2, args=("plain", 4, 256, True))[0]
    four = ddpkit.launch(workers.exact_stream_run, nprocs=4, args=("plain", 4, 256, True))[0]
    assert one["compiled"] and two["compiled"] and four["compiled"]
    assert _same(one["state"], two["state"]) == [] and _same(one["state"], four["state"]) == []
    eager = ddpkit.launch(workers.exact_stream_run, nprocs=1, args=("plain", 4, 256, False))[0]
    assert _same(one["state"], eager["state"]) != []  # compiled kernels (and dropout) are not eager's


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_shards_stream_with_accumulation_ends_at_the_same_bits_on_one_two_and_four_processes():
    """micro_shards=4 over a ddpkit.Shards stream, two batches a step: one shard a rank on 4
    processes, two on 2, four on 1; the exchange pairs neighbours first."""
    runs = [ddpkit.launch(workers.exact_stream_run, nprocs=n, args=("shards", 4, 256, False, 2))[0] for n in (1, 2, 4)]
    assert [r["steps"] for r in runs] == [2 * 4] * 3  # 7 batches a pass, in groups of 2, 2, 2, 1
    assert _same(runs[0]["state"], runs[1]["state"]) == [] and _same(runs[0]["state"], runs[2]["state"]) == []


def test_a_subtree_travels_as_raw_bits_that_a_sum_with_other_replicas_zero_rows_keeps():
    from ddpkit.parallel.exact import _Layout

    params = [torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16), torch.zeros(())]
    layout = _Layout(params)
    cpu = torch.device("cpu")
    grads = [torch.tensor([-0.0, float("nan"), 1e-40]), None, torch.tensor(-2.5)]
    summed = layout.pack(grads, cpu) + layout.pack(None, cpu) + layout.pack([None, None, None], cpu)
    back = layout.unpack(summed)
    assert back is not None and back[1] is None
    for got, want in ((back[0], grads[0]), (back[2], grads[2])):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))  # -0.0 and NaN too
    half = [None, torch.tensor([1.5, -0.0, 3.0], dtype=torch.bfloat16), None]  # 6 bytes in an 8-byte slot
    assert torch.equal(layout.unpack(layout.pack(half, cpu))[1].view(torch.int16), half[1].view(torch.int16))
    assert layout.unpack(layout.pack(None, cpu)) is None


@pytest.mark.parametrize("micro_shards", [1, 4, 8])
def test_each_quorum_size_computes_every_shard_once_in_whole_subtrees_of_the_one_process_tree(micro_shards):
    from types import SimpleNamespace

    from ddpkit.parallel.exact import Exact

    net = torch.nn.Linear(2, 2)
    for participants in range(1, 7):
        quorum = SimpleNamespace(rank=0, participants=participants)
        exact = Exact(
            net,
            None,
            micro_shards=micro_shards,
            world_size=1,
            rank=0,
            seed=0,
            device=torch.device("cpu"),
            quorum=quorum,
        )
        subtrees = exact._subtrees()
        assert subtrees & (subtrees - 1) == 0 and micro_shards % subtrees == 0
        assert subtrees >= min(participants, micro_shards)  # every replica has work while there is some
        owners = {}
        for rank in range(participants):
            quorum.rank = rank
            for s in range(micro_shards):
                if exact._computes(s):
                    assert s not in owners
                    owners[s] = rank
        assert sorted(owners) == list(range(micro_shards))
        for k in range(subtrees):  # a subtree (shards k, k + K, ...) is one replica's
            assert len({owners[s] for s in range(k, micro_shards, subtrees)}) == 1


def test_a_rounds_sends_and_receives_go_as_one_batch_as_nccl_needs(monkeypatch):
    """``_swap`` posts a round's sends and receives together (``batch_isend_irecv``): on NCCL, a send
    larger than its buffers waits for the partner's receive, so two partners each posting a send
    first, one call at a time, would wait for each other (NVIDIA/nccl#479). Empty halves send nothing."""
    import torch.distributed as dist

    batches: list[list[tuple[str, int, int]]] = []

    class Done:
        def wait(self) -> None:
            pass

    def batch(ops):
        batches.append([(op.op.__name__, op.tensor.numel(), op.tag) for op in ops])
        for op in ops:
            if op.op is dist.irecv:
                op.tensor.fill_(7.0)  # the partner's half lands
        return [Done() for _ in ops]

    class Op:  # torch's P2POp, without the process group it looks the peer up in
        def __init__(self, op, tensor, peer, group=None, tag=0):
            self.op, self.tensor, self.peer, self.tag = op, tensor, peer, tag

    monkeypatch.setattr(dist, "P2POp", Op)
    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    # (no process group here: a send or receive posted alone, outside the batch, would raise)
    exchange = exact_exchange.TreeExchange.__new__(exact_exchange.TreeExchange)
    exchange.group, exchange._through_host = None, False
    into = torch.zeros(6)
    exchange._swap([(torch.ones(4), into[:4]), (torch.ones(0), into[4:4])], partner=1, bucket=3)
    assert batches == [[("isend", 4, 6), ("irecv", 4, 6)]]  # one batch; the empty pair sent nothing
    assert into.tolist() == [7.0] * 4 + [0.0, 0.0]


@pytest.mark.timeout(240)
def test_accumulation_by_hand_ends_at_the_same_bits_on_one_and_two_processes():
    """rt.backward(loss / k) on each batch and rt.step every k batches, without rt.accumulate: the
    second batch's backward wrote into the exchange's buffer (torch refused its aliasing, a traceback);
    now each batch's tree sum is added to the one before, as .grad accumulates."""
    one = workers.accumulated_by_hand(2)
    two = ddpkit.launch(workers.accumulated_by_hand, nprocs=2, args=(2,))[0]
    assert one["steps"] == two["steps"] == 4  # 6 batches an epoch, 3 a step
    assert _same(one["state"], two["state"]) == []
    grouped = workers.accumulated_by_hand(2, 3, False)  # rt.accumulate: each batch its own dropout, BatchNorm in turn
    assert grouped["steps"] == 4
    for key, value in grouped["state"].items():  # the same sums, added in another order
        torch.testing.assert_close(one["state"][key], value, rtol=1e-12, atol=1e-12)


@pytest.mark.slow  # make test-slow: make test keeps the core of this family (its 15 minutes)
@pytest.mark.timeout(240)
def test_a_loss_over_a_batch_gathered_from_every_rank_inside_the_shards_is_one_line():
    """CLIP's loss over embeddings gathered from every rank (``torch.distributed.nn.all_gather``, as
    open_clip gathers them) inside ``rt.shards``: 1 and 2 processes ended 2.8 apart in their weights'
    sum under micro_shards=2, silently. MoCo's keys gathered without a gradient the same. Both are refused
    after the first shard, before any step, on every rank; torch's own all_reduce after the shard loop
    runs, and that run ends at one process's bits."""
    start = "micro_shards: a torch.distributed collective ran inside `for shard in rt.shards(...)`"
    for where in ("loss", "keys"):
        two = ddpkit.launch(workers.gathered_loss, nprocs=2, args=(where,))
        assert [run["steps"] for run in two.values()] == [0, 0], where
        assert all(run["refused"].startswith(start) and "\n" not in run["refused"] for run in two.values()), two
    one = workers.gathered_loss("after")
    two = ddpkit.launch(workers.gathered_loss, nprocs=2, args=("after",))[0]
    assert one["steps"] == two["steps"] == 4
    assert torch.equal(one["weight"], two["weight"])
    assert one["summed"] == pytest.approx(two["summed"], rel=1e-12)


@pytest.mark.timeout(120)
def test_numpy_and_random_draws_inside_the_shards_are_the_same_on_any_world_size():
    """Mixup's weight from np.random.beta inside rt.shards was each rank's own draw: 1 and 2 processes
    ended 7e-3 apart under micro_shards, where torch's draws were keyed by the shard. numpy's and random's
    are now keyed too, and go on from the batch's stream outside the shards."""
    one = workers.mixup_numpy()
    two = ddpkit.launch(workers.mixup_numpy, nprocs=2)[0]
    assert _same_bits(one, two)
    assert one["after"] == two["after"]  # the last batch's stream, the same on both


@pytest.mark.timeout(120)
def test_draws_for_the_batch_outside_the_shards_are_the_same_on_any_world_size():
    """Mixup's weight drawn once a batch, before its shards (np.random.beta, torch.rand), drew from each
    rank's stream of its own: 1 and 2 processes parted silently under micro_shards. Each batch a loader
    hands out now keys the global generators alike on every rank, and rt.setup gives every rank rank 0's
    stream: the same bits, through a validation pass with dropout on whose draws follow each rank's rows."""
    one = workers.mixup_numpy(2, True)
    assert _same_bits(ddpkit.launch(workers.mixup_numpy, nprocs=2, args=(2, True))[0], one)
    assert not _same_bits(workers.mixup_numpy(2, False), one)  # the draws outside the shards counted


@pytest.mark.slow  # make test-slow: make test keeps the core of this family (its 15 minutes)
@pytest.mark.timeout(180)
def test_a_collate_that_draws_gives_each_shard_one_process_draws_with_workers():
    """A collate_fn that draws (a masked language model's masks, a mixup weight) drew from the process's
    stream: 1 and 2 processes parted under micro_shards, with workers or without. Each call is now keyed by
    the samples it collates."""
    one = workers.drawing_collate("map", 2, 2)
    assert _same_bits(ddpkit.launch(workers.drawing_collate, nprocs=2, args=("map", 0, 2))[0], one)
    assert _same_bits(ddpkit.launch(workers.drawing_collate, nprocs=2, args=("map", 2, 2))[0], one)


def test_a_batchs_random_key_tells_named_loaders_apart_and_an_unnamed_rebuilt_one_not():
    """The key of a batch's stream: a name of the script's is kept whole (``stage#1`` and ``stage#2`` draw
    apart), while an unnamed loader's ``#2`` (a rebuilt loader takes it in one attempt and not another) is not
    part of it."""
    from types import SimpleNamespace

    from ddpkit.parallel.exact import _identity

    data = torch.utils.data.TensorDataset(torch.zeros(8, 1))
    sampler = SimpleNamespace(global_batch_size=4, dataset_length=8)

    def key(name: str) -> str:
        return _identity(SimpleNamespace(name=name, dataset=data, sampler=sampler))

    assert key("stage#1") != key("stage#2")
    assert key("TensorDataset") == key("TensorDataset#2")
    assert key("TensorDataset") != _identity(
        SimpleNamespace(
            name="TensorDataset", dataset=data, sampler=SimpleNamespace(global_batch_size=4, dataset_length=9)
        )
    )
