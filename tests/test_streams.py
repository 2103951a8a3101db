"""Streams: plain IterableDatasets and ddpkit.Shards read once per epoch, the same on any world size."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import IterableDataset

import ddpkit
from ddpkit.errors import UsageError
from ddpkit.loop.streams.order import EpochOrder, Layout
from ddpkit.loop.streams.pieces import Pieces, join

sys.path.insert(0, str(Path(__file__).parent))
import stream_workers as sw  # noqa: E402

EVERY = list(range(sw.TOTAL))


@pytest.fixture
def rt():
    runtime = ddpkit.init(seed=3)
    yield runtime
    runtime.close()


def _check_coverage(results: dict, worker_counts=(0, 2), epochs: int = 2) -> None:
    for kind in ("plain", "shards"):
        for workers in worker_counts:
            for epoch in range(epochs):
                key = f"{kind}/{workers}/{epoch}"
                seen = sorted(i for r in results.values() for i in r[key]["seen"])
                assert seen == EVERY, key  # each sample once
                assert {r[key]["steps"] for r in results.values()} == {17}, key  # same steps everywhere
                for step in range(17):  # the ranks' shares add up to the global batch
                    counts = [r[key]["counts"][step] for r in results.values()]
                    assert sum(local for local, _ in counts) == counts[0][1], key


def _global_batches(results: dict, key: str) -> list[set[int]]:
    """Rank r's r-th share of each step, joined: the global batches of the pass."""
    ranks = [results[r] for r in sorted(results)]
    batches, cursor = [], [0] * len(ranks)
    for step in range(ranks[0][key]["steps"]):
        batch = set()
        for r, result in enumerate(ranks):
            local = result[key]["counts"][step][0]
            batch |= set(result[key]["seen"][cursor[r] : cursor[r] + local])
            cursor[r] += local
        batches.append(batch)
    return batches


# -- where samples go (pure: rank and world size are arguments) ---------------------------


@pytest.mark.parametrize("length,size", [(203, 12), (10, 4), (5, 12), (24, 12), (1, 6)])
def test_layout_cuts_every_sample_once_with_one_short_last_batch(length, size):
    layout = Layout(length, global_batch_size=size)
    batches = [layout.batch_positions(b) for b in range(layout.batches)]
    assert sorted(p for batch in batches for p in batch) == list(range(length))
    assert [len(b) for b in batches[:-1]] == [size] * (len(batches) - 1)
    dropped = Layout(length, global_batch_size=size, drop_last=True)
    assert dropped.batches == length // size
    assert all(len(dropped.batch_positions(b)) == size for b in range(dropped.batches))


def _read_pass(shards, rank, world, workers, epoch, opened):
    """One rank's pass, read by hand through its workers' Pieces (no DataLoader, no process group)."""

    def logged(shard):
        opened.add(shard)
        return sw.read_shard(shard)

    logged_shards = ddpkit.Shards(shards.shards, logged, lengths=shards.lengths)
    pieces = []
    for worker in range(workers):
        maker = Pieces(
            logged_shards,
            mode="train",
            rank=rank,
            world_size=world,
            batch_size=12,
            shuffle=True,
            seed=5,
            drop_last=False,
            collate_fn=torch.utils.data.default_collate,
        )
        pieces += list(maker._shard_train(epoch, 0, worker, workers))
    return [(b, set(local)) for b, local, _, _, _ in join(pieces, workers)]


@pytest.mark.parametrize("workers", [1, 2])
def test_shards_global_batches_do_not_depend_on_world_size_and_ranks_read_their_shards(workers):
    shards = sw.shards(lengths=sw.SIZES)
    one = _read_pass(shards, 0, 1, 1, epoch=1, opened=set())
    order = EpochOrder(sw.SIZES, shuffle=True, seed=5, epoch=1)
    layout = Layout(sw.TOTAL, global_batch_size=12)
    for world in (2, 3):
        parts = []
        for rank in range(world):
            opened: set[int] = set()
            parts.append(_read_pass(shards, rank, world, workers, epoch=1, opened=opened))
            columns = layout.rank_columns(rank, world)
            first = layout.column_start(columns.start)
            last = layout.column_start(columns.stop - 1) + layout.column_length(columns.stop - 1) - 1
            holding = {order.locate(p)[0] for p in range(first, last + 1)}
            template = {order.locate(0)[0]}
            assert opened <= holding | template, (world, rank)  # only the shards holding its samples
        joined = [set().union(*(part[b][1] for part in parts)) for b in range(layout.batches)]
        assert joined == [batch for _, batch in one], world


def test_read_tar_groups_members_by_key_and_skips_without_reading(tmp_path):
    import io
    import tarfile

    path = tmp_path / "shard.tar"
    with tarfile.open(path, "w") as archive:
        for key in range(5):
            for field, payload in (("cls", str(key).encode()), ("txt", b"x" * key)):
                info = tarfile.TarInfo(f"part/{key:04d}.{field}")
                info.size = len(payload)
                archive.addfile(info, io.BytesIO(payload))
    samples = list(ddpkit.read_tar(path))
    assert [s["__key__"] for s in samples] == [f"part/{k:04d}" for k in range(5)]
    assert samples[3]["cls"] == b"3" and samples[3]["txt"] == b"xxx"
    assert [s["cls"] for s in ddpkit.read_tar(path, 3)] == [b"3", b"4"]


# -- one process (in this process) ---------------------------------------------------------


def test_one_process_reads_every_sample_once_with_and_without_workers(rt):
    _check_coverage({0: sw.coverage()})


def test_probe_and_break_take_nothing_and_a_stream_resumes_exactly(rt, tmp_path):
    loader = rt.loader(sw.Plain(), global_batch_size=12, shuffle=True, num_workers=2)
    probe = next(iter(loader))[0].tolist()
    for index, _, _ in loader:
        assert index.tolist() == probe  # the probe took nothing: the pass starts over
        break
    first = [index.tolist() for index, _, _ in loader]
    assert len(first) == 17
    assert loader.position_record()["finished"]
    with pytest.raises(TypeError, match="not known"):
        len(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_collate_that_pads_to_the_longest_makes_each_batch_of_its_samples_with_workers(rt, num_workers):
    """A ddpkit.Shards stream read by two workers makes each global batch of both workers' pieces: a
    collate_fn that pads to the batch's longest sample (Hugging Face's DataCollatorWithPadding) made
    pieces of other widths, and joining them raised torch.cat's traceback. The main process collates
    the samples the workers read: each batch is the collate of its own samples, as one reader's is."""
    import workers as tw

    items = tw._Sequences().items
    loader = rt.loader(
        tw._sequence_data("shards"), global_batch_size=8, shuffle=True, collate_fn=tw._pad, num_workers=num_workers
    )
    seen = []
    for batch in loader:
        mine = [items[i] for i in loader.positions]
        expected = tw._pad(mine)
        assert all(torch.equal(batch[k], expected[k]) for k in expected)
        assert batch["input_ids"].shape[1] == max(len(s) for s in mine)
        seen += loader.positions
    assert sorted(seen) == list(range(48))


@pytest.mark.parametrize("kind", ["plain", "shards"])
def test_a_stream_stopped_mid_epoch_resumes_bitwise_with_workers(tmp_path, kind):
    ckpt = str(tmp_path / "ckpt.pt")
    runs = []
    for mode in ("full", "stop", "resume"):
        runs.append(sw.train(mode, ckpt, workers=2, kind=kind))
        ddpkit.current().close()
    full, stopped, resumed = runs
    assert stopped == {"stopped": 25} and resumed["steps"] == full["steps"] == 34
    assert resumed["trained"] == full["trained"][-len(resumed["trained"]) :]  # the same samples after step 25
    assert len(resumed["trained"]) == sw.TOTAL - 8 * 12  # epoch 1 after its 8th batch
    for key in full["weights"]:
        assert torch.equal(resumed["weights"][key], full["weights"][key]), key


def test_bad_input_is_one_clear_line(rt, tmp_path):
    def gen():
        yield from range(3)

    with pytest.raises(UsageError, match="can be read only once"):
        rt.loader(gen(), batch_size=2)
    with pytest.raises(UsageError, match="map-style"):
        rt.loader(sw.Plain(), batch_size=2, weights=[1.0] * 3)
    with pytest.raises(UsageError, match="shuffle_window"):
        ddpkit.Shards([1], sw.read_shard, shuffle_window=0)
    with pytest.raises(UsageError, match="lengths"):
        ddpkit.Shards([0, 1], sw.read_shard, lengths=[3])
    with pytest.raises(UsageError, match="empty list"):
        ddpkit.Shards([], sw.read_shard)


def _raising(shard):
    for offset, item in enumerate(sw.read_shard(shard)):
        if shard == 3 and offset == 5:
            raise ValueError("corrupt record")
        yield item


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_that_raises_is_named(rt, workers):
    data = ddpkit.Shards(list(range(7)), _raising, lengths=sw.SIZES)
    loader = rt.loader(data, global_batch_size=12, num_workers=workers)
    with pytest.raises(ddpkit.ShardError, match=r"^shard 3 failed at sample 5: ValueError: corrupt record$"):
        for _ in loader:
            pass
    with pytest.raises(ddpkit.ShardError, match="shard 3 failed"):  # counting names it too
        rt.loader(ddpkit.Shards(list(range(7)), _raising, cache=False), global_batch_size=12, num_workers=workers)


def _second_empty(shard):
    return iter(()) if shard == 2 else sw.read_shard(shard)


def test_a_read_that_yields_nothing(rt):
    with pytest.warns(UserWarning, match="1 shard.* yield no samples.*: 2"):
        loader = rt.loader(ddpkit.Shards(list(range(7)), _second_empty, cache=False), global_batch_size=12)
    seen = sorted(i for index, _, _ in loader for i in index.tolist())
    assert seen == [i for i in EVERY if not sw.STARTS[2] <= i < sw.STARTS[3]]
    claimed = rt.loader(ddpkit.Shards(list(range(7)), _second_empty, lengths=sw.SIZES), global_batch_size=12)
    with pytest.raises(ddpkit.ShardError, match="shard 2 ended after 0 samples, but its length is 31"):
        list(claimed)


def test_a_stream_shorter_than_one_global_batch(rt):
    assert [len(i) for i, _, _ in rt.loader(sw.Plain(5), global_batch_size=12)] == [5]
    assert list(rt.loader(sw.Plain(5), global_batch_size=12, drop_last=True)) == []
    short = ddpkit.Shards([0], lambda s: (sw.sample(i) for i in range(5)), lengths=[5])
    with pytest.warns(UserWarning, match="fewer than one global batch of 12; drop_last leaves no batches"):
        assert list(rt.loader(short, global_batch_size=12, drop_last=True)) == []
    assert list(rt.loader(sw.Plain(0), global_batch_size=12)) == []


def test_accumulate_over_a_plain_stream_is_refused(rt):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt)
    loader = rt.loader(sw.Plain(), global_batch_size=12)
    with pytest.raises(UsageError, match="accumulate over a plain stream"):
        for _, x, y in loader:
            with rt.accumulate(model, 2):
                rt.backward(torch.nn.functional.mse_loss(model(x), y))


def test_learned_lengths_are_cached(tmp_path, rt):
    calls = []

    def counted(shard):
        calls.append(shard)
        return sw.read_shard(shard)

    first = ddpkit.Shards(list(range(7)), counted, cache=tmp_path)
    rt.loader(first, global_batch_size=12)
    assert first.lengths == sw.SIZES and sorted(calls) == list(range(7))
    calls.clear()
    second = ddpkit.Shards(list(range(7)), counted, cache=tmp_path)
    rt.loader(second, global_batch_size=12)
    assert second.lengths == sw.SIZES and calls == []  # read from the cache
    assert len(list((tmp_path / "shard-lengths").glob("*.json"))) == 1


def test_evaluate_and_predict_on_streams_with_workers(rt):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    for kind in ("plain", "shards"):
        metrics = ddpkit.evaluate(model, sw.pairs(kind), num_classes=3, batch_size=10, num_workers=2)
        assert metrics["count"] == sw.TOTAL
        predicted = ddpkit.predict(model, sw.pairs(kind), batch_size=10, num_workers=2)
        expected = model(torch.stack([sw.sample(i)[1] for i in EVERY]))
        torch.testing.assert_close(predicted, expected)  # stream order
        assert metrics["correct"] == int((expected.argmax(1) == torch.tensor(EVERY) % 3).sum())
    with pytest.raises(UsageError, match="predict_to_file needs a map-style dataset"):
        ddpkit.predict_to_file(model, sw.pairs("plain"), "out.npy")


# -- the ecosystem -------------------------------------------------------------------------


def _write_tars(folder: Path) -> list[Path]:
    import io
    import tarfile

    paths = []
    for shard, (start, size) in enumerate(zip(sw.STARTS, sw.SIZES)):
        path = folder / f"train-{shard:03d}.tar"
        with tarfile.open(path, "w") as archive:
            for index in range(start, start + size):
                _, x, y = sw.sample(index)
                buffer = io.BytesIO()
                torch.save({"x": x, "y": y}, buffer)
                for field, payload in (("idx", str(index).encode()), ("pth", buffer.getvalue())):
                    info = tarfile.TarInfo(f"{index:06d}.{field}")
                    info.size = len(payload)
                    archive.addfile(info, io.BytesIO(payload))
        paths.append(path)
    return paths


def _decode_tar(path, start=0):
    import io

    for record in ddpkit.read_tar(path, start):
        tensors = torch.load(io.BytesIO(record["pth"]))
        yield int(record["idx"]), tensors["x"], tensors["y"]


def test_webdataset_tar_shards(rt, tmp_path):
    data = ddpkit.Shards(_write_tars(tmp_path), _decode_tar, cache=False)
    loader = rt.loader(data, global_batch_size=12, shuffle=True, num_workers=2)
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen = [i for index, x, _ in loader for i in index.tolist()]
        assert sorted(seen) == EVERY
    loader.resume_at(1, 9)  # a resumed reader starts mid-shard: read_tar skips
    tail = [i for index, _, _ in loader for i in index.tolist()]
    assert tail == seen[9 * 12 :]


def test_hugging_face_streaming_dataset(rt, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # before the import: datasets reads them then
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    datasets = pytest.importorskip("datasets", reason="the test extra installs datasets")
    import json

    files = []
    for shard, (start, size) in enumerate(zip(sw.STARTS, sw.SIZES)):
        path = tmp_path / f"part-{shard}.jsonl"
        path.write_text(
            "".join(json.dumps({"index": i, "x": sw.sample(i)[1].tolist()}) + "\n" for i in range(start, start + size))
        )
        files.append(str(path))
    stream = datasets.load_dataset("json", data_files=files, split="train", streaming=True).with_format("torch")
    assert isinstance(stream, IterableDataset) and stream.n_shards == 7
    for data in (stream, ddpkit.Shards.from_hf(stream, cache=False)):
        loader = rt.loader(data, global_batch_size=12, num_workers=2)
        seen = [i for batch in loader for i in batch["index"].tolist()]
        assert sorted(seen) == EVERY, type(data).__name__  # workers did not split it twice


# -- several processes ---------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_two_processes_read_every_sample_once_and_evaluate_exactly():
    results = ddpkit.launch(sw.coverage, nprocs=2)
    _check_coverage(results)
    single = sw.coverage(worker_counts=(0,))  # this process: a world of one
    ddpkit.current().close()
    for kind in ("plain", "shards"):  # the same global batches as one process
        key = f"{kind}/0/1"
        assert _global_batches(results, key) == _global_batches({0: single}, key)
    evaluated = ddpkit.launch(sw.evaluation, nprocs=2)
    alone = sw.evaluation()
    ddpkit.current().close()
    for kind in ("plain", "shards"):
        for rank in (0, 1):
            got, want = evaluated[rank][kind], alone[kind]
            for key in ("count", "correct", "confusion"):
                assert got["metrics"][key] == want["metrics"][key], (kind, key)
            assert got["metrics"]["loss"] == pytest.approx(want["metrics"]["loss"], rel=1e-6)
            torch.testing.assert_close(got["predicted"], want["predicted"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_processes_read_every_sample_once():
    _check_coverage(ddpkit.launch(sw.coverage, nprocs=3))


@pytest.mark.slow  # 10-16 s: make test-slow keeps make test under 15 minutes
@pytest.mark.timeout(300)
def test_shards_three_processes_match_one_and_resume_from_two_on_three(tmp_path):
    ckpt = str(tmp_path / "ckpt.pt")
    one = sw.train("full", ckpt)
    ddpkit.current().close()
    three = ddpkit.launch(sw.train, nprocs=3, args=("full", ckpt))[0]
    assert three["steps"] == one["steps"] == 34
    for key in one["weights"]:
        torch.testing.assert_close(three["weights"][key], one["weights"][key], rtol=0, atol=1e-5)
    assert ddpkit.launch(sw.train, nprocs=2, args=("stop", ckpt))[0] == {"stopped": 25}
    resumed = ddpkit.launch(sw.train, nprocs=3, args=("resume", ckpt))[0]
    assert resumed["steps"] == 34
    for key in one["weights"]:
        torch.testing.assert_close(resumed["weights"][key], one["weights"][key], rtol=0, atol=1e-5)


@pytest.mark.timeout(120)
def test_a_shard_that_raises_on_one_rank_ends_the_run_naming_it():
    with pytest.raises(ddpkit.LaunchError, match="shard 5 failed at sample 3: OSError: unexpected end of data"):
        ddpkit.launch(sw.corrupt_shard, nprocs=2)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("evaluate", [False, True])
def test_a_stream_that_splits_itself_by_rank_is_an_error_not_a_hang(evaluate):
    with pytest.raises(ddpkit.LaunchError, match="ranks read different streams"):
        ddpkit.launch(sw.split_by_rank, nprocs=2, args=(evaluate,))


def _slow_stream(mode: str):
    from helpers import python

    return python(str(Path(__file__).parent / "scripts" / "slow_stream.py"), mode, timeout=60)


@pytest.mark.slow  # 8 s: make test-slow, beside its stalled twin
@pytest.mark.timeout(90)
def test_the_watchdog_counts_stream_reads_in_workers_as_progress():
    done = _slow_stream("steady")
    assert done.returncode == 0, done.stderr
    assert "batch of 80" in done.stdout and "stuck" not in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_the_watchdog_still_fires_when_a_worker_reads_nothing():
    from ddpkit.observe.heartbeats import EXIT_HANG

    stalled = _slow_stream("stalled")
    assert stalled.returncode == EXIT_HANG, stalled.stderr
    assert "batch of 80" not in stalled.stdout
