"""A loader read pass after pass without ``rt.epochs``: ``for epoch in range(n)``, or the step-based
loop of nanoGPT and Hugging Face's ``max_steps`` (``next(it)``, a new ``iter(loader)`` at its end).
Each pass read the first epoch's order again, as torch's ``DistributedSampler`` does when
``set_epoch`` is forgotten, the trap ddpkit exists to remove."""

from __future__ import annotations

import re
import warnings

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
@pytest.mark.parametrize(
    "stop_at",
    [pytest.param(7, marks=pytest.mark.slow), 10],  # 5 s each; the pass's end is the harder one
    ids=["mid-pass", "after-a-pass-last-batch"],
)
def test_a_step_based_loop_resumes_exactly_on_any_world_size(tmp_path, stop_at):
    """5 batches a pass: step 7 stops inside the second pass, step 10 after its last batch, before
    the new iter(loader) that the uninterrupted run begins the third pass with (epoch 2)."""
    whole = ddpkit.launch(pass_workers.step_based, nprocs=2, args=(str(tmp_path / "whole"), 17))[0]
    assert len(set(whole["seen"][:5])) == 5 and whole["seen"][5:10] != whole["seen"][:5]  # each pass anew
    stopped = str(tmp_path / "stopped")
    ddpkit.launch(pass_workers.step_based, nprocs=2, args=(stopped, 17, stop_at))
    with pytest.warns(UserWarning, match="written by 2 process.*draws outside rt.shards start afresh"):
        resumed = pass_workers.step_based(stopped, 17)  # on one process: micro_shards=2, the same bits
    assert resumed["step"] == 17 and len(resumed["seen"]) == 17 - stop_at  # from the checkpoint of step stop_at
    for key, value in whole["weights"].items():
        assert torch.equal(resumed["weights"][key], value), key


@pytest.mark.timeout(240)
@pytest.mark.slow  # 11 s, for make test's budget; the zipped loaders' saves are in-process below
@pytest.mark.parametrize("driven", [True, False], ids=["rt.epochs", "range"])
def test_two_zipped_loaders_both_move_on_and_resume_exactly(tmp_path, driven):
    """zip(labeled, unlabeled): only the loader whose batch came last was training's, so the other's
    position was not saved (a resumed run read its epoch from the start) and, without rt.epochs, it
    read the first epoch's order every epoch."""
    whole = ddpkit.launch(pass_workers.zipped, nprocs=2, args=(str(tmp_path / "whole"), driven))[0]
    for loader in (0, 1):  # each epoch's first batch of each loader: three orders
        assert len({str(first[loader]) for first in whole["firsts"]}) == 3, loader
    # inside the second epoch; under rt.epochs also at its last step, the labeled loader read to its end
    # (without rt.epochs a checkpoint there cannot tell zip's end from two iterators read on apart)
    for stop_at in (8, 12) if driven else (8,):
        stopped = str(tmp_path / f"stopped{stop_at}")
        ddpkit.launch(pass_workers.zipped, nprocs=2, args=(stopped, driven, stop_at))
        resumed = ddpkit.launch(pass_workers.zipped, nprocs=2, args=(stopped, driven))[0]
        for key, value in whole["weights"].items():
            assert torch.equal(resumed["weights"][key], value), (stop_at, key)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stop_at", [5, 6])
def test_zipped_loaders_saved_as_the_shorter_second_hands_out_its_last_batch_resume_exactly(tmp_path, stop_at):
    """zip(unlabeled, labeled): at step 6 the labeled loader has handed out its last batch and is still
    read, and the zip ends at the unlabeled one's next batch. Saved there, the resumed run began the
    labeled loader's epoch anew (4 more steps in epoch 0, other weights)."""
    whole = pass_workers.zipped(str(tmp_path / "whole"), True, None, True)
    assert whole["step"] == 18  # 6 steps an epoch
    stopped = str(tmp_path / f"stopped{stop_at}")
    assert pass_workers.zipped(stopped, True, stop_at, True) == {"stopped": stop_at}
    resumed = pass_workers.zipped(stopped, True, None, True)
    assert resumed["step"] == whole["step"]
    for key, value in whole["weights"].items():
        assert torch.equal(resumed["weights"][key], value), key


@pytest.mark.timeout(240)
def test_a_validation_iterator_kept_across_steps_leaves_an_epoch_end_checkpoint_at_the_epoch_end(tmp_path):
    """Its batches come between steps as a zipped loader's do, so its position is saved too; the
    checkpoint after the training loader's pass still starts the next epoch on resume."""
    whole = pass_workers.validation_iterator(str(tmp_path / "whole"))
    assert whole["steps"] == 15
    pass_workers.validation_iterator(str(tmp_path / "stopped"), 0)
    resumed = pass_workers.validation_iterator(str(tmp_path / "stopped"))
    assert resumed["steps"] == 15 and len(resumed["losses"]) == 10  # epochs 1 and 2, not 0 again
    for key, value in whole["weights"].items():
        assert torch.equal(resumed["weights"][key], value), key
    # mid-epoch, just as the validation iterator handed out its last batch: still mid-epoch
    pass_workers.validation_iterator(str(tmp_path / "mid"), None, 3)
    resumed = pass_workers.validation_iterator(str(tmp_path / "mid"))
    assert resumed["steps"] == 15 and len(resumed["losses"]) == 12
    for key, value in whole["weights"].items():
        assert torch.equal(resumed["weights"][key], value), key


@pytest.mark.parametrize("name", [None, "train"])
def test_a_loader_rebuilt_each_epoch_goes_on_to_the_next_epoch(rt, name):
    """A loader built anew each epoch (``loader = rt.loader(...)`` inside the loop) read the first
    epoch's order every epoch without rt.epochs, and under a name= it was refused as a second live
    loader of that name while the one it replaces was still bound to the variable."""
    data = torch.utils.data.TensorDataset(torch.arange(12), torch.arange(12) % 2)
    net = torch.nn.Embedding(12, 2)
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    orders = []
    for _ in range(3):
        loader = rt.loader(data, global_batch_size=4, shuffle=True, name=name)
        order = []
        for x, y in loader:
            order += x.tolist()
            rt.backward(F.cross_entropy(model(x), y))
            rt.step(optimizer)
        orders.append(order)
    assert loader.name == (name or "TensorDataset")  # each took its predecessor's key
    live = iter(loader)
    next(live)  # mid-pass: a loader built now is a second one, not its successor
    if name is None:
        assert rt.loader(data, global_batch_size=4, shuffle=True).name == "TensorDataset#2"
    else:
        with pytest.raises(ddpkit.DdpkitError, match="two live loaders are named 'train'"):
            rt.loader(data, global_batch_size=4, shuffle=True, name="train")
    del live
    rt.close()
    with ddpkit.init(seed=0) as again:
        assert _orders(again, "rt.epochs") == orders  # epochs 0, 1, 2


def test_a_checkpoint_keeps_where_a_rebuilt_loader_goes_on_after_the_one_it_replaced_is_gone(tmp_path):
    data = torch.utils.data.TensorDataset(torch.arange(12), torch.arange(12) % 2)

    def run(rt, epochs: range) -> list:
        net = torch.nn.Embedding(12, 2)
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        state = {"model": model, "optimizer": optimizer}
        if epochs.start:
            rt.load(tmp_path / "ckpt.pt", state)
        orders = []
        for _ in epochs:
            orders.append([])
            for x, y in rt.loader(data, global_batch_size=4, shuffle=True):  # gone after its pass
                orders[-1] += x.tolist()
                rt.backward(F.cross_entropy(model(x), y))
                rt.step(optimizer)
            rt.save(tmp_path / "ckpt.pt", state)
        return orders

    with ddpkit.init(seed=0) as rt:
        whole = run(rt, range(3))
    with ddpkit.init(seed=0) as rt:
        assert run(rt, range(2)) == whole[:2]
    with ddpkit.init(seed=0) as rt:
        assert run(rt, range(2, 3)) == whole[2:]  # epoch 2, not epoch 0 again
    assert len({str(order) for order in whole}) == 3


def _trainer(rt, ckpt, stop: int | None):
    """An embedding trained by SGD, loaded from ``ckpt`` where ``stop`` is None, and its step: backward and
    step of a batch, then a save at step ``stop``, where it returns True (the loop stops there)."""
    net = torch.nn.Embedding(12, 2)
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    state = {"model": model, "optimizer": optimizer}
    if stop is None:
        rt.load(ckpt, state)

    def step(x: torch.Tensor, y: torch.Tensor) -> bool:
        rt.backward(F.cross_entropy(model(x), y))
        rt.step(optimizer)
        if rt.global_step != stop:
            return False
        rt.save(ckpt, state)
        return True

    return net, step


def _whole_first_rest(run, stop: int) -> tuple[list, list, list]:
    """What ``run(rt, stop)`` returns uninterrupted, stopped at step ``stop``, and resumed from there."""
    attempts = []
    for attempt_stop in (-1, stop, None):
        with ddpkit.init(seed=0) as rt:
            attempts.append(run(rt, attempt_stop))
    return attempts[0], attempts[1], attempts[2]


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("name", [None, "train"])
def test_a_curriculums_loader_built_each_epoch_over_a_larger_part_resumes_mid_epoch(tmp_path, keep, name):
    """A new loader each epoch over another part of the data (easy samples first), under rt.epochs: a
    checkpoint in epoch 2 kept the loaders of epochs 0 and 1 (still alive, their epoch set to 2, nothing
    of it read) as passes that go on, and the resumed run refused its one loader ("saved for 4 samples,
    but this loader has 12"); under a name= the second loader was refused as a second live loader of
    that name. ``keep`` holds every loader built, as a script's list of them would."""
    data = torch.utils.data.TensorDataset(torch.arange(12), torch.arange(12) % 2)

    def run(rt, stop: int | None) -> list:
        net, step = _trainer(rt, tmp_path / "ckpt.pt", stop)
        reads, kept = [], []
        for epoch in rt.epochs(4):
            part = torch.utils.data.Subset(data, list(range(4 * min(epoch + 1, 3))))
            loader = rt.loader(part, global_batch_size=2, shuffle=True, name=name)
            kept += [loader] if keep else []
            for x, y in loader:
                reads.append((epoch, x.tolist()))
                if step(x, y):
                    return reads
        return reads + [net.weight.detach().clone()]

    whole, first, rest = _whole_first_rest(run, stop=8)  # epoch 2's second batch (2 + 4 steps before it)
    assert first[-1][0] == 2 and first + rest[:-1] == whole[:-1]
    assert torch.equal(rest[-1], whole[-1])


@pytest.mark.parametrize("name", [None, "train"])
@pytest.mark.parametrize("loop", ["rt.epochs", "range"])
def test_a_second_loader_over_the_training_data_built_after_its_pass_leaves_training_as_it_was(tmp_path, name, loop):
    """A look at the training data after each pass (a hand loop over ``rt.loader(train_data, ...)`` with
    the training loader's settings) took the training loader's key: under rt.epochs the training loader
    then read epoch 0's order in every epoch (its epoch no longer set), and a checkpoint in the next
    epoch kept no position, so the resumed run read that epoch again from its start."""
    data = torch.utils.data.TensorDataset(torch.arange(12), torch.arange(12) % 2)

    def run(rt, stop: int | None) -> list:
        net, step = _trainer(rt, tmp_path / "ckpt.pt", stop)
        train = rt.loader(data, global_batch_size=4, shuffle=True, name=name)
        reads = []
        for _ in rt.epochs(3) if loop == "rt.epochs" else iter(lambda: rt.global_step < 9, False):  # 3 passes
            for x, y in train:
                reads.append(x.tolist())
                if step(x, y):
                    return reads
            with torch.no_grad():  # the training data's accuracy, by hand
                for x, _ in rt.loader(data, global_batch_size=4, shuffle=True, name=name):
                    net(x)
        return reads

    whole, first, rest = _whole_first_rest(run, stop=5)  # epoch 1's second batch
    assert len({str(sorted(whole[i : i + 3])) for i in (0, 3, 6)}) == 3  # each epoch its own order
    assert first + rest == whole


def test_two_loaders_of_one_name_feeding_one_step_are_refused_in_one_line(rt):
    """A name= given to two loaders that then train together (one built after the other's pass, so it
    took that name): a checkpoint could keep only one position, so the step is refused."""
    data = torch.utils.data.TensorDataset(torch.arange(12), torch.arange(12) % 2)
    net = torch.nn.Embedding(12, 2)
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    first = rt.loader(data, global_batch_size=4, shuffle=True, name="train")
    for x, y in first:
        rt.backward(F.cross_entropy(model(x), y))
        rt.step(optimizer)
    second = rt.loader(data, global_batch_size=6, name="train")  # first's pass is over: it takes the name
    with pytest.raises(ddpkit.DdpkitError, match="two loaders under the name 'train' feed training in one pass"):
        for (x, y), (u, v) in zip(first, second):
            rt.backward(F.cross_entropy(model(torch.cat([x, u])), torch.cat([y, v])))
            rt.step(optimizer)


def test_a_loop_without_rt_epochs_resumes_without_rebuilding_a_loader_whose_pass_was_over(tmp_path):
    """Its checkpoint keeps every training loader's pass, ended ones too: a warm-up loader the resumed
    script no longer builds is not a loader it owes (only a pass saved mid-way is)."""
    data = torch.utils.data.TensorDataset(torch.arange(12), torch.arange(12) % 2)
    with ddpkit.init(seed=0) as rt:
        net = torch.nn.Embedding(12, 2)
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for name in ("warmup", "main"):
            for x, y in rt.loader(data, global_batch_size=4, shuffle=True, name=name):
                rt.backward(F.cross_entropy(model(x), y))
                rt.step(optimizer)
        rt.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer})
    with ddpkit.init(seed=0) as rt:
        net = torch.nn.Embedding(12, 2)
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        rt.load(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer})
        loader = rt.loader(data, global_batch_size=4, shuffle=True, name="main")
        for x, y in loader:
            rt.backward(F.cross_entropy(model(x), y))  # no "continues the epoch of loader 'warmup'"
            rt.step(optimizer)
        assert loader.epoch == 1  # the pass after the saved one


def test_an_optimizer_stepped_directly_still_ends_the_epoch_of_a_checkpoint(tmp_path):
    """rt.backward, then optimizer.step() and zero_grad() as torch has it: a checkpoint at the epoch's
    end starts the next epoch on resume."""
    data = torch.utils.data.TensorDataset(torch.arange(12), torch.arange(12) % 2)
    with ddpkit.init(seed=0, checkpoint_dir=str(tmp_path)) as rt:
        net = torch.nn.Embedding(12, 2)
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        loader = rt.loader(data, global_batch_size=4, shuffle=True)
        for _ in rt.epochs(2):
            for x, y in loader:
                rt.backward(F.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            rt.checkpoint({"model": model, "optimizer": optimizer}, blocking=True)
            break
    with ddpkit.init(seed=0, checkpoint_dir=str(tmp_path), resume="auto") as rt:
        net = torch.nn.Embedding(12, 2)
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        loader = rt.loader(data, global_batch_size=4, shuffle=True)
        rt.resume({"model": model, "optimizer": optimizer})
        assert list(rt.epochs(2)) == [1]  # epoch 0 was over


def test_a_stream_resumed_after_its_last_batch_goes_on_to_its_next_epoch(tmp_path):
    """A plain stream (its length unknown) checkpointed after its last batch, before the iterator said
    so: the resumed pass has nothing left, and the step-based loop's next iter(loader) reads on."""

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # noqa: ANN204
            return iter([(torch.tensor([i]), torch.tensor(i % 2)) for i in range(12)])

    def run(rt, steps: int, save_at: int | None = None) -> int:
        net = torch.nn.Embedding(12, 2)
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        loader = rt.loader(Stream(), global_batch_size=4)
        state = {"model": model, "optimizer": optimizer}
        rt.resume(state)
        batches = iter(loader)
        while rt.global_step < steps:
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(loader)
                x, y = next(batches)
            rt.backward(F.cross_entropy(model(x).squeeze(1), y))
            rt.step(optimizer)
            if rt.global_step == save_at:
                rt.checkpoint(state, blocking=True)
        return rt.global_step

    with ddpkit.init(seed=0, checkpoint_dir=str(tmp_path), resume="auto") as rt:
        assert run(rt, 3, save_at=3) == 3  # 3 batches a pass: saved after the last
    with ddpkit.init(seed=0, checkpoint_dir=str(tmp_path), resume="auto") as rt:
        assert run(rt, 7) == 7  # the saved pass is over; the next ones read on


@pytest.mark.parametrize(
    ("length", "drop_last", "said"),
    [(10, True, "its 10 sample(s) fill no global batch of 16"), (0, False, "its dataset holds no sample")],
)
def test_a_loader_that_makes_no_batch_says_so(length, drop_last, said):
    """A dataset smaller than one global batch under drop_last (the batch raised for more processes), or
    an empty split: a DataLoader's pass reads nothing, silently; rt.loader warns once, on rank 0."""
    rt = ddpkit.init(seed=0)
    data = torch.utils.data.TensorDataset(torch.randn(length, 3))
    with pytest.warns(UserWarning, match=rf"^rt.loader: {re.escape(said)}.*so a pass over it reads nothing"):
        loader = rt.loader(data, global_batch_size=16, shuffle=True, drop_last=drop_last)
    assert len(loader) == 0 and list(loader) == []
    with pytest.warns(UserWarning, match=r"^rt.loader: its 10 sample\(s\) fill no global batch of 16"):
        rt.loader(
            torch.utils.data.TensorDataset(torch.randn(40, 3)),
            global_batch_size=16,
            weights=[1.0] * 40,
            num_samples=10,
            drop_last=True,
        )  # the samples drawn an epoch, not the dataset's
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one that makes a batch says nothing
        rt.loader(torch.utils.data.TensorDataset(torch.randn(16, 3)), global_batch_size=16, drop_last=True)
    rt.close()


@pytest.mark.timeout(120)
def test_a_batch_is_weighed_by_its_own_samples_while_another_loader_is_read_beside_it():
    """A validation pass through rt.loader at the top of a training batch's body, or between batches of
    the script's own (read to its end, or left at its last batch): the backward weighed each rank's loss
    by the validation loader's last batch (2 and 1 of 3 samples), and 1 and 2 processes ended apart."""
    two = ddpkit.launch(pass_workers.weighed_beside, nprocs=2)[0]
    one = pass_workers.weighed_beside()
    for kind in ("top", "own", "left"):
        for key, value in one[kind].items():
            assert torch.allclose(two[kind][key], value, rtol=0, atol=1e-12), (kind, key)


class _ReadAhead:
    """timm's PrefetchLoader and apex's data_prefetcher: each batch is handed on once the next is read."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        held = None
        for batch in self.loader:
            if held is not None:
                yield held
            held = batch
        if held is not None:
            yield held


@pytest.mark.parametrize("loop", ["read ahead", "itertools.cycle", "list(loader)", "list, micro_shards"])
def test_batches_kept_from_a_pass_that_ran_out_are_refused_in_one_line(loop):
    """A prefetcher weighed the second-to-last batch by the last one's samples per rank (1 and 2 processes
    apart) and saved a position one batch past the one trained (a resumed run skipped it); cycle and
    list(loader) replay a pass never shuffled anew, which a resumed run cannot find its place in."""
    import itertools

    with ddpkit.init(seed=0) as rt:
        data = torch.utils.data.TensorDataset(torch.randn(20, 3), torch.arange(20) % 2)
        net = torch.nn.Linear(3, 2)
        model, optimizer = rt.setup(
            net, torch.optim.SGD(net.parameters(), lr=0.1), **({"micro_shards": 2} if "micro" in loop else {})
        )
        loader = rt.loader(data, global_batch_size=8, shuffle=True)  # 3 batches
        batches = {"read ahead": _ReadAhead(loader), "itertools.cycle": itertools.cycle(loader)}.get(loop)
        batches = list(loader) if batches is None else batches
        trained = 0
        with pytest.raises(
            ddpkit.UsageError,
            match=r"(this batch is one loader .* handed out before the batch in hand|this backward.s forward ran after loader .* ran out, on a batch kept from its pass): a loop",
        ) as raised:
            for x, y in itertools.islice(batches, 6):
                for xs, ys in rt.shards(x, y) if "micro" in loop else [(x, y)]:
                    rt.backward(F.cross_entropy(model(xs), ys))
                rt.step(optimizer)
                trained += 1
        assert trained == (2 if loop == "read ahead" else 3 if loop == "itertools.cycle" else 0)
        assert "\n" not in str(raised.value)


def test_a_batch_kept_after_its_pass_a_probe_and_a_last_look_are_not_refused():
    """Overfitting one probed batch, a look at the last batch after the pass, and the next pass go on."""
    with ddpkit.init(seed=0) as rt:
        data = torch.utils.data.TensorDataset(torch.randn(20, 3), torch.arange(20) % 2)
        net = torch.nn.Linear(3, 2)
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        loader = rt.loader(data, global_batch_size=8, shuffle=True)
        x, y = next(iter(loader))  # a probe left unfinished: its batch trained again and again
        for _ in range(3):
            rt.backward(F.cross_entropy(model(x), y))
            rt.step(optimizer)
        for x, y in loader:
            rt.backward(F.cross_entropy(model(x), y))
            rt.step(optimizer)
        with torch.no_grad():
            model(x)  # the last batch, looked at after its pass
        for x, y in loader:
            rt.backward(F.cross_entropy(model(x), y))
            rt.step(optimizer)
        orders = []
        for _ in range(2):  # a loss of the whole pass, backward after it (full-batch training), no rt.epochs
            losses, order = [], []
            for x, y in loader:
                losses.append(F.cross_entropy(model(x), y))
                order += x[:, 0].tolist()
            rt.backward(torch.stack(losses).mean())
            rt.step(optimizer)
            orders.append(order)
        assert orders[0] != orders[1]  # the pass fed a step: the next reads the next epoch, as before
        x, y = next(iter(rt.loader(data, global_batch_size=8)))  # a probe of a loader built inline
        rt.backward(F.cross_entropy(model(x), y))
        rt.step(optimizer)
        for x, y in loader:  # a training loop, then steps on batches of the script's own
            rt.backward(F.cross_entropy(model(x), y))
            rt.step(optimizer)
        rt.backward(F.cross_entropy(model(torch.randn(4, 3)), torch.arange(4) % 2))
        rt.step(optimizer)
        assert rt.global_step == 16
