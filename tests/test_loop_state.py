"""The loop state in the loops people write: probes, load before loaders, half-read validation,
several optimizers, accumulation, early stop, worker RNG, save on one rank."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler

import ddpkit
from ddpkit.errors import UsageError
from ddpkit.state.loop import LoopState

sys.path.insert(0, str(Path(__file__).parent))
import loop_workers  # noqa: E402
from loop_workers import EPOCHS, GLOBAL_BATCH, N_TRAIN  # noqa: E402

STEPS_PER_EPOCH = math.ceil(N_TRAIN / GLOBAL_BATCH)


def _run(nprocs: int, fn, *args):
    if nprocs == 1:
        return fn(*args)  # a world of one runs in this process
    return ddpkit.launch(fn, nprocs=nprocs, args=args)[0]


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "nprocs,workers",
    [
        pytest.param(1, 0, marks=pytest.mark.slow),
        (2, 0),
        pytest.param(1, 1, marks=pytest.mark.slow),
    ],  # 1 process, workers: slow
)
def test_real_loop_stopped_at_step_20_resumes_bitwise(tmp_path, nprocs, workers):
    ckpt = str(tmp_path / "ckpt.pt")
    full = _run(nprocs, loop_workers.variations, "full", str(tmp_path / "full.pt"), 20, workers)
    assert full["steps_per_epoch"] == [STEPS_PER_EPOCH] * EPOCHS  # the probe took no batch
    assert full["steps"] == STEPS_PER_EPOCH * EPOCHS

    assert _run(nprocs, loop_workers.variations, "stop", ckpt, 20, workers) == {"stopped": 20}
    resumed = _run(nprocs, loop_workers.variations, "resume", ckpt, 20, workers)
    assert resumed["steps"] == full["steps"]
    # epoch 1 continued after its 7th batch (20 = 13 + 7), then one whole epoch
    assert resumed["steps_per_epoch"] == [STEPS_PER_EPOCH - 7, STEPS_PER_EPOCH]
    assert resumed["lr"] == full["lr"]  # the scheduler came back too
    _assert_bitwise(resumed["weights"], full["weights"])


@pytest.mark.slow  # make test-slow: make test keeps the core of this family (its 15 minutes)
@pytest.mark.timeout(240)
def test_each_rt_epochs_loop_runs_its_own_epochs_and_a_resume_skips_the_loops_before_its_own(tmp_path):
    """A warm-up's rt.epochs(2), then a fine-tuning's rt.epochs(3): the second loop ran one epoch, not 3
    (it went on from the first's count), silently. Each loop now runs its own epochs, numbered from 0,
    while rt.epoch (the loaders' shuffles) goes on; after a break, the next loop begins at the next epoch.
    Stopped inside either stage on 2 processes, the run resumes in it at the same bits."""
    full = ddpkit.launch(loop_workers.stages, nprocs=2, args=(str(tmp_path / "full"),))[0]
    stages = [("warm-up", 0, 0), ("warm-up", 1, 1), ("fine-tuning", 0, 2), ("fine-tuning", 1, 3), ("fine-tuning", 2, 4)]
    assert full["seen"] == stages and full["steps"] == 5 * 5
    # saved at step 16, in the fine-tuning's second epoch: the resumed run skips the warm-up's loop
    assert ddpkit.launch(loop_workers.stages, nprocs=2, args=(str(tmp_path / "stopped"), 18))[0]["steps"] == 18
    resumed = ddpkit.launch(loop_workers.stages, nprocs=2, args=(str(tmp_path / "stopped"),))[0]
    assert resumed["seen"] == stages[3:] and resumed["steps"] == full["steps"]
    _assert_bitwise(resumed["weights"], full["weights"])
    # one process: saved at step 8, in the warm-up's second epoch, which the resumed run goes on with
    whole = loop_workers.stages(str(tmp_path / "whole"))
    assert loop_workers.stages(str(tmp_path / "warm"), 9)["steps"] == 9
    resumed = loop_workers.stages(str(tmp_path / "warm"))
    assert resumed["seen"] == stages[1:] and resumed["steps"] == whole["steps"]
    _assert_bitwise(resumed["weights"], whole["weights"])
    left = loop_workers.stages(str(tmp_path / "left"), None, 2)  # warm-up left by break in its first epoch
    assert left["seen"] == [("warm-up", 0, 0), ("fine-tuning", 0, 1), ("fine-tuning", 1, 2), ("fine-tuning", 2, 3)]
    # saved after the break, between the loops, and stopped in the fine-tuning before its first save: the
    # resumed run skips the warm-up it had left (it trained the warm-up's next epoch again)
    assert loop_workers.stages(str(tmp_path / "between"), 3, 2, True)["steps"] == 3
    resumed = loop_workers.stages(str(tmp_path / "between"), None, 2, True)
    assert resumed["seen"] == left["seen"][1:]
    _assert_bitwise(resumed["weights"], left["weights"])


@pytest.mark.timeout(240)
def test_end_of_epoch_checkpoint_with_half_read_validation_goes_on_with_the_next_epoch(tmp_path):
    full = loop_workers.variations("full", str(tmp_path / "run.pt"))
    end_of_epoch_0 = str(tmp_path / "run.pt.epoch0")
    resumed = loop_workers.variations("resume", end_of_epoch_0)
    assert resumed["steps_per_epoch"] == [STEPS_PER_EPOCH] * (EPOCHS - 1)  # epoch 0 not repeated
    _assert_bitwise(resumed["weights"], full["weights"])


def test_loader_built_after_load_that_differs_is_a_clear_error(tmp_path):
    rt = ddpkit.init(seed=1)
    model = torch.nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = rt.loader(loop_workers.Toy(20), global_batch_size=4, shuffle=True)
    for step, (x, y) in enumerate(train):
        rt.backward(torch.nn.functional.cross_entropy(model(x), y))
        rt.step(opt)
        if step == 1:
            break_at = rt.save(tmp_path / "c.pt", {"model": model})
            break
    rt._run.loop = LoopState()  # a fresh run of the same script
    rt.load(break_at, {"model": model})
    with pytest.raises(ddpkit.DdpkitError, match="global batches of 4.*this loader has.*global batches of 5"):
        rt.loader(loop_workers.Toy(20), global_batch_size=5, shuffle=True)


def test_saved_position_that_matches_no_loader_is_an_error_or_a_warning(tmp_path):
    rt = ddpkit.init(seed=1)
    model = torch.nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = rt.loader(loop_workers.Toy(20), global_batch_size=4, shuffle=True, name="train")
    batches = iter(train)  # held: the pass is still open when we save
    x, y = next(batches)
    rt.backward(torch.nn.functional.cross_entropy(model(x), y))
    rt.step(opt)
    path = rt.save(tmp_path / "c.pt", {"model": model})
    for strict in (True, False):
        rt._run.loop = LoopState()
        rt.load(path, {"model": model}, strict=strict)
        other = rt.loader(loop_workers.Toy(20), global_batch_size=4, shuffle=True, name="renamed")
        x, y = next(iter(other))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if strict:
            with pytest.raises(ddpkit.DdpkitError, match="'train'.*no loader with that identity"):
                rt.backward(loss)
        else:
            with pytest.warns(UserWarning, match="'train'.*starts over"):
                rt.backward(loss)
        del other


def test_each_iter_starts_the_epoch_and_break_ends_it():
    rt = ddpkit.init(seed=2)
    loader = rt.loader(list(range(10)), global_batch_size=2, shuffle=True)
    first = next(iter(loader)).tolist()
    assert [b.tolist() for b in loader][0] == first  # the probe consumed nothing
    for _ in loader:
        break
    assert loader.finished  # `break` ends the pass


def test_two_optimizers_one_step_one_scaler_update():
    rt = ddpkit.init(seed=0, precision="fp16")
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    updates = []
    real_update = rt.precision.scaler.update
    rt.precision.scaler.update = lambda *args: (updates.append(1), real_update(*args))[1]
    for _i in range(3):
        with rt.autocast():
            loss = b(a(torch.randn(8, 4))).float().mean()
        rt.backward(loss)
        rt.step(opt_a)
        rt.step(opt_b)  # the same step: counted once
    rt.precision.flush()
    assert rt.global_step == 3
    assert len(updates) == 3
    with rt.autocast():
        loss = b(a(torch.randn(8, 4))).float().mean()
    rt.backward(loss)
    rt.step(opt_a, opt_b)  # both in one call
    assert rt.global_step == 4


def test_step_reports_an_fp16_skip_so_the_scheduler_can_follow():
    rt = ddpkit.init(seed=0, precision="fp16")
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    x[0, 0] = float("inf")
    with rt.autocast():
        loss = model(x).float().mean()
    rt.backward(loss)
    before = model.weight.detach().clone()
    assert rt.step(opt) is False
    assert torch.equal(model.weight, before)


def test_clip_grad_norm_unscales_fp16_and_only_clips_on_the_syncing_micro_step():
    results = {}
    for precision in ("fp32", "fp16"):
        rt = ddpkit.init(seed=0, precision=precision)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = rt.setup(model, opt)
        norms = []
        x = torch.arange(32.0).reshape(8, 4) / 1000  # small: no fp16 overflow at the first scale
        loader = rt.loader(list(zip(x, x.sum(1, keepdim=True))), global_batch_size=2)
        for xb, yb in loader:
            with rt.accumulate(model, 2):
                with rt.autocast():
                    loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
                rt.backward(loss)
                norms.append(rt.clip_grad_norm_(model, 1.0))
                rt.step(opt)
        results[precision] = norms
        rt.close()
    assert [n is None for n in results["fp32"]] == [True, False, True, False]
    for ours, reference in zip(results["fp16"], results["fp32"]):
        if reference is not None:  # fp16 norms are of unscaled gradients: close to fp32's
            assert math.isclose(float(ours), float(reference), rel_tol=2e-2)


def test_should_stop_is_false_until_a_rank_says_so():
    rt = ddpkit.init()
    assert rt.should_stop(False) is False
    assert rt.should_stop(True) is True


def _should_stop_worker() -> list:
    rt = ddpkit.init()
    return [rt.should_stop(rt.rank == 1 and i == 2) for i in range(4)]


@pytest.mark.timeout(120)
def test_should_stop_agrees_across_ranks():
    results = ddpkit.launch(_should_stop_worker, nprocs=2)
    assert results[0] == results[1] == [False, False, True, False]


@pytest.mark.timeout(120)
def test_worker_global_rng_differs_across_ranks_and_epochs():
    draws = ddpkit.launch(loop_workers.worker_draws, nprocs=2, args=(1,))
    rank0, rank1 = draws[0], draws[1]
    for epoch in (0, 1):
        flat0 = [v for batch in rank0[epoch] for row in batch for v in row]
        flat1 = [v for batch in rank1[epoch] for row in batch for v in row]
        assert not set(flat0) & set(flat1)  # torch, numpy and random all differ
    assert rank0[0] != rank0[1]  # and each epoch draws anew
    again = ddpkit.launch(loop_workers.worker_draws, nprocs=2, args=(1,))
    assert again == draws  # keyed by (seed, epoch, rank, worker)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "stream", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["map-style", "stream"]
)  # (stream: make test-slow)
def test_a_transform_drawing_from_the_global_generators_draws_alike_on_any_world_size_and_workers(stream):
    """torchvision's random transforms draw from torch's global generator, albumentations from numpy's,
    a flip written by hand from ``random``'s: inside a sample's read each is keyed by (seed, epoch,
    index), and put back after, so the loop's own streams are untouched."""
    one = loop_workers.global_draws(0, stream=stream)
    two = ddpkit.launch(loop_workers.global_draws, nprocs=2, args=(2, True, stream))[0]  # 2 processes, 2 workers each
    assert len(one["seen"]) == 2 * 32 and one["seen"] == two["seen"]
    assert all(
        one["seen"][f"0,{i}"][k] != one["seen"][f"1,{i}"][k] for i in range(32) for k in range(3)
    )  # each epoch anew
    assert all(len({v[k] for v in one["seen"].values()}) == 64 for k in range(3))  # every sample its own, in each
    quiet = loop_workers.global_draws(0, draws=False, stream=stream)  # a dataset that draws nothing
    assert one["outside"] == quiet["outside"]  # the reads left the main process's streams as they were


def test_a_persistent_workers_own_seeding_goes_on_into_the_next_epoch():
    """A persistent worker reading a new epoch was seeded again from (seed, epoch, rank, worker), over
    the streams its worker_init_fn seeded (torch's persistent workers run it once and go on)."""
    import random

    import numpy as np

    rt = ddpkit.init(seed=0)
    loader = rt.loader(
        _SeenByWorker(), batch_size=2, num_workers=1, persistent_workers=True, worker_init_fn=_user_worker_init
    )
    rows = [row for _ in rt.epochs(2) for batch in loader for row in batch.tolist()]
    torch.manual_seed(1234)
    np.random.seed(5678)
    random.seed(91)
    assert [row[1:] for row in rows] == [
        [float(torch.rand(())), float(np.random.rand()), random.random()] for _ in range(8)
    ]
    rt.close()


def test_a_worker_init_fn_that_draws_or_follows_pytorchs_seed_worker_keeps_the_reads_keyed():
    """Only a seed of the script's own takes a generator out of the keyed reads (the test above): one
    draw right after ddpkit seeds the worker regenerates numpy's and ``random``'s words, which a check
    of the words took for a seeding; PyTorch's ``seed_worker`` recipe asks for workers that draw apart."""
    keyed = loop_workers.global_draws(2)["seen"]
    assert loop_workers.global_draws(2, worker_init="drawing_worker_init")["seen"] == keyed
    assert loop_workers.global_draws(2, worker_init="recipe_worker_init")["seen"] == keyed


def test_only_datasets_that_run_no_code_of_the_scripts_skip_the_keyed_reads():
    from torch.utils.data import ConcatDataset, Subset, TensorDataset

    from ddpkit.loop.loader import draws_nothing
    from ddpkit.recipes.datasets import InMemoryDataset, TokenSequences

    tensors = TensorDataset(torch.zeros(4, 2))
    images = InMemoryDataset(torch.zeros(4, 1, 2, 2, dtype=torch.uint8), torch.zeros(4))
    assert draws_nothing(tensors) and draws_nothing(Subset(ConcatDataset([tensors, images]), [0, 5]))
    assert draws_nothing(TokenSequences(torch.zeros(4, 3, dtype=torch.long)))

    class Flipped(InMemoryDataset):  # a subclass may draw: it is keyed
        def __getitem__(self, index: int):
            x, y = super().__getitem__(index)
            return (x.flip(-1) if torch.rand(()) < 0.5 else x), y

    class Noisy(TensorDataset):
        pass

    flipped = Flipped(torch.zeros(4, 1, 2, 2, dtype=torch.uint8), torch.zeros(4))
    assert not draws_nothing(flipped) and not draws_nothing(Noisy(torch.zeros(2)))
    assert not draws_nothing(ConcatDataset([tensors, flipped])) and not draws_nothing(loop_workers.Augmented())


@pytest.mark.timeout(120)
def test_save_on_rank_0_only_is_a_mismatch_naming_save_in_seconds(tmp_path, capfd):
    with pytest.raises(ddpkit.LaunchError) as caught:
        ddpkit.launch(loop_workers.rank0_only_save, nprocs=2, args=(str(tmp_path / "c.pt"),))
    assert "exit code 123: the ranks called different collectives" in str(caught.value)
    said = capfd.readouterr().err
    assert re.search(r"rank 0: in its collective #\d+: rt\.save\(\) at .*loop_workers\.py:\d+", said), said[-2000:]
    assert "rt.save must be called on every rank (it gathers each rank's random state; ddpkit writes" in said
    assert not (tmp_path / "c.pt").exists()


@pytest.mark.slow  # make test-slow: make test keeps the core of this family (its 15 minutes)
@pytest.mark.timeout(120)
def test_save_on_rank_0_only_without_the_watchdog_fails_with_one_line_naming_save(tmp_path):
    with pytest.raises(ddpkit.LaunchError) as caught:
        ddpkit.launch(loop_workers.rank0_only_save, nprocs=2, args=(str(tmp_path / "c.pt"), 0))
    message = str(caught.value).splitlines()[0]
    assert "rank 0" in message and "rt.save must be called on every rank" in message
    assert "rank(s) 1 did not reach it" in message  # the store's check, after save_timeout
    assert not (tmp_path / "c.pt").exists()


def test_second_init_with_other_settings_is_refused():
    rt = ddpkit.init(precision="fp32")
    assert ddpkit.init(precision="fp32") is rt
    with pytest.raises(ddpkit.UsageError, match="precision='bf16' \\(running: 'fp32'\\)"):
        ddpkit.init(precision="bf16")


@pytest.mark.slow  # 12 s: torch.compile
def test_compiled_model_checkpoints_plain_names(tmp_path):
    rt = ddpkit.init(seed=0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt, compile=True)
    for _ in range(2):
        rt.backward(model(torch.randn(8, 4)).pow(2).mean())
        rt.step(opt)
    path = rt.save(tmp_path / "c.pt", {"model": model}, blocking=True)  # read right after
    saved = ddpkit.checkpoint.read(path)["user"]["model"]
    assert sorted(saved) == ["0.bias", "0.weight", "2.bias", "2.weight"]


@pytest.mark.timeout(240)
def test_save_inside_an_accumulation_group_resumes_bitwise(tmp_path):
    ckpt = str(tmp_path / "acc.pt")
    full = ddpkit.launch(loop_workers.accumulation, nprocs=2, args=("full", ckpt))[0]
    assert full["steps"] == 2 * 4  # 10 batches an epoch: groups of 3, 3, 3, 1
    assert ddpkit.launch(loop_workers.accumulation, nprocs=2, args=("stop", ckpt))[0] == {"micro_step": 1}
    resumed = ddpkit.launch(loop_workers.accumulation, nprocs=2, args=("resume", ckpt))[0]
    assert resumed["batches"] == 20 - 4 and resumed["steps"] == full["steps"]
    assert resumed["weights"] == full["weights"]


@pytest.mark.timeout(240)
def test_a_save_between_a_backward_and_its_step_is_refused_on_every_rank_in_one_line(tmp_path):
    """Accumulation by hand: a checkpoint would hold the last step's weights without the gradients
    gathered since, so a resumed run would not continue this one. Refused before anything is written,
    on every rank (no rank left waiting for the save); after the step, or once they are dropped, it saves."""
    runs = {
        where: ddpkit.launch(loop_workers.saved_before_its_step, nprocs=2, args=(str(tmp_path / where), where))
        for where in ("mid-group", "stepped")
    }
    for rank in (0, 1):
        said = runs["mid-group"][rank]["raised"]
        assert said is not None and said.startswith("rt.checkpoint at step 0: the gradients of rt.backward since")
        assert "rt.accumulate(model, k)" in said and "\n" not in said
    assert runs["mid-group"][0]["written"] == []
    assert [r["raised"] for r in runs["stepped"].values()] == [None, None]
    assert runs["stepped"][0]["written"] == ["ckpt-step00000001.pt"]
    # one process: a pass whose odd last batch carries its gradients into the next; gradients dropped
    tail = loop_workers.saved_before_its_step(str(tmp_path / "tail"), "tail")
    assert tail["raised"] is not None and tail["raised"].startswith("rt.checkpoint at step 1:")
    assert tail["written"] == []
    dropped = loop_workers.saved_before_its_step(str(tmp_path / "dropped"), "dropped")
    assert dropped == {"raised": None, "written": ["ckpt-step00000000.pt"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("blocking", [pytest.param(True, marks=pytest.mark.slow), False])  # (blocking: make test-slow)
def test_failed_write_on_rank_0_raises_on_every_rank(tmp_path, blocking):
    blocker = tmp_path / "a-file"
    blocker.write_text("occupied")  # rank 0 cannot write beneath a file
    results = ddpkit.launch(loop_workers.failed_write, nprocs=2, args=(str(blocker / "c.pt"), blocking))
    assert results[0]["raised"] is not None
    assert results[1]["raised"] == "DdpkitError" and "rank 0 failed" in results[1]["message"]
    assert "could not write checkpoint" in results[1]["message"]
    if not blocking:  # raised at the next save, on every rank, naming the write that failed
        assert results[0]["raised"] == "DdpkitError" and "in the background" in results[0]["message"]
        assert "in the background" in results[1]["message"] and "c.pt" in results[1]["message"]
    assert blocker.read_text() == "occupied"  # nothing lost


@pytest.mark.timeout(120)
def test_ddp_gradients_are_bucket_views_where_asked_and_never_on_cpu_by_default():
    default = ddpkit.launch(loop_workers.bucket_views, nprocs=2)[0]
    assert default["storages"] == [4, 4, 4]  # on CPU each gradient has its own storage
    assert default["cleared"] == [True, True, True]  # rt.step sets them to None (PyTorch's default)
    views = ddpkit.launch(loop_workers.bucket_views, nprocs=2, args=(True,))[0]
    assert views["storages"] == [1, 1, 1]  # all four gradients share one bucket's storage
    assert views["cleared"] == [True, True, True]


@pytest.mark.timeout(120)
def test_weighted_sampling_is_the_same_for_any_world_size():
    one = loop_workers.weighted_batches(8)
    two = ddpkit.launch(loop_workers.weighted_batches, nprocs=2, args=(8,))[0]
    assert one == two and len(one) == 2
    drawn = [i for batch in one for i in batch]
    assert not any(i < 5 for i in drawn)  # zero weight: never drawn
    # a DataLoader with a WeightedRandomSampler draws the same, on one process and on two
    assert ddpkit.launch(loop_workers.weighted_batches, nprocs=2, args=(8, True))[0] == one
    assert loop_workers.weighted_batches(8, True) == one


def _batches(loader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def test_a_dataloader_given_to_rt_loader_reads_its_dataset_with_its_batch_size_as_the_global_batch():
    data = list(range(11))
    twice = lambda samples: torch.tensor(samples) * 2  # noqa: E731 - a collate_fn of the script's
    rt = ddpkit.init(seed=4)
    try:
        plain = DataLoader(data, batch_size=4)
        assert _batches(rt.loader(plain)) == _batches(plain)  # in order: the DataLoader's own batches
        shuffled = rt.loader(DataLoader(data, batch_size=4, shuffle=True, drop_last=True, collate_fn=twice))
        alike = rt.loader(data, global_batch_size=4, shuffle=True, drop_last=True, collate_fn=twice, name="alike")
        assert _batches(shuffled) == _batches(alike) and len(_batches(alike)) == 2
        assert sorted(i for b in _batches(alike) for i in b) != [2 * i for i in range(8)]  # shuffled, doubled
        assert all(i % 2 == 0 for b in _batches(alike) for i in b)
        # what the script gives beside it wins: 3 a process here
        assert [len(b) for b in _batches(rt.loader(plain, batch_size=3, name="three"))] == [3, 3, 3, 2]
        # workers given up beside it: the DataLoader's worker options go too (torch refuses them alone)
        workers = DataLoader(data, batch_size=4, num_workers=2, prefetch_factor=4, persistent_workers=True)
        assert _batches(rt.loader(workers, num_workers=0, name="inline")) == _batches(plain)
        uniform = torch.utils.data.RandomSampler(data, replacement=True, num_samples=6)
        drawn = _batches(rt.loader(DataLoader(data, batch_size=3, sampler=uniform), name="uniform"))
        assert [len(b) for b in drawn] == [3, 3]  # num_samples a epoch, drawn with replacement
    finally:
        rt.close()


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda d: DataLoader(d, batch_size=None), "does not batch (batch_size=None)"),
        (
            lambda d: DataLoader(d, batch_sampler=[[0, 1], [2]]),
            "makes its batches with its list, and rt.loader cuts the global batches itself",
        ),
        (
            lambda d: DataLoader(d, batch_size=2, sampler=DistributedSampler(d, num_replicas=2, rank=0)),
            "DistributedSampler splits the data over the ranks, and rt.loader splits it itself",
        ),
        (
            lambda d: DataLoader(d, batch_size=2, sampler=WeightedRandomSampler([1.0] * 6, 4, replacement=False)),
            "WeightedRandomSampler draws without replacement",
        ),
        (
            lambda d: DataLoader(d, batch_size=2, sampler=RandomSampler(d, num_samples=3)),
            "RandomSampler draws without replacement",
        ),
        (lambda d: DataLoader(d, batch_size=2, sampler=[5, 4, 3]), "list picks its samples"),
    ],
)
def test_a_dataloader_whose_samples_rt_loader_cannot_draw_alike_is_refused_in_one_line(make, said):
    rt = ddpkit.init()
    try:
        with pytest.raises(UsageError, match=re.escape(said)) as refused:
            rt.loader(make(list(range(6))))
        assert "\n" not in str(refused.value) and "rt.loader(loader.dataset, " in str(refused.value)
    finally:
        rt.close()


def test_fresh_run_in_a_used_out_dir_starts_its_metrics_anew(tmp_path):
    import json

    for run in range(2):
        rt = ddpkit.init(out_dir=tmp_path)
        for step in range(3):
            rt.global_step = step
            rt.log({"loss": float(run)})
        rt.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["loss"] for row in rows] == [1.0, 1.0, 1.0]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_save_on_rank_0_only_under_ddpkit_run_with_default_settings_is_named_in_seconds(tmp_path):
    from helpers import ddpkit as ddpkit_cli

    script = tmp_path / "rank0_save.py"
    script.write_text(
        "import torch, ddpkit\n"
        "rt = ddpkit.init()\n"
        "model = rt.setup(torch.nn.Linear(2, 1))\n"
        "if rt.is_main:\n"
        f"    rt.save({str(tmp_path / 'c.pt')!r}, {{'model': model}})\n"
    )
    result = ddpkit_cli("run", "-n", "2", str(script), timeout=170)
    assert result.returncode == 123, result.stderr[-2000:]
    # the watchdog's mismatch report, not the 600 s collective timeout (nor the store's 60 s), ended it
    assert re.search(r"rank 0: in its collective #1: rt\.save\(\) at .*rank0_save\.py:5", result.stderr)
    assert "rank 0 waits in its collective #1, which rank 1 never calls: it finished after 0" in result.stderr


def test_model_compiled_before_setup_checkpoints_plain_names(tmp_path):
    rt = ddpkit.init(seed=0)
    # backend="eager": an OptimizedModule (its names prefixed _orig_mod.) without inductor's build time
    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 2)), backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt)
    rt.backward(model(torch.randn(3, 4)).sum())
    rt.step(opt)
    path = rt.save(tmp_path / "c.pt", {"model": model}, blocking=True)  # read right after
    assert sorted(ddpkit.checkpoint.read(path)["user"]["model"]) == ["0.bias", "0.weight"]
    rt.load(path, {"model": torch.nn.Sequential(torch.nn.Linear(4, 2))})  # loads into a plain model


class _SeenByWorker(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        import os
        import random

        import numpy as np

        drawn = [float(torch.rand(())), float(np.random.rand()), random.random()]
        return torch.tensor([float(os.environ.get("DDPKIT_TEST_WORKER_INIT", "-1")), *drawn], dtype=torch.float64)


def _user_worker_init(worker_id: int) -> None:
    import os
    import random

    import numpy as np

    os.environ["DDPKIT_TEST_WORKER_INIT"] = str(worker_id + 10)
    torch.manual_seed(1234)  # the user's seeding runs after ddpkit's, and wins
    np.random.seed(5678)  # (the usual fix for workers that drew alike)
    random.seed(91)


def test_worker_init_fn_prefetch_and_persistent_workers_reach_the_dataloader(monkeypatch):
    made = {}
    real_init = torch.utils.data.DataLoader.__init__

    def spy(self, *args, **kwargs):
        made.update(kwargs)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(torch.utils.data.DataLoader, "__init__", spy)
    rt = ddpkit.init(seed=0)
    loader = rt.loader(
        _SeenByWorker(),
        batch_size=2,
        num_workers=1,
        prefetch_factor=3,
        persistent_workers=False,
        pin_memory=False,
        worker_init_fn=_user_worker_init,
    )
    assert (made["prefetch_factor"], made["persistent_workers"], made["pin_memory"]) == (3, False, False)
    rows = [row for batch in loader for row in batch.tolist()]
    assert [row[0] for row in rows] == [10.0] * 4  # the user's function ran in the worker
    torch.manual_seed(1234)
    assert [row[1] for row in rows] == [float(torch.rand(())) for _ in range(4)]  # and seeded last
    import random

    import numpy as np

    np.random.seed(5678)
    random.seed(91)
    assert [row[2:] for row in rows] == [[float(np.random.rand()), random.random()] for _ in range(4)]  # numpy, random


def test_resume_says_on_rank_0_where_it_goes_on_from(tmp_path, capsys):
    """As Lightning's "Restored all states from the checkpoint at ...": one line naming the file, the
    step and whether the epoch goes on; nothing where there was nothing to resume."""
    data = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randint(0, 2, (8,)))

    def attempt(stop: int) -> str:
        with ddpkit.init(seed=0, checkpoint_dir=str(tmp_path), resume="auto") as rt:
            net = torch.nn.Linear(2, 2)
            model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
            state = {"model": model, "optimizer": optimizer}
            rt.resume(state)
            said = capsys.readouterr().err
            for _ in rt.epochs(2):
                for x, y in rt.loader(data, global_batch_size=4):
                    rt.backward(torch.nn.functional.cross_entropy(model(x), y))
                    rt.step(optimizer)
                    if rt.global_step == stop:
                        rt.checkpoint(state, blocking=True)
                        return said
        return said

    assert "ddpkit: resumed" not in attempt(stop=1)
    state = LoopState()
    state.restore({**LoopState().state_dict(), "step": 7, "driven": False}, source="x")
    assert state.resumed_at() == "step 7"  # a step-based loop's epochs are each loader's own
    assert f"ddpkit: resumed from {tmp_path / 'ckpt-step00000001.pt'}: step 1, inside epoch 0\n" in attempt(stop=2)
    assert f"ddpkit: resumed from {tmp_path / 'ckpt-step00000002.pt'}: step 2, at the start of epoch 1\n" in attempt(0)


def test_a_restart_is_said_on_rank_0_with_the_restarts_left():
    from ddpkit.distributed.environment import Environment, detect
    from ddpkit.runtime.start import _restart_line

    elastic = {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3"}
    line = _restart_line(detect(elastic), {})
    assert line == "ddpkit: restart 1 of 3: a worker failed (its output is above); every worker starts again"
    replica = _restart_line(Environment(restart_count=2), {"DDPKIT_FT_REPLICA": "1"})
    assert replica.startswith("ddpkit: restart 2: a worker failed") and replica.endswith(
        "replica 1's workers start again"
    )


class _Pool(torch.utils.data.Dataset):
    """Active learning's labeled pool: samples are added between epochs."""

    def __init__(self) -> None:
        self.labeled = list(range(8))

    def __len__(self) -> int:
        return len(self.labeled)

    def __getitem__(self, i: int):
        return torch.tensor(self.labeled[i]), torch.tensor(self.labeled[i] % 2)


@pytest.mark.parametrize("rebuilt", [False, True])
def test_a_dataset_that_grows_between_epochs_is_read_whole_or_refused_in_one_line(rebuilt):
    """A loader built once over a pool that grew read only its first 8 samples every epoch, silently,
    where a DataLoader's RandomSampler reads the new ones too. Built anew each epoch, it reads them all."""
    pool = _Pool()
    with ddpkit.init(seed=0) as rt:
        net = torch.nn.Embedding(40, 2)
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        loader = rt.loader(pool, global_batch_size=4, shuffle=True)
        for epoch in rt.epochs(3):
            if rebuilt:
                loader = rt.loader(pool, global_batch_size=4, shuffle=True)
            elif epoch == 1:
                with pytest.raises(UsageError, match="its dataset holds 16 samples now and held 8 when the loader"):
                    iter(loader).__next__()
                return
            seen = []
            for x, y in loader:
                seen += x.tolist()
                rt.backward(torch.nn.functional.cross_entropy(model(x), y))
                rt.step(optimizer)
            assert sorted(seen) == list(range(8 * (epoch + 1)))
            pool.labeled += list(range(len(pool), len(pool) + 8))


def _children() -> int:
    import os

    mine = str(os.getpid())
    count = 0
    for entry in os.listdir("/proc"):
        try:
            count += entry.isdigit() and open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1] == mine
        except OSError:  # (gone meanwhile)
            pass
    return count


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="counts child processes through /proc")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("leave", [False, True])
def test_a_loader_built_anew_each_epoch_frees_its_persistent_workers_with_it(leave):
    """The loader of the epoch before was held by rt.epochs across its yield, and by a cycle through its
    DataLoader that only the cyclic collector frees: persistent workers piled up, two more processes an
    epoch (10 after 5 epochs). Now each is freed when the script drops it, by reference counting alone."""
    import gc
    import weakref

    data = torch.utils.data.TensorDataset(torch.arange(16), torch.arange(16) % 2)
    before, built = _children(), []
    gc.disable()  # nothing but reference counting frees them
    try:
        with ddpkit.init(seed=0) as rt:
            net = torch.nn.Embedding(16, 2)
            model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
            for _ in rt.epochs(4):
                loader = rt.loader(data, global_batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)
                built.append(weakref.ref(loader))
                for batch, (x, y) in enumerate(loader):
                    rt.backward(torch.nn.functional.cross_entropy(model(x), y))
                    rt.step(optimizer)
                    if leave and batch == 1:  # a pass left by break (its DataLoader iterator kept)
                        break
                assert [made() is not None for made in built[:-1]] == [False] * (len(built) - 1)
                # this epoch's loader's workers at most (a child of an earlier test may end meanwhile)
                assert _children() - before <= 2
    finally:
        gc.enable()


def test_samples_a_collate_fn_left_out_are_refused_in_one_line_and_counted_train_alike_on_any_world_size():
    """A dataset that returns None for a sample that fails to decode, and a collate_fn that leaves those
    out: rt.backward weighed the batch's mean loss by the samples its loader handed out, so 1 and 2
    processes ended 8e-3 apart, silently. Now rt.backward says so; with count=len(y) they agree (bitwise
    under micro_shards)."""
    # a stream collated by its one worker, or by the main process from two workers' pieces cut into shards
    for stream, num_workers, micro_shards in ((False, 0, 0), (True, 0, 0), (True, 1, 0), (True, 2, 2)):
        with pytest.raises(UsageError, match=r"rt\.backward: 1 of this rank's 8 samples came as None and the collate"):
            loop_workers.corrupt_samples(False, micro_shards, stream, num_workers)
    for micro_shards in (0, 2):
        one = loop_workers.corrupt_samples(True, micro_shards)
        two = ddpkit.launch(loop_workers.corrupt_samples, nprocs=2, args=(True, micro_shards))[0]
        if micro_shards:
            _assert_bitwise(one, two)
        else:
            assert all(torch.allclose(one[key], two[key], rtol=0, atol=1e-6) for key in one)


def test_predict_refuses_outputs_that_are_not_one_row_per_sample_where_a_collate_fn_left_samples_out(tmp_path):
    """predict returned 27 rows for 32 samples "in dataset order", and predict_to_file wrote them: row i
    was no longer sample i. Both now refuse in one line, on every rank, leaving no file."""
    with ddpkit.init(seed=0) as rt:
        model = rt.setup(torch.nn.Linear(4, 2))
        data = loop_workers.Corrupt()
        with pytest.raises(UsageError, match=r"^predict: the outputs hold 27 rows for the 32 samples read, so they"):
            ddpkit.predict(model, data, collate_fn=loop_workers.skip_none, batch_size=8)
        out = tmp_path / "preds.npy"
        with pytest.raises(UsageError, match=r"^predict_to_file: the outputs hold 27 rows for the 32 samples read"):
            ddpkit.predict_to_file(model, DataLoader(data, batch_size=8, collate_fn=loop_workers.skip_none), out)
        assert list(tmp_path.iterdir()) == []
        kept = ddpkit.predict(model, torch.utils.data.Subset(data, [0, 1, 2, 4]), collate_fn=loop_workers.skip_none)
        assert kept.shape == (4, 2)  # one row a sample: as before
