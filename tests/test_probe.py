"""The link probe: a slow link is timed on a cut sum, within the probe's budget, for a process group
as for a fault-tolerant quorum (one timing, :func:`ddpkit.distributed.probe.timed_link`)."""

from __future__ import annotations

import time

import pytest
import torch


class _Clock:
    """The probe's clock, moved by the sums it times: a busy machine's scheduling is not in the times."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    from ddpkit.distributed import probe

    made = _Clock()
    monkeypatch.setattr(probe, "time", made)
    return made


def _slow_sum(bytes_per_s: float, calls: list[int], clock: _Clock):
    def sum_(tensor: torch.Tensor) -> None:
        calls.append(tensor.numel())
        clock.now += 0.001 + tensor.numel() * tensor.element_size() / bytes_per_s

    return sum_


def test_a_slow_links_larger_sum_is_cut_to_the_budget_and_its_speed_still_measured(monkeypatch, clock):
    from ddpkit.distributed import probe

    monkeypatch.setattr(probe, "PROBE_BUDGET_S", 0.4)  # a quarter: 0.1 s of sum
    calls: list[int] = []
    agreed: list[list[float]] = []
    latency, seconds, sent = probe.timed_link(
        _slow_sum(2e6, calls, clock), lambda values: agreed.append(values.tolist()), 4 << 20, torch.device("cpu")
    )
    assert clock.now < 2.1  # not one whole 4 MiB sum (2.1 s)
    assert (
        calls[:9] == [1] * 9 and calls[9] == probe.FIRST_ELEMENTS
    )  # set-up, one timed, 7 latency calls, the predictor
    assert [len(values) for values in agreed] == [1, 1]  # a one-element call's time, then the prediction
    assert 256 << 10 <= sent < 4 << 20 and sent == 4 * calls[-1]
    assert calls.count(calls[-1]) >= 3  # repeated at least 3 times
    assert sent / (seconds - latency) == pytest.approx(2e6, rel=1e-4)  # less a 4-byte call's latency


def test_a_fast_link_is_timed_on_the_whole_sum(clock):
    from ddpkit.distributed import probe

    calls: list[int] = []
    latency, seconds, sent = probe.timed_link(
        _slow_sum(2e9, calls, clock), lambda v: None, 4 << 20, torch.device("cpu")
    )
    assert sent == 4 << 20 and calls[-1] == 1 << 20 and latency < seconds


def test_the_groups_largest_prediction_cuts_the_sum_on_every_rank(clock):
    """A rank whose own first sum was fast still cuts where a peer's was slow: the sizes pair up."""
    from ddpkit.distributed import probe

    def slowest_peer(values: torch.Tensor) -> None:
        values.fill_(10.0)  # a peer took 10 s for a one-element sum and for the 256 KB sum

    calls: list[int] = []
    *_, sent = probe.timed_link(_slow_sum(2e9, calls, clock), slowest_peer, 4 << 20, torch.device("cpu"))
    assert sent == 4 * probe.FIRST_ELEMENTS  # cut to the first sum's size, the least it goes
    assert len(calls) == 2 + 3 + 1 + 3  # set-up, one timed, 3 latency calls (a peer's was slow), the first, 3 larger


def test_a_process_groups_link_on_a_slow_link_is_timed_in_seconds(tmp_path, monkeypatch):
    """``probe.link`` (``grad_compression="auto"``, a period chosen at setup) times the group's own
    allreduce through the same cut: at 1 Mbit/s it no longer spends 4 whole 4 MiB calls (160 s)."""
    import torch.distributed as dist

    from ddpkit.distributed import probe

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    monkeypatch.setattr(probe, "PROBE_BUDGET_S", 0.4)
    real = dist.all_reduce
    sizes: list[int] = []

    def slow_all_reduce(tensor, op=dist.ReduceOp.SUM, **kwargs):
        if op == dist.ReduceOp.SUM:  # the timed sums over a 2e6 B/s link; the agreements free
            sizes.append(tensor.numel())
            time.sleep(0.001 + tensor.numel() * tensor.element_size() / 2e6)
        return real(tensor, op=op, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", slow_all_reduce)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)  # a ring of two sends N bytes a rank
    started = time.perf_counter()
    latency, speed = probe.link(4 << 20, torch.device("cpu"))
    assert time.perf_counter() - started < 2.1
    assert max(sizes) < 1 << 20 and sizes.count(max(sizes)) >= 3
    assert speed == pytest.approx(2e6, rel=0.3) and 0.001 <= latency < 0.01
