"""README promises that had no test of their own: each test names the promise it keeps."""

from __future__ import annotations

import re

import pytest

import ddpkit
import workers
from ddpkit.distributed.host import threads_per_process
from helpers import ROOT, clean_env
from helpers import ddpkit as ddpkit_cli

THREADS = str(ROOT / "tests" / "scripts" / "threads.py")


@pytest.mark.timeout(120)
def test_sync_batchnorm_turns_off_the_per_forward_buffer_broadcast():
    """`rt.setup(model, sync_batchnorm=True)`: synced statistics need no broadcast from rank 0.

    A buffer tagged with each rank's number after setup survives a forward only when DDP does
    not broadcast buffers; without sync BN (DDP's default) rank 1's tag becomes rank 0's.
    """
    runs = ddpkit.launch(workers.buffer_broadcasts, nprocs=2)
    synced, plain = [{r: runs[r][sync] for r in (0, 1)} for sync in (True, False)]
    assert [synced[r]["tag"] for r in (0, 1)] == [0.0, 1.0]
    assert all(synced[r]["flag"] is False and synced[r]["sync_bn"] for r in (0, 1))
    assert [plain[r]["tag"] for r in (0, 1)] == [0.0, 0.0]  # the probe sees a broadcast
    assert plain[1]["flag"] is True and not plain[1]["sync_bn"]


def _threads(output: str) -> dict[str, tuple[str, int]]:
    return {
        rank: (omp, int(torch_threads))
        for rank, omp, torch_threads in re.findall(r"rank (\d+) OMP_NUM_THREADS=(\S+) torch_threads=(\d+)", output)
    }


@pytest.mark.slow  # 6 s: make test-slow
@pytest.mark.timeout(180)
def test_ddpkit_run_sets_omp_num_threads_in_its_children_unless_set():
    """`ddpkit run`: OMP_NUM_THREADS = cores / N on CPU unless you set it."""
    env = clean_env()
    env.pop("OMP_NUM_THREADS", None)
    result = ddpkit_cli("run", "-n", "2", THREADS, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    share = threads_per_process(2)
    assert _threads(result.stdout) == {"0": (str(share), share), "1": (str(share), share)}, result.stdout
    # One process would get every core; the user's one thread is kept, by torch too.
    mine = ddpkit_cli("run", "-n", "1", THREADS, env=clean_env(OMP_NUM_THREADS="1"), timeout=120)
    assert mine.returncode == 0, mine.stderr[-3000:]
    assert _threads(mine.stdout) == {"0": ("1", 1)}, mine.stdout


def _by_index(batch: tuple[list, list]) -> dict[int, list]:
    indices, noise = batch
    return dict(zip(indices, noise))


@pytest.mark.timeout(180)
def test_augmentation_does_not_change_with_processes_or_workers():
    """`ddpkit.sample_rng()` is keyed by (seed, epoch, index): 2 processes with a loader worker
    each see, step by step, exactly the noise one process without workers sees."""
    single = workers.augmented_batches(0)
    ddpkit.current().close()
    two = ddpkit.launch(workers.augmented_batches, nprocs=2, args=(1,))
    assert len(single) == len(two[0]) == len(two[1]) == 10  # 30 samples / 6, two epochs
    for step, reference in enumerate(single):
        merged = {**_by_index(two[0][step]), **_by_index(two[1][step])}
        assert merged == _by_index(reference), f"step {step}"
    first, second = _by_index(single[0]), {}
    for batch in single[5:]:
        second.update(_by_index(batch))
    assert all(first[i] != second[i] for i in first)  # a new epoch, new noise
