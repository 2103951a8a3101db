"""Infrequent sync (sync="diloco" / "local-sgd"): training apart, meeting every H steps, exact resume."""

from __future__ import annotations

import math

import pytest
import torch

import ddpkit
import workers
from ddpkit.errors import UsageError


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "sync", ["diloco", pytest.param("local-sgd", marks=pytest.mark.slow)]
)  # (local-sgd: make test-slow)
def test_ranks_train_apart_and_meet_every_h_steps(tmp_path, sync):
    runs = ddpkit.launch(workers.periodic_run, nprocs=2, args=(sync, 12, None, str(tmp_path)))
    for rank, run in runs.items():
        assert run["step"] == 12 and run["syncs"] == 4 and run["steps_into_period"] == 0, rank
        # right after a sync every rank holds the synced weights
        assert _equal(
            [run["weights"][k] for k in run["weights"] if not k.endswith("num_batches_tracked") and "running" not in k],
            run["synced"],
        )
        assert run["evaluation_restored_local"], "evaluate swapped the synced weights in and back out"
        assert run["loss"] < 2.0  # it learned (chance is ln 10 = 2.30)
    assert _equal(runs[0]["synced"], runs[1]["synced"])
    # a bfloat16 exchange (the default) of every parameter's and BatchNorm statistic's change, 4 times
    params = sum(t.numel() for t in runs[0]["synced"])
    assert runs[0]["sent_bytes"] == 4 * 2 * (params + 2 * 32)
    exported = runs[0]["exported"]  # rt.full_state_dict: the synced weights
    assert _equal([v for k, v in exported.items() if k.endswith(("weight", "bias"))], runs[0]["synced"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_run_stopped_mid_period_resumes_bitwise(tmp_path, nprocs, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (tmp_path / "none").mkdir()
    uninterrupted = ddpkit.launch(
        workers.periodic_run, nprocs=nprocs, args=("diloco", 14, None, str(tmp_path / "none"))
    )
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    stopped = ddpkit.launch(workers.periodic_run, nprocs=nprocs, args=("diloco", 14, 7, str(ckpt)))
    assert stopped[0]["stopped"] == 7 and stopped[0]["steps_into_period"] == 1  # synced at 6, one step on
    assert not _equal(stopped[0]["local"], stopped[0]["synced"])
    saved = ddpkit.checkpoint.read(stopped[0]["saved"])["user"]["model"]
    names = [k for k in saved if k.endswith(("weight", "bias")) and "running" not in k]
    assert _equal([saved[k] for k in names], stopped[0]["synced"])  # the model entry: the synced weights
    resumed = ddpkit.launch(workers.periodic_run, nprocs=nprocs, args=("diloco", 14, None, str(ckpt)))
    for rank in range(nprocs):
        assert resumed[rank]["step"] == 14 and resumed[rank]["steps_into_period"] == 2
        assert _equal(resumed[rank]["synced"], uninterrupted[rank]["synced"])
        for name, value in uninterrupted[rank]["weights"].items():
            assert torch.equal(resumed[rank]["weights"][name], value), (rank, name)


@pytest.mark.slow  # 17 s: make test-slow
@pytest.mark.timeout(300)
def test_accumulation_and_a_float32_exchange_train_and_resume_bitwise(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (tmp_path / "none").mkdir()
    args = ("diloco", 6, None, str(tmp_path / "none"), 2, "fp32", 2)
    uninterrupted = ddpkit.launch(workers.periodic_run, nprocs=2, args=args)
    assert uninterrupted[0]["syncs"] == 3
    params = sum(t.numel() for t in uninterrupted[0]["synced"])
    assert uninterrupted[0]["sent_bytes"] == 3 * 4 * (params + 2 * 32)  # float32: 4 bytes
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    ddpkit.launch(workers.periodic_run, nprocs=2, args=("diloco", 6, 3, str(ckpt), 2, "fp32", 2))
    resumed = ddpkit.launch(workers.periodic_run, nprocs=2, args=("diloco", 6, None, str(ckpt), 2, "fp32", 2))
    for rank in (0, 1):
        for name, value in uninterrupted[rank]["weights"].items():
            assert torch.equal(resumed[rank]["weights"][name], value), (rank, name)


@pytest.mark.timeout(300)
def test_another_world_size_continues_from_the_synced_weights(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    stopped = ddpkit.launch(workers.periodic_run, nprocs=2, args=("diloco", 14, 7, str(ckpt)))
    with pytest.warns(UserWarning, match="every rank continues from the synced weights"):
        one = workers.periodic_run("diloco", 8, None, str(ckpt))
    ddpkit.current().close()
    # it took one step from the synced weights of step 6, and the period started over at step 7
    assert one["step"] == 8 and one["steps_into_period"] == 1 and one["syncs"] == 2
    assert _equal(one["synced"], stopped[0]["synced"])


@pytest.mark.slow  # five 2-process runs: make test-slow
@pytest.mark.timeout(300)
def test_streaming_fragments_sent_in_the_background_train_and_resume_bitwise(tmp_path, monkeypatch):
    """Streaming DiLoCo: two fragments (sent at steps 2 and 4 of a 4-step period), each exchange
    landing 2 steps after it was sent; stopped at step 7 with fragment 0's exchange in flight."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (tmp_path / "none").mkdir()
    stream = (4, None, 1, 2, 2)  # every, sync_dtype, accumulate, fragments, delay
    uninterrupted = ddpkit.launch(
        workers.periodic_run, nprocs=2, args=("diloco", 14, None, str(tmp_path / "none"), *stream)
    )
    params = sum(t.numel() for t in uninterrupted[0]["synced"])
    # 14 steps: fragment 0 sent at 2, 6, 10, 14 and fragment 1 at 4, 8, 12; landed: all but the last
    assert uninterrupted[0]["syncs"] == 6
    assert uninterrupted[0]["sent_bytes"] == 3 * 2 * (params + 2 * 32) + 2 * uninterrupted[0]["fragment0_elements"]
    assert _equal(uninterrupted[0]["synced"], uninterrupted[1]["synced"])
    assert uninterrupted[0]["loss"] < 2.0
    (tmp_path / "plain").mkdir()
    plain = ddpkit.launch(workers.periodic_run, nprocs=2, args=("diloco", 14, None, str(tmp_path / "plain"), 4))
    assert not _equal(plain[0]["synced"], uninterrupted[0]["synced"])  # streaming is another schedule
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    stopped = ddpkit.launch(workers.periodic_run, nprocs=2, args=("diloco", 14, 7, str(ckpt), *stream))
    assert stopped[0]["pending"] == 1
    resumed = ddpkit.launch(workers.periodic_run, nprocs=2, args=("diloco", 14, None, str(ckpt), *stream))
    for rank in (0, 1):
        assert _equal(resumed[rank]["synced"], uninterrupted[rank]["synced"])
        for name, value in uninterrupted[rank]["weights"].items():
            assert torch.equal(resumed[rank]["weights"][name], value), (rank, name)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "exchange",
    [pytest.param("int8", marks=pytest.mark.slow), "sparse"],  # int8: 6 s, make test-slow
)
@pytest.mark.slow  # make test-slow: make test keeps the core of this family (its 15 minutes)
def test_an_exchange_with_its_feedback_in_flight_resumes_bitwise(tmp_path, monkeypatch, exchange):
    """int8 or sparse with error feedback, streamed: two fragments each landing 2 steps after it was
    sent; stopped at step 7 with fragment 0's exchange in flight and both fragments' feedback kept."""
    from ddpkit.parallel.periodic_parts import sparse_packet_bytes

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (tmp_path / "none").mkdir()
    stream = (4, exchange, 1, 2, 2)  # every, sync_dtype, accumulate, fragments, delay
    uninterrupted = ddpkit.launch(
        workers.periodic_run, nprocs=2, args=("diloco", 14, None, str(tmp_path / "none"), *stream)
    )
    params = sum(t.numel() for t in uninterrupted[0]["synced"])
    first = uninterrupted[0]["fragment0_elements"]
    second = params + 2 * 32 - first
    # fragment 0 sent at 2, 6, 10, 14; fragment 1 at 4, 8, 12
    if exchange == "int8":  # one byte an element: a quarter of fp32's
        assert uninterrupted[0]["sent_bytes"] == 4 * first + 3 * second
    else:  # a packet of the largest 1/32: a scale, block counts, a 16-bit word an element
        # (fragment 1 holds BatchNorm's 2 x 32 statistics: sent whole, as float32)
        sent = 4 * sparse_packet_bytes(first) + 3 * sparse_packet_bytes(second - 64, dense=64)
        assert uninterrupted[0]["sent_bytes"] == sent
        assert uninterrupted[0]["sent_bytes"] < (4 * first + 3 * second) / 4  # int8 sends one byte an element
    assert _equal(uninterrupted[0]["synced"], uninterrupted[1]["synced"])  # the ranks meet at one model
    # it learns (chance is ln 10 = 2.30); sparse moves the synced model by 1/32 of each change a sync,
    # the rest waiting in the feedback, so 3 syncs of 14 steps take it less far
    assert uninterrupted[0]["loss"] < (2.0 if exchange == "int8" else 2.28)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    stopped = ddpkit.launch(workers.periodic_run, nprocs=2, args=("diloco", 14, 7, str(ckpt), *stream))
    assert stopped[0]["pending"] == 1
    saved = ddpkit.checkpoint.read(stopped[0]["saved"])["ddpkit"]["compression"]
    feedback = [rank[0]["feedback"] for rank in saved]
    assert sorted(feedback[0]) == [0, 1] and not torch.equal(feedback[0][0], feedback[1][0])  # each rank's own
    pending = saved[0][0]["pending"][0]
    if exchange == "int8":
        assert pending["flat"].dtype == torch.int8 and pending["scale"] > 0
    else:  # both ranks' packets, gathered
        assert pending["flat"].dtype == torch.uint8 and pending["scale"] == "sparse:packed"
        assert pending["flat"].numel() == 2 * sparse_packet_bytes(first)
        # most of each rank's change waits in its feedback: only the largest 1/32 was sent
        assert (feedback[0][0] != 0).sum() > 0.9 * first
    resumed = ddpkit.launch(workers.periodic_run, nprocs=2, args=("diloco", 14, None, str(ckpt), *stream))
    for rank in (0, 1):
        assert _equal(resumed[rank]["synced"], uninterrupted[rank]["synced"])
        for name, value in uninterrupted[rank]["weights"].items():
            assert torch.equal(resumed[rank]["weights"][name], value), (rank, name)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sync": "sometimes"}, "unknown sync 'sometimes'"),
        ({"sync": "diloco", "sync_fragments": 2}, "without sync_every chooses the period and the overlap"),
        ({"sync": "diloco", "sync_every": 0}, "sync_every=H is a whole number of optimizer steps of at least 1"),
        ({"sync_every": 5}, "give sync='diloco' or 'local-sgd'"),
        (
            {"sync": "local-sgd", "sync_every": 5, "sync_dtype": "int4"},
            "sync_dtype='int4': choose 'fp32', 'bf16', 'int8', 'sparse'",
        ),
        ({"sync": "diloco", "sync_every": 5, "strategy": "fsdp"}, "strategy='fsdp' shards the model"),
        (
            {"sync": "diloco", "sync_every": 5, "grad_compression": "powersgd"},
            "compresses a per-step gradient exchange",
        ),
        ({"sync": "diloco", "sync_every": 5, "sync_batchnorm": True}, "averaged at each sync instead"),
        ({"sync": "diloco", "sync_every": 4, "sync_fragments": 5}, "sync_fragments=5: give a whole number from 1 to"),
        ({"sync": "diloco", "sync_every": 4, "sync_delay": 4}, "sync_delay=4: give a whole number of inner steps"),
        ({"sync_delay": 2}, "give sync='diloco' or 'local-sgd'"),
    ],
    ids=[
        "unknown",
        "no-every",
        "zero-every",
        "every-without-sync",
        "dtype",
        "fsdp",
        "compression",
        "syncbn",
        "fragments",
        "delay",
        "delay-without-sync",
    ],
)
def test_refused_combinations_are_one_line(kwargs, message):
    rt = ddpkit.init()
    model = torch.nn.Linear(4, 2)
    try:
        with pytest.raises(UsageError, match=message) as refused:
            rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
        assert "\n" not in str(refused.value)
    finally:
        rt.close()


def test_fp16_is_refused_under_an_infrequent_sync():
    rt = ddpkit.init(precision="fp16")
    model = torch.nn.Linear(4, 2)
    try:
        with pytest.raises(UsageError, match="precision='fp16' scales each rank's loss on its own"):
            rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), sync="local-sgd", sync_every=4)
    finally:
        rt.close()


def test_flush_applies_the_exchange_still_in_flight():
    """One process, 2 fragments, each exchange landing 2 steps after it was sent: after step 6,
    fragment 0's exchange (sent at 6) is in flight; flush applies it to the synced weights."""
    from ddpkit.parallel import periodic

    rt = ddpkit.init(seed=0)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        model, optimizer = rt.setup(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            sync="local-sgd",
            sync_every=4,
            sync_fragments=2,
            sync_delay=2,
        )
        syncer = periodic.of(model)
        for _ in range(6):
            rt.backward(model(torch.randn(5, 4)).square().mean())
            rt.step(optimizer)
        assert [e["fragment"] for e in syncer.pending] == [0] and syncer.syncs == 2
        first = syncer.fragments[0]
        before = [syncer.synced[i].clone() for i in first]
        syncer.flush()
        assert syncer.pending == [] and syncer.syncs == 3
        # local SGD on one process: the synced fragment becomes this rank's weights of step 6
        assert all(not torch.equal(b, syncer.synced[i]) for b, i in zip(before, first))
    finally:
        rt.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "sync, fragments, delay",
    [("diloco", 1, 0), pytest.param("local-sgd", 2, 1, marks=pytest.mark.slow)],
)
@pytest.mark.slow  # make test-slow: make test keeps the core of this family (its 15 minutes)
def test_a_period_that_does_not_divide_the_run_ends_with_a_final_exchange(tmp_path, sync, fragments, delay):
    """10 steps, a sync every 3: the end of rt.epochs exchanges step 10's drift, so what the script
    evaluates and keeps after the loop is every rank's common model, not its own; a run resumed from
    a checkpoint saved after it makes no second exchange."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    runs = ddpkit.launch(workers.final_exchange_run, nprocs=2, args=(sync, 3, fragments, delay, str(ckpt)))
    for rank, run in runs.items():
        assert run["step"] == 10 and run["steps_into_period"] == 0 and run["pending"] == 0, rank
        assert run["private_after_epoch_0"] and run["private_after_epoch_1"], "in the loop each rank has its own"
        assert _equal(run["after_epochs"], run["synced"]), rank  # after it: the common model
        assert abs(run["evaluated"] - run["own_loss"]) < 1e-5  # evaluate saw the model the script holds
    assert _equal(runs[0]["after_epochs"], runs[1]["after_epochs"])
    # F=1: syncs at steps 3, 6, 9 and the final one. F=2, delay 1: fragments sent at steps 1, 3, 4, 6,
    # 7, 9, 10 land a step later (6 by step 10); the final exchange lands step 10's fragment 0 and sends
    # fragment 1 (fragment 0 has not trained since step 10: no outer step on a zero change)
    assert runs[0]["syncs"] == {1: 4, 2: 8}[fragments]
    resumed = ddpkit.launch(workers.final_exchange_run, nprocs=2, args=(sync, 3, fragments, delay, str(ckpt)))
    for rank, run in resumed.items():
        assert run["syncs"] == run["syncs_at_start"] == runs[rank]["syncs"], rank  # nothing exchanged again
        assert _equal(run["after_epochs"], runs[rank]["after_epochs"]), rank


def test_the_period_chosen_from_the_link_is_the_shortest_that_hides_the_exchange():
    from ddpkit.parallel.periodic_parts import MIN_EVERY, choose_period

    def chosen(mbit: float, step_s: float = 0.1, nbytes: int = 4_000_000, world: int = 2) -> dict:
        return choose_period(
            step_s=step_s, exchange_bytes=nbytes, world=world, link_bytes_per_s=mbit * 1e6 / 8, latency_s=0.002
        )

    slow, fast = chosen(10), chosen(100)
    for c in (slow, fast):
        assert c["delay"] == c["every"] - 1  # sent at the period's end, applied before the next is sent
        assert c["delay"] * c["step_s"] * 0.8 >= c["exchange_s"] > (c["delay"] - 1) * c["step_s"] * 0.8  # the least
    assert slow["every"] > fast["every"] > MIN_EVERY
    assert chosen(10, step_s=0.2)["every"] < slow["every"]  # a longer step hides more of the exchange
    assert chosen(10, world=4)["every"] > slow["every"]  # a ring of 4 sends 1.5x the bytes of a ring of 2
    assert chosen(1e6)["every"] == MIN_EVERY


def test_the_largest_positions_are_found_from_a_sample_or_in_full_where_the_sample_misleads():
    from ddpkit.parallel.periodic import _largest

    values = torch.randn(300_000, generator=torch.Generator().manual_seed(0))
    want = set(torch.topk(values.abs(), 9_375).indices.tolist())
    assert set(_largest(values, 9_375).tolist()) == want
    # the sample (every 4th element) holds every nonzero one: its threshold lets 28 by, not 100
    skewed = torch.zeros(300_000)
    skewed[::4] = torch.arange(1, 75_001, dtype=torch.float32)
    threshold = torch.quantile(skewed[::4], 1.0 - 1.1 * 100 / 300_000)
    assert int((skewed >= threshold).sum()) < 100  # so the full topk runs
    found = _largest(skewed, 100)
    assert found.numel() == 100 and set(found.tolist()) == set(range(300_000 - 400, 300_000, 4))
    assert _largest(torch.zeros(5), 0).numel() == 0 and sorted(
        _largest(torch.tensor([0.0, -2.0, 1.0]), 3).tolist()
    ) == [0, 1, 2]


def test_a_sparse_packet_sends_a_16_bit_word_an_element_and_sums_to_what_was_sent():
    """Each element sent as one 16-bit word (12-bit offset in its block, 4-bit value) after each block's
    count: 2 bytes an element, across blocks of 4,096 (the last one partial, one empty); a checkpoint's
    packet of an earlier layout (int8 values, with 16-bit offsets in blocks of 65,536 or whole int32
    positions) still lands; a packet that does not add up is one line, not a wrong sum."""
    from ddpkit.parallel import periodic_parts
    from ddpkit.parallel.periodic import PeriodicSync

    elements, dense = 16 * 4096 + 1_000, 3  # 17 blocks of words (2 of the second layout's), 3 values whole
    syncer = PeriodicSync(torch.nn.Linear(2, 1), None, kind="local-sgd", every=2, sync_dtype="sparse")
    change = torch.randn(elements, generator=torch.Generator().manual_seed(1))
    change[4096 : 2 * 4096] = 0.0  # the second block sends nothing
    change[-dense - 1] = 50.0  # the last position of the last, partial block
    packet = syncer._sparsified(0, [change.clone()], dense)
    sparse, count = elements - dense, periodic_parts.sparse_count(elements - dense, syncer.density)
    assert packet.numel() == periodic_parts.sparse_packet_bytes(sparse, dense, syncer.density)
    assert packet.numel() == 4 + 2 * 17 + 2 * count + 4 * dense
    kept = syncer.feedback[0]
    two = torch.cat([packet, packet])  # two ranks that sent the same
    total = syncer._densified(two, 2, elements, dense, periodic_parts.PACKED)
    assert torch.equal(total[sparse:], 2 * change[sparse:])  # sent whole
    sent = total[:sparse] / 2
    assert torch.equal(sent + kept[:sparse], change[:sparse])  # what was sent and what is kept: the change, exactly
    largest = set(torch.topk(change[:sparse].abs(), count).indices.tolist())
    assert int((sent != 0).sum()) <= count and set(sent.nonzero().squeeze(1).tolist()) <= largest
    assert sent[sparse - 1] == 50.0 and not sent[4096 : 2 * 4096].any()
    unit = packet[:4].clone().view(torch.float32)
    assert torch.equal(unit, torch.tensor([50.0 / periodic_parts.LEVELS]))  # 4-bit values: the largest is 7 levels
    levels = sent / unit
    assert torch.equal(levels, levels.round()) and float(levels.abs().max()) == periodic_parts.LEVELS
    # what rounding to 7 levels kept back stays in the feedback: at most half a level at a position sent
    chosen = torch.tensor(sorted(largest))
    assert float(kept[chosen].abs().max()) <= float(unit) / 2 + 1e-6
    # earlier layouts, as an exchange in flight in a checkpoint written before: int8 values
    positions = torch.tensor(sorted(largest))
    values = (sent[positions] / unit).round().to(torch.int8)
    whole = packet[-4 * dense :]
    second = torch.cat(
        [
            packet[:4],
            torch.bincount(positions // 65536, minlength=2).to(torch.int32).view(torch.uint8),
            (positions % 65536 - 32768).to(torch.int16).view(torch.uint8),
            values.view(torch.uint8),
            whole,
        ]
    )
    assert torch.equal(syncer._densified(second, 1, elements, dense, periodic_parts.BLOCKS), total / 2)
    first = torch.cat([packet[:4], positions.to(torch.int32).view(torch.uint8), values.view(torch.uint8), whole])
    assert torch.equal(syncer._densified(first, 1, elements, dense, "sparse"), total / 2)
    # crafted: a block's count off by one, a value outside the levels, an offset past the end, cut short
    crafted = packet.clone()
    crafted[4:6] = (crafted[4:6].view(torch.int16) + 1).view(torch.uint8)
    with pytest.raises(ddpkit.DdpkitError, match="packet does not add up .* resume from another checkpoint"):
        syncer._densified(crafted, 1, elements, dense, periodic_parts.PACKED)
    words = 4 + 2 * 17
    nibble = packet.clone()
    nibble[words : words + 2] = (nibble[words : words + 2].view(torch.int16) & ~15).view(torch.uint8)
    with pytest.raises(ddpkit.DdpkitError, match="packet does not add up"):
        syncer._densified(nibble, 1, elements, dense, periodic_parts.PACKED)
    with pytest.raises(ddpkit.DdpkitError, match="packet does not add up"):
        syncer._densified(first.clone().index_fill_(0, torch.arange(4, 8), 255), 1, elements, dense, "sparse")
    with pytest.raises(ddpkit.DdpkitError, match="packet does not add up"):  # past the end: the last block's word
        last = packet.clone()
        at = words + 2 * (count - 1)
        last[at : at + 2] = torch.tensor([32767], dtype=torch.int16).view(torch.uint8)  # offset 4095 of a partial block
        syncer._densified(last, 1, elements, dense, periodic_parts.PACKED)
    with pytest.raises(ddpkit.DdpkitError, match="packet does not add up"):  # cut short: an odd byte count
        syncer._densified(packet[:-5], 1, elements, dense, periodic_parts.PACKED)


@pytest.mark.parametrize("exchange", ["int8", "sparse"])
def test_a_change_that_diverged_stops_the_exchange_in_one_line_instead_of_vanishing_in_the_rounding(exchange):
    from ddpkit.parallel.periodic import PeriodicSync

    model = torch.nn.Linear(4, 2)
    syncer = PeriodicSync(model, None, kind="local-sgd", every=1, sync_dtype=exchange)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(ddpkit.DdpkitError, match="holds NaN or inf .* lower the learning rate"):
        syncer.after_step()


def test_where_the_link_sets_the_period_int8_then_sparse_shorten_it_unless_the_user_gave_a_dtype():
    from ddpkit.parallel.periodic_parts import MIN_EVERY, SPARSE_DENSITIES, choose_exchange, sparse_packet_bytes

    def chosen(mbit: float, dtype: str = "bf16", given: bool = False, world: int = 2) -> dict:
        return choose_exchange(
            step_s=0.1,
            elements=2_000_000,
            dtype=dtype,
            dtype_given=given,
            world=world,
            link_bytes_per_s=mbit * 1e6 / 8,
            latency_s=0.002,
        )

    slow, kept = chosen(10), chosen(10, given=True)
    assert slow["dtype"] == "sparse" and kept["dtype"] == "bf16" and "density" not in kept
    assert slow["exchange_bytes"] == sparse_packet_bytes(2_000_000, density=slow["density"])
    assert slow["every"] < chosen(10, "int8", given=True)["every"] < kept["every"]
    assert chosen(10, "fp32", given=True)["every"] > kept["every"]  # the user's fp32 stands, however slow
    # the densest share that gives the shortest period: sparser only where it shortens the period
    shares = {mbit: chosen(mbit)["density"] for mbit in (1, 10, 40)}
    assert shares[1] == SPARSE_DENSITIES[-1] and shares[40] == SPARSE_DENSITIES[0], shares
    assert chosen(40)["every"] < chosen(40, "int8", given=True)["every"]
    assert chosen(1)["every"] > chosen(10)["every"] >= MIN_EVERY  # the sparsest share cannot hide everything
    # a given sparse exchange chooses its share too; an all-gather of 4 ranks' packets sends 3 of them
    assert chosen(10, "sparse", given=True)["density"] == slow["density"]
    assert chosen(1, world=4)["every"] > chosen(1)["every"]
    # int8 reaches the shortest period already: nothing more is thrown away
    middle = chosen(300)
    assert middle["dtype"] == "int8" and middle["every"] == MIN_EVERY < chosen(300, given=True)["every"]
    fast = chosen(1e6)
    assert fast["dtype"] == "bf16" and fast["every"] == MIN_EVERY  # a link that sets nothing: no rounding


def test_an_exchange_capped_at_one_steps_delay_goes_in_fragments_only_where_a_whole_one_cannot_hide():
    """A fault-tolerant quorum's exchange runs behind one step at most (``max_delay=1``): where a whole
    exchange needs more, the model goes in fragments, one a step, each hidden behind it; where a whole
    one hides behind one step at the shortest period, it is taken over a denser share in fragments."""
    from ddpkit.parallel.periodic_parts import LINK_SHARE, MIN_EVERY, SPARSE_DENSITIES, choose_exchange, choose_period

    link = dict(step_s=0.1, world=2, link_bytes_per_s=1.25e6, latency_s=0.002)
    free = choose_period(exchange_bytes=2_000_000, **link)
    capped = choose_period(exchange_bytes=2_000_000, max_delay=1, **link)
    assert free["delay"] > 1 and free["fragments"] == 1
    assert capped["delay"] == 1 and capped["every"] == capped["fragments"] <= free["every"]

    # each fragment's share of the bytes, and the latency paid once more for it, fit one step's share of the link
    def per_fragment(fragments: int) -> float:
        return (capped["exchange_s"] - link["latency_s"]) / fragments + link["latency_s"]

    assert per_fragment(capped["fragments"]) <= LINK_SHARE * link["step_s"] < per_fragment(capped["fragments"] - 1)
    # a whole exchange that hides behind one step is not split; nor where the link sets nothing
    assert choose_period(exchange_bytes=50_000, max_delay=1, **link)["fragments"] == 1
    assert choose_period(exchange_bytes=2_000_000, max_delay=1, **{**link, "link_bytes_per_s": None})["every"] == 2
    assert not capped["waits"] and not free["waits"]
    slow_call = choose_period(exchange_bytes=2_000_000, max_delay=1, **{**link, "latency_s": 0.09})
    assert slow_call["waits"] and slow_call["delay"] == 1  # 90 ms a call against 80 ms a step hides: none hides
    from types import SimpleNamespace

    from ddpkit.parallel.periodic import PeriodicSync

    def notice(decision: dict) -> str:
        run = SimpleNamespace(name="diloco", every=decision["every"], delay=1, meet=None, outer_chosen=False)
        return PeriodicSync._notice(run, {**decision, "dtype": "bf16"}, link["latency_s"], 1.25e6)  # type: ignore[arg-type]

    assert notice(capped).endswith("each behind the next 1 step(s)")
    assert notice(slow_call).endswith(
        "which do not hide it: a call's latency alone outlasts the 1 step(s) an "
        "exchange may run behind, so the steps wait for each"
    )

    def chosen(mbit: float, **kwargs) -> dict:
        return choose_exchange(
            elements=2_000_000,
            dtype="bf16",
            dtype_given=False,
            **{**link, "link_bytes_per_s": mbit * 1e6 / 8},
            **kwargs,
        )

    # 10 Mbit/s: a sparse share hides whole behind one step; denser shares would need fragments
    whole = chosen(10, max_delay=1)
    assert (whole["every"], whole["fragments"], whole["delay"]) == (MIN_EVERY, 1, 1)
    assert whole["density"] < SPARSE_DENSITIES[0] and whole["density"] == chosen(10)["density"]
    # 1 Mbit/s: no share hides whole behind one step: the sparsest in fragments, a step each
    slow = chosen(1, max_delay=1)
    assert slow["delay"] == 1 and slow["fragments"] == slow["every"] > 1 and slow["density"] == SPARSE_DENSITIES[-1]
    assert slow["every"] <= chosen(1)["every"]


def test_a_chosen_outer_step_lengthens_adaptive_inner_steps_by_the_root_of_the_world_size():
    from ddpkit.parallel.periodic import PeriodicSync
    from ddpkit.parallel.periodic_parts import chosen_outer_lr

    class Lion(torch.optim.Optimizer):  # a sign-based optimizer of its own: betas, no eps
        def __init__(self, params):
            super().__init__(params, {"lr": 1e-4, "betas": (0.9, 0.99)})

    def params():
        return [torch.zeros(3, requires_grad=True)]

    adaptive = [
        torch.optim.AdamW(params()),
        torch.optim.Adam(params()),
        torch.optim.RMSprop(params()),
        torch.optim.Adagrad(params()),
        Lion(params()),
    ]
    for optimizer in adaptive:
        assert chosen_outer_lr(optimizer, 4) == 2.0, type(optimizer).__name__
        assert chosen_outer_lr(optimizer, 2) == math.sqrt(2) and chosen_outer_lr(optimizer, 1) == 1.0
    # SGD's step is linear in the gradient: the ranks' average is every-step DDP's step
    for optimizer in (torch.optim.SGD(params(), lr=0.1), torch.optim.SGD(params(), lr=0.1, momentum=0.9), None):
        assert chosen_outer_lr(optimizer, 4) == 1.0
    # one process: an outer step of 1 whatever the optimizer; the user's outer_lr and a given period win
    model = torch.nn.Linear(2, 2)
    chosen = PeriodicSync(model, torch.optim.AdamW(model.parameters()), kind="diloco", every=None)
    assert chosen.outer is not None and chosen.outer.param_groups[0]["lr"] == 1.0 and chosen.outer_chosen
    given = PeriodicSync(model, torch.optim.AdamW(model.parameters()), kind="diloco", every=None, outer_lr=0.5)
    assert given.outer is not None and given.outer.param_groups[0]["lr"] == 0.5 and not given.outer_chosen
    fixed = PeriodicSync(model, torch.optim.AdamW(model.parameters()), kind="diloco", every=4)
    assert fixed.outer is not None and fixed.outer.param_groups[0]["lr"] == 0.7 and not fixed.outer_chosen


@pytest.mark.timeout(300)
def test_without_sync_every_the_period_is_chosen_once_from_the_link_and_a_resume_keeps_it(tmp_path, capfd):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    stopped = ddpkit.launch(workers.periodic_run, nprocs=2, args=("diloco", 20, 9, str(ckpt), None))
    decision = stopped[0]["decision"]
    assert decision is not None and decision == stopped[1]["decision"]  # one choice, the same on every rank
    assert stopped[0]["every"] == decision["every"] >= 2 and stopped[0]["delay"] == decision["delay"] >= 1
    # the rule applied to what was measured: a busy machine's loopback may be slow enough to set the
    # period, and then int8 or sparse is the right choice; where bf16 gives the shortest period whole, bf16
    from ddpkit.parallel.periodic_parts import MAX_DELAY, MIN_EVERY, choose_exchange, packet_bytes

    elements = sum(t.numel() for t in stopped[0]["synced"]) + 2 * 32  # the weights, then BatchNorm's statistics
    # as the run chose: an exchange behind MAX_DELAY steps at most, in fragments beyond
    measured = {k: decision[k] for k in ("step_s", "link_bytes_per_s", "latency_s")} | {"max_delay": MAX_DELAY}
    rule = choose_exchange(elements=elements, dtype="bf16", dtype_given=False, world=2, **measured)
    assert [decision[k] for k in ("every", "delay", "fragments", "dtype")] == [
        rule[k] for k in ("every", "delay", "fragments", "dtype")
    ]
    assert decision.get("density") == rule.get("density")
    assert decision["exchange_bytes"] == packet_bytes(decision["dtype"], elements, decision.get("density"))
    bf16 = choose_exchange(elements=elements, dtype="bf16", dtype_given=True, world=2, **measured)
    if (bf16["every"], bf16["fragments"]) == (MIN_EVERY, 1):  # the link sets neither period nor fragments
        assert decision["dtype"] == "bf16" and decision["exchange_bytes"] == 2 * elements
    # the outer step: the ranks' average change, times sqrt(2) for Adam's inner steps, and no momentum
    assert (decision["outer_lr"], decision["outer_momentum"]) == (math.sqrt(2), 0.0)
    printed = capfd.readouterr().err
    assert printed.count("sync='diloco' chose sync_every=") == 1, printed[-3000:]
    assert "outer step 1.41x the ranks' average change (sqrt of 2 ranks' adaptive inner steps)" in printed
    resumed = ddpkit.launch(workers.periodic_run, nprocs=2, args=("diloco", 20, None, str(ckpt), None))
    for run in resumed.values():
        assert run["step"] == 20 and run["decision"] == decision and run["every"] == decision["every"]
        assert run["syncs"] > 0
    assert "chose sync_every=" not in capfd.readouterr().err  # the resumed run decided nothing again


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--sync", "diloco"], "--sync diloco without --sync-every chooses its period in its first 6 steps"),
        (["--sync", "diloco", "--sync-every", "0"], "--sync-every 0: give the optimizer steps between syncs"),
        (["--sync", "diloco", "--warmup", "6", "--sync-delay", "2"], "give sync_every=H too"),
    ],
)
def test_the_bench_refuses_a_period_it_could_not_time_in_one_line(flags, says):
    from ddpkit.bench.flags import parse_settings

    with pytest.raises(UsageError, match=says):
        parse_settings(["--modes", "ddp", *flags])
    assert parse_settings(["--modes", "ddp", "--sync", "diloco", "--warmup", "6"]).sync_every is None  # chosen
