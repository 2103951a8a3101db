"""Sharding and per-sample randomness, tested with rank and world size as plain arguments."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import ddpkit
from ddpkit.errors import UsageError
from ddpkit.loop.sampler import GlobalBatchSampler, check_batch_sizes, shard_range
from ddpkit.rng import sample_rng, sample_seed


def _rank_batches(length, batch, world, epoch=0, **kw):
    return [
        list(GlobalBatchSampler(length, global_batch_size=batch, rank=r, world_size=world, **kw).batches(epoch))
        for r in range(world)
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [1, 7, 100, 101])
def test_every_sample_once_and_same_global_batches_for_any_world(world, length):
    batch = 12
    reference = list(GlobalBatchSampler(length, global_batch_size=batch, shuffle=True, seed=3).global_batches(2))
    per_rank = _rank_batches(length, batch, world, epoch=2, shuffle=True, seed=3)
    assert all(len(r) == len(reference) for r in per_rank)  # same number of steps on every rank
    for step, global_batch in enumerate(reference):
        union = sorted(i for r in range(world) for i in per_rank[r][step])
        assert union == sorted(global_batch)  # same samples at each step
        sizes = [len(per_rank[r][step]) for r in range(world)]
        assert max(sizes) - min(sizes) <= 1  # uneven by at most one, no padding
    everything = [i for r in per_rank for b in r for i in b]
    assert sorted(everything) == list(range(length))  # each index exactly once


def test_matches_distributed_sampler_when_sizes_divide():
    length, per_rank_batch, world, seed = 96, 8, 3, 5
    for epoch in (0, 1):
        ours = _rank_batches(length, per_rank_batch * world, world, epoch=epoch, shuffle=True, seed=seed)
        for rank in range(world):
            sampler = DistributedSampler(range(length), num_replicas=world, rank=rank, shuffle=True, seed=seed)
            sampler.set_epoch(epoch)
            theirs = [b.tolist() for b in DataLoader(list(range(length)), batch_size=per_rank_batch, sampler=sampler)]
            assert ours[rank] == theirs


def test_order_changes_with_epoch_and_drop_last():
    sampler = GlobalBatchSampler(10, global_batch_size=4, shuffle=True, seed=0)
    assert sampler.order(0) != sampler.order(1)
    assert len(sampler) == 3
    dropped = GlobalBatchSampler(10, global_batch_size=4, drop_last=True)
    assert len(dropped) == 2 and [len(b) for b in dropped.global_batches(0)] == [4, 4]


def test_short_last_batch_leaves_some_ranks_empty():
    per_rank = _rank_batches(5, 4, 3)
    assert [per_rank[r][1] for r in range(3)] == [[4], [], []]


def test_batch_size_rules():
    assert check_batch_sizes(3, None, 12) == 12
    assert check_batch_sizes(3, 4, None) == 12
    with pytest.raises(UsageError, match="does not divide by the world size 3"):
        check_batch_sizes(3, None, 10)
    with pytest.raises(UsageError, match="exactly one"):
        check_batch_sizes(2, 4, 8)
    with pytest.raises(UsageError, match="exactly one"):
        check_batch_sizes(2, None, None)


@pytest.mark.parametrize("length, world", [(0, 2), (1, 3), (10, 3), (1001, 3)])
def test_eval_shards_are_contiguous_and_disjoint(length, world):
    shards = [shard_range(length, r, world) for r in range(world)]
    assert [i for s in shards for i in s] == list(range(length))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


class _Noisy(Dataset):
    """Each sample is its index plus noise drawn from ddpkit's per-sample generator."""

    def __len__(self):
        return 20

    def __getitem__(self, index):
        return torch.tensor([float(index)]), torch.rand(3, generator=sample_rng())


def test_sample_rng_is_keyed_by_seed_epoch_index():
    assert sample_seed(1, 2, 3) == sample_seed(1, 2, 3)
    assert len({sample_seed(1, 2, 3), sample_seed(1, 3, 3), sample_seed(1, 2, 4), sample_seed(2, 2, 3)}) == 4
    with pytest.raises(RuntimeError, match="only available"):
        sample_rng()


def _noise_by_index(rt, num_workers, epochs=2):
    loader = rt.loader(_Noisy(), global_batch_size=6, shuffle=True, num_workers=num_workers)
    seen = {}
    for epoch in rt.epochs(epochs):
        for index, noise in loader:
            for i, n in zip(index[:, 0].tolist(), noise):
                seen[(epoch, int(i))] = n
    return loader, seen


def test_augmentation_does_not_change_with_workers():
    rt = ddpkit.init(seed=7)
    _, without = _noise_by_index(rt, 0)
    rt.epoch = 0
    _, with_workers = _noise_by_index(rt, 2)
    assert without.keys() == with_workers.keys() and len(without) == 40
    assert all(torch.equal(without[k], with_workers[k]) for k in without)
    assert not torch.equal(without[(0, 3)], without[(1, 3)])  # differs across epochs


def test_epochs_sets_the_epoch_without_the_user():
    rt = ddpkit.init(seed=1)
    loader = rt.loader(list(range(10)), global_batch_size=5, shuffle=True)
    orders = []
    for epoch in rt.epochs(3):
        assert loader.epoch == epoch
        orders.append([i for batch in loader for i in batch.tolist()])
    assert orders == [loader.sampler.order(e) for e in range(3)]
    assert len({tuple(o) for o in orders}) == 3


def test_loader_resumes_mid_epoch_from_its_position():
    rt = ddpkit.init(seed=1)
    loader = rt.loader(list(range(10)), global_batch_size=2, shuffle=True)
    full = [b.tolist() for b in loader]
    loader.resume_at(0, 3)
    assert [b.tolist() for b in loader] == full[3:]
    assert [b.tolist() for b in loader] == full[3:]  # no batch trained: still the resume point
    loader.resume_at(0, 3)
    for _ in loader:
        loader.mark_trained()  # what rt.backward does
        break
    loader.set_epoch(0)  # as rt.epochs sets it (without it, a pass after a trained one reads the next epoch)
    assert [b.tolist() for b in loader] == full  # used up: each pass starts the epoch


@pytest.mark.parametrize("shuffle", [True, False])
def test_lengths_group_each_global_batch_by_length_alike_on_any_world_size(shuffle):
    """Hugging Face's group_by_length: groups of 50 global batches of an epoch's order, each sorted by
    length, the longest sample first; a DataLoader with a bucketing batch sampler is refused with this."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 500, (1030,), generator=g).tolist()
    plain = GlobalBatchSampler(1030, global_batch_size=8, shuffle=shuffle, seed=3)
    grouped = GlobalBatchSampler(1030, global_batch_size=8, shuffle=shuffle, seed=3, lengths=lengths)
    order = grouped.order(0)
    assert sorted(order) == list(range(1030)) and order != plain.order(0)
    assert lengths[order[0]] == max(lengths)
    size = min(1030 // (4 * 8), 50) * 8  # Hugging Face's: a group of at most 50 batches, fewer for small data
    for start in range(0, 1030, size):  # each sorted longest first (past the one that gave its first away)
        group = [lengths[i] for i in order[start : start + size][1:]]
        assert group == sorted(group, reverse=True)
    same = [sorted(order[i : i + size]) == sorted(plain.order(0)[i : i + size]) for i in range(0, 1030, size)]
    assert sum(same) >= len(same) - 2  # each holds its part of the order (but the two that swapped a sample) ...
    waste = [sum(max(lengths[i] for i in b) - lengths[i] for i in b) for b in grouped.global_batches(0)]
    plain_waste = [sum(max(lengths[i] for i in b) - lengths[i] for i in b) for b in plain.global_batches(0)]
    assert sum(waste) * 10 < sum(plain_waste)  # ... and pads a tenth as much
    assert grouped.order(1) != order if shuffle else grouped.order(1) == order
    for world in (2, 4):
        parts = [
            list(
                GlobalBatchSampler(
                    1030, global_batch_size=8, shuffle=shuffle, seed=3, lengths=lengths, rank=r, world_size=world
                ).batches(0)
            )
            for r in range(world)
        ]
        merged = [sorted(i for part in parts for i in part[b]) for b in range(len(parts[0]))]
        assert merged == [sorted(b) for b in grouped.global_batches(0)]
    assert grouped.signature() != plain.signature()  # a position saved without grouping is not resumed with it


def test_lengths_bad_input_is_one_line():
    with pytest.raises(UsageError, match="lengths= needs one non-negative whole number per sample"):
        GlobalBatchSampler(4, global_batch_size=2, lengths=[1, 2, 3])
    with pytest.raises(UsageError, match="lengths= needs one non-negative whole number per sample"):
        GlobalBatchSampler(3, global_batch_size=2, lengths=[1.5, 2, 3])
    with pytest.raises(UsageError, match="give one"):
        GlobalBatchSampler(3, global_batch_size=2, lengths=[1, 2, 3], weights=[1, 1, 1])
    with ddpkit.init(seed=0) as rt:

        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return iter(range(4))

        with pytest.raises(UsageError, match="lengths= need a map-style dataset"):
            rt.loader(Stream(), global_batch_size=2, lengths=[1, 2, 3, 4])

        class Buckets(torch.utils.data.Sampler):
            def __iter__(self):
                return iter([[0, 1], [2, 3]])

            def __len__(self):
                return 2

        with pytest.raises(UsageError, match=r"its Buckets, .*with lengths=\[one per sample\]"):
            rt.loader(DataLoader(list(range(4)), batch_sampler=Buckets()))


def test_batch_weight_counts_true_samples():
    rt = ddpkit.init()
    loader = rt.loader(list(range(5)), global_batch_size=4)
    weights = []
    for _ in loader:
        weights.append((loader.local_count, loader.global_count, loader.batch_weight()))
    assert weights == [(4, 4, 1.0), (1, 1, 1.0)]


def test_position_at_the_end_marks_a_finished_epoch():
    rt = ddpkit.init(seed=1)
    loader = rt.loader(list(range(6)), global_batch_size=2)
    for _ in loader:
        pass
    record = loader.position_record()
    assert (record["epoch"], record["position"], record["finished"]) == (0, 3, True)


class _FakeCuda:
    """torch.cuda on a machine with ``visible`` GPUs, this process on GPU ``current``: each generator a number.
    ``started``: whether this process has started CUDA (a CPU run on a GPU host has not)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, visible: int, current: int, started: bool = True) -> None:
        self.states = {d: torch.tensor([d], dtype=torch.uint8) for d in range(visible)}
        self.visible, self.current = visible, current
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: started)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.states[device].clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [self.states[d] for d in range(self.visible)])

    def set(self, state: torch.Tensor, device: int = 0) -> None:
        if device >= self.visible:
            raise IndexError("list index out of range")  # as torch.cuda.default_generators[device]
        self.states[device] = state.clone()


def test_a_processs_cuda_generator_is_its_own_devices_and_resumes_where_fewer_gpus_are_visible(monkeypatch):
    """``rng_state`` keeps this process's own GPU's generator, not every visible one's: a resume under
    ``srun --gpus-per-task=1`` of a run saved with 8 GPUs a node once indexed past the one it sees."""
    from ddpkit import rng

    saved_on = _FakeCuda(monkeypatch, visible=8, current=5)
    saved_on.states[5] = torch.tensor([55], dtype=torch.uint8)
    state = rng.rng_state()
    assert torch.equal(state["cuda"], torch.tensor([55], dtype=torch.uint8))  # GPU 5's alone
    resumed_on = _FakeCuda(monkeypatch, visible=1, current=0)  # one GPU, device 0
    rng.set_rng_state(state)
    assert resumed_on.states[0].tolist() == [55]
    # a checkpoint from before held every visible GPU's states: this device's entry is taken
    old = {**state, "cuda": [torch.tensor([d * 10], dtype=torch.uint8) for d in range(8)]}
    resumed_on.current, resumed_on.visible = 0, 1
    rng.set_rng_state(old)
    assert resumed_on.states[0].tolist() == [0]
    fewer = {**state, "cuda": [torch.tensor([7], dtype=torch.uint8)]}  # saved where 1 GPU was visible
    wider = _FakeCuda(monkeypatch, visible=4, current=3)
    rng.set_rng_state(fewer)  # not among them: left as it is, no IndexError
    assert wider.states[3].tolist() == [3]


def test_a_process_that_has_not_started_cuda_saves_and_restores_no_cuda_generator(monkeypatch):
    """Reading a CUDA generator starts CUDA: a CPU run on a GPU host made a context on GPU 0 in every
    rank at its first checkpoint, which a GPU in exclusive-process mode refuses."""
    from ddpkit import rng

    cpu_run = _FakeCuda(monkeypatch, visible=2, current=0, started=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("CUDA started"))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": pytest.fail("CUDA started"))
    state = rng.rng_state()
    assert "cuda" not in state
    rng.set_rng_state({**state, "cuda": torch.tensor([9], dtype=torch.uint8)})  # saved by a GPU run
    assert cpu_run.states[0].tolist() == [0]


def test_a_fault_tolerant_step_that_does_not_commit_puts_the_cuda_generator_back(monkeypatch):
    """Dropout on a GPU draws from the CUDA generator: a redone step must draw the same masks."""
    from ddpkit.parallel.replica import FaultTolerant

    class Quorum:
        def in_quorum(self) -> bool:
            return True

        def should_commit(self, **_) -> bool:
            return False  # a replica died in this step

    cuda = _FakeCuda(monkeypatch, visible=2, current=1)
    replica = FaultTolerant(Quorum())
    replica.micro_shards = True  # (no gradient average to fake)
    model = torch.nn.Linear(2, 2)
    replica.on_batch([model], None)
    cuda.states[1] = torch.tensor([99], dtype=torch.uint8)  # the forward drew on GPU 1
    torch.rand(3)
    assert replica.commit(list(model.parameters()), None) is False
    assert cuda.states[1].tolist() == [1] and cuda.states[0].tolist() == [0]


def test_seed_torch_draws_what_torch_manual_seed_draws():
    """The per-batch and per-shard seeding of micro_shards skips torch.manual_seed's lazy seeds of devices the
    process has not (a formatted stack each on a CPU build); its draws must stay torch.manual_seed's."""
    from ddpkit.rng import seed_torch

    torch.manual_seed(2**62 + 7)
    want = torch.rand(5), torch.randn(3), torch.randperm(9)
    torch.manual_seed(1)
    seed_torch(2**62 + 7)
    got = torch.rand(5), torch.randn(3), torch.randperm(9)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    if torch.cuda.is_available():  # the CUDA device's generator is seeded too
        torch.manual_seed(5)
        want_cuda = torch.rand(4, device="cuda")
        seed_torch(5)
        assert torch.equal(torch.rand(4, device="cuda"), want_cuda)


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore:ddpkit. Stream is a plain IterableDataset")
@pytest.mark.parametrize("kind", ["map", "stream"])
def test_a_run_resumed_mid_epoch_draws_what_the_collate_drew_in_the_uninterrupted_one(tmp_path, kind):
    """A collate_fn that draws, read by 2 workers: each worker's stream was seeded per rank and worker, so a
    run resumed mid-epoch (fresh workers) drew other masks and ended 1e-2 from the uninterrupted run."""
    import workers

    whole = workers.drawing_collate(kind, 2, None)
    assert workers.drawing_collate(kind, 2, None, str(tmp_path), stop=3) is None  # inside epoch 0
    resumed = workers.drawing_collate(kind, 2, None, str(tmp_path))
    assert all(torch.equal(resumed["weights"][k], v) for k, v in whole["weights"].items())
    no_workers = workers.drawing_collate(kind, 0, None)  # and what the workers drew is what none draws
    assert all(torch.equal(no_workers["weights"][k], v) for k, v in whole["weights"].items())
