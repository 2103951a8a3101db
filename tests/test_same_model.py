"""Ranks that hold different models: a checkpoint loaded on rank 0 alone after ``rt.setup`` trained
each rank's own weights to the end, and ``ddpkit.evaluate``/``predict`` of a model built unseeded (or
an EMA of weights that replicas train apart) joined several models' shards into one metric, silently.
Now the first ``rt.step`` and every evaluation compare each tensor's bits across ranks and say which."""

from __future__ import annotations

import pytest
import torch

import ddpkit
import workers
from ddpkit.parallel import same_model


@pytest.mark.timeout(120)
def test_weights_loaded_on_rank_0_alone_after_setup_are_refused_at_the_first_step():
    for rank, found in ddpkit.launch(workers.differing_ranks, nprocs=2, args=("loaded-on-main",)).items():
        assert found["steps"] == 0, (rank, found)  # before the optimizer took a step
        assert found["error"].startswith(
            "rt.step: the model's weights differ between ranks at the first step (rank 1's weight differs from rank 0's)"
        ), found["error"]
        assert "not on rank 0 alone" in found["error"], found["error"]
    for rank, found in ddpkit.launch(workers.differing_ranks, nprocs=2, args=("loaded-everywhere",)).items():
        assert found["error"] is None and found["steps"] == 4, (rank, found)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["unseeded", "ema"])
def test_evaluate_and_predict_refuse_a_model_that_differs_between_ranks(case):
    runs = ddpkit.launch(workers.differing_ranks, nprocs=2, args=(case,))
    name = "weight" if case == "unseeded" else "module.weight"
    for rank, found in runs.items():
        assert found["error"] is not None and found["error"].startswith(
            f"ddpkit.evaluate: the model differs between ranks (rank 1's {name} differs from rank 0's)"
        ), (rank, found["error"])
        assert "metrics" not in found
    assert not torch.equal(runs[0]["state"][name], runs[1]["state"][name])  # they do differ


@pytest.mark.timeout(120)
def test_a_seeded_model_evaluates_and_predicts_as_one_process_does():
    runs = ddpkit.launch(workers.differing_ranks, nprocs=2, args=("seeded",))
    one = workers.differing_ranks("seeded")
    for rank, found in runs.items():
        assert found["error"] is None, (rank, found["error"])
        assert found["metrics"]["count"] == 64 and found["metrics"]["accuracy"] == one["metrics"]["accuracy"]
        assert torch.equal(found["predicted"], one["predicted"]), rank


@pytest.mark.timeout(120)
def test_a_ddp_model_that_broadcasts_its_buffers_is_evaluated_with_rank_0s():
    """A buffer besides BatchNorm's keeps DDP's broadcast, so each rank's statistics are its own after
    the last forward: evaluate takes rank 0's first, as the DDP model's next forward would."""
    runs = ddpkit.launch(workers.differing_ranks, nprocs=2, args=("buffers",))
    assert runs[0]["error"] is None and runs[1]["error"] is None, runs
    model = workers._Counting()
    model.load_state_dict(runs[0]["state"])  # rank 0's model, on one process
    expected = ddpkit.evaluate(model, torch.utils.data.TensorDataset(*_digits_like()), num_classes=3)
    for rank, found in runs.items():
        assert torch.equal(found["state"]["net.1.running_mean"], runs[0]["state"]["net.1.running_mean"]), rank
        for metrics in (found["inner_metrics"], found["metrics"]):  # model.module, then the DDP model
            assert metrics["accuracy"] == expected["accuracy"], rank
            assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-6), rank


def _digits_like() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)  # workers.differing_ranks's data
    return torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.bfloat16, torch.complex128, torch.int64, torch.uint8, torch.bool]
)
def test_the_fingerprint_tells_one_bit_apart_in_any_order(dtype):
    base = torch.linspace(-3, 3, 101, dtype=torch.float64)
    one = (base > 0) if dtype == torch.bool else (base * 40 + 125 if not dtype.is_floating_point else base).to(dtype)
    other = one.clone()
    if dtype == torch.bool:
        other[0] = ~other[0]
    elif dtype.is_complex:  # its real part's next float
        other.view(torch.float64)[0] = torch.nextafter(one.real[0], torch.tensor(10.0, dtype=torch.float64))
    elif not dtype.is_floating_point:
        other[0] += 1
    else:
        other[0] = torch.nextafter(other[0], torch.tensor(10.0, dtype=dtype))  # the next float: one ulp
    module, moved = torch.nn.Module(), torch.nn.Module()
    module.register_buffer("t", one)
    moved.register_buffer("t", one.flip(0))  # an exact sum: the order the threads add in cannot change it
    changed = torch.nn.Module()
    changed.register_buffer("t", other)
    names, sums = same_model.fingerprint(module)
    assert names == ["buffer t"] and sums.dtype == torch.int64
    assert torch.equal(same_model.fingerprint(moved)[1], sums)
    assert not torch.equal(same_model.fingerprint(changed)[1], sums)
    assert same_model.differs(module) is None  # one process: nothing to compare, no collective


def test_the_fingerprint_names_buffers_and_leaves_out_parameters_not_made_yet():
    module = torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.BatchNorm1d(3))
    names, sums = same_model.fingerprint(module)
    assert names == [
        "1.weight",
        "1.bias",
        "buffer 1.running_mean",
        "buffer 1.running_var",  # not num_batches_tracked: it counts training forwards, no evaluation reads it
    ]
    assert len(sums) == 4
    module(torch.randn(4, 2))  # the forward makes the lazy layer's parameters
    assert same_model.fingerprint(module, buffers=False)[0] == ["0.weight", "0.bias", "1.weight", "1.bias"]


HOW = "split or draw it before rt.setup, which gives each rank a random stream of its own"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "case, part",
    [
        ("split", "dataset (a Subset: its indices)"),  # random_split after rt.setup
        ("drawn", "dataset.tensors[0]"),  # torch.randn after rt.setup
        pytest.param("length", "dataset length", marks=pytest.mark.slow),  # (make test-slow)
        ("lengths", "lengths="),  # rt.loader's lengths=, which order every rank's batches
    ],
)
def test_a_dataset_each_rank_made_its_own_is_refused_by_the_loader_and_evaluate(case, part):
    for rank, found in ddpkit.launch(workers.data_of_each_rank, nprocs=2, args=(case,)).items():
        assert found["steps"] == 0, (rank, found)
        for call in ("loader",) if case == "lengths" else ("loader", "evaluate"):
            what = "rt.loader" if call == "loader" else "ddpkit.evaluate"
            assert found[call].startswith(
                f"{what}: the dataset differs between ranks (rank 1's {part} differs from rank 0's)"
            ), (rank, found[call])
            assert HOW in found[call] and "generator=torch.Generator().manual_seed(0)" in found[call]


@pytest.mark.timeout(120)
def test_a_split_with_a_seeded_generator_trains_and_evaluates_every_sample_once():
    for rank, found in ddpkit.launch(workers.data_of_each_rank, nprocs=2, args=("seeded-split",)).items():
        assert found["loader"] is None and found["evaluate"] is None, (rank, found)
        assert found["steps"] == 5 and found["metrics"]["count"] == 20, (rank, found)


def test_the_dataset_fingerprint_follows_subsets_concatenations_and_arrays():
    import numpy as np

    class Arrays(torch.utils.data.Dataset):  # torchvision's CIFAR keeps .data as a numpy array, .targets a list
        def __init__(self, data: np.ndarray) -> None:
            self.data, self.targets = data, [0] * len(data)

        def __len__(self) -> int:
            return len(self.data)

    from ddpkit.loop import same_data

    base = torch.utils.data.TensorDataset(torch.arange(30.0).reshape(10, 3))
    arrays = Arrays(np.arange(12, dtype=np.uint8).reshape(4, 3))
    data = torch.utils.data.ConcatDataset([torch.utils.data.Subset(base, [3, 1, 2]), arrays])
    names, sums = same_data.fingerprint(data)
    assert names == [
        "dataset length",
        "dataset.datasets[0] (a Subset: its indices)",
        "dataset.datasets[0] (a Subset: the indices' order)",
        "dataset.datasets[0].dataset.tensors[0]",
        "dataset.datasets[0].dataset.tensors[0] (its order)",
        "dataset.datasets[1].data",
        "dataset.datasets[1].data (its order)",
        "dataset.datasets[1].targets (its length)",  # a list of labels: its length, then a hash of its items
        "dataset.datasets[1].targets",
    ]
    assert int(sums[0]) == 7 and int(sums[1]) == 6
    reordered = torch.utils.data.ConcatDataset([torch.utils.data.Subset(base, [1, 3, 2]), arrays])
    moved = same_data.fingerprint(reordered)[1]
    assert torch.equal(moved[:2], sums[:2]) and not torch.equal(moved[2], sums[2])  # the order tells them apart
    big = torch.zeros(3 << 16)
    sampled = same_data.fingerprint(torch.utils.data.TensorDataset(big))[1]
    big[3] = 1.0  # on the stride: 65,536 evenly spaced elements of the 196,608 are read
    assert not torch.equal(same_data.fingerprint(torch.utils.data.TensorDataset(big))[1], sampled)


def test_the_dataset_fingerprint_tells_a_shuffle_and_a_file_list_in_another_order():
    from ddpkit.loop import same_data

    class Folder(torch.utils.data.Dataset):  # ImageFolder's samples, or a list of files read as listed
        def __init__(self, root: str, order: list[int], attribute: str = "samples") -> None:
            setattr(self, attribute, [(f"{root}/class{i % 3}/img{i}.png", i % 3) for i in order])

        def __len__(self) -> int:
            return 40

    def sums(data: object) -> torch.Tensor:
        return same_data.fingerprint(data)[1]

    rows = torch.randn(40, 16)  # 640 elements: every one read, so the plain sum alone cannot tell a shuffle
    shuffled = rows[torch.randperm(40)]
    plain, other = sums(torch.utils.data.TensorDataset(rows)), sums(torch.utils.data.TensorDataset(shuffled))
    assert plain[1] == other[1] and plain[2] != other[2]  # the same bits, in another order
    listed = sums(Folder("/data", list(range(40))))
    assert not torch.equal(listed, sums(Folder("/data", list(range(40))[::-1])))
    assert not torch.equal(listed, sums(Folder("/data", list(range(1, 41)))))  # another file
    assert torch.equal(listed, sums(Folder("/scratch/node7/data", list(range(40)))))  # each host's own directory
    names = same_data.fingerprint(Folder("/data", list(range(40)), "files"))[0]
    assert names == ["dataset length", "dataset.files (its length)", "dataset.files"]
    other_class = Folder("/data", list(range(40)))
    other_class.samples[0] = ("/data/class9/img0.png", 0)  # the same file name in another class's folder
    assert not torch.equal(listed, sums(other_class))

    class Objects(torch.utils.data.Dataset):  # a list of the script's objects: not hashed
        samples = [object(), object()]

        def __len__(self) -> int:
            return 2

    assert same_data.fingerprint(Objects())[0] == ["dataset length"]


@pytest.mark.timeout(120)
def test_datasets_shuffled_or_listed_in_each_ranks_own_order_are_refused_in_one_line():
    found = ddpkit.launch(workers.datasets_in_each_ranks_order, nprocs=2)
    differing = {
        "tensors": "dataset.tensors[0] (its order)",
        "files": "dataset.files",
        "arrays": "dataset.data (its order)",
    }
    for rank in (0, 1):
        assert set(found[rank]) == set(differing)
        for kind, message in found[rank].items():
            assert message.startswith(
                f"rt.loader: the dataset differs between ranks (rank 1's {differing[kind]} differs"
            ), message
            assert "sort a list of files" in message and "\n" not in message, message


@pytest.mark.timeout(120)
def test_a_loader_made_inside_local_main_first_does_not_wait_for_the_others():
    """Local rank 0 runs the block alone first: the loader's check of the dataset would wait there."""
    assert ddpkit.launch(workers.loader_made_local_main_first, nprocs=2) == {0: 4, 1: 4}


def test_what_the_fingerprints_leave_out():
    import numpy as np

    from ddpkit.loop import same_data

    class Paths(torch.utils.data.Dataset):  # arrays torch cannot take: strings, a reversed view
        def __init__(self) -> None:
            self.data, self.targets = np.array(["a.png", "b.png"]), np.arange(2)[::-1]

        def __len__(self) -> int:
            return 2

    assert same_data.fingerprint(Paths())[0] == ["dataset length"]
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    names = same_model.fingerprint(model, ignore={"0.bias"})[0]
    assert names == ["0.weight", "1.weight", "1.bias", "buffer 1.running_mean", "buffer 1.running_var"]
