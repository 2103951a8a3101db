"""What is left between one process and DDP x2 on the demo's run is float rounding, nothing else.

``ddpkit demo`` reports how far DDP x2 ends from one process's weights in float32: a sum over 64
samples and two sums over 32 differ in the last bit, and a ReLU or max-pool input within that bit
of its threshold goes the other way, which later steps carry on. Run in float64, the same two
trainings (global batches, sharding, per-rank weighting, BatchNorm statistics of the global batch)
must end within float64's rounding of each other; any difference of logic would show at 1e-3 or
more, as the hand-written loop's does.
"""

from __future__ import annotations

import pytest

import ddpkit
import workers
from ddpkit.bench.guarantee import max_rel_diff


@pytest.mark.slow  # 11 s: make test-slow; tests/test_exact.py holds the demo's micro-shard rows to equal bits
@pytest.mark.timeout(300)
def test_one_process_and_ddp_x2_end_within_float64_rounding_on_the_demos_run():
    one = ddpkit.launch(workers.digits_convnet, nprocs=1, args=("float64",))[0]
    two = ddpkit.launch(workers.digits_convnet, nprocs=2, args=("float64",))[0]
    assert one.keys() == two.keys()
    assert max_rel_diff(one, two) <= 1e-12


def test_max_rel_diff_is_each_tensors_largest_difference_over_its_largest_value():
    import torch

    reference = {"w": torch.tensor([2.0, -4.0]), "b": torch.tensor([1.0]), "steps": torch.tensor(3)}
    other = {"w": torch.tensor([2.0, -3.0]), "b": torch.tensor([1.1]), "steps": torch.tensor(5)}
    assert max_rel_diff(reference, other) == pytest.approx(0.25)  # w: 1 / 4; b: 0.1; ints ignored
    assert max_rel_diff(reference, reference) == 0.0
