"""Sparse gradients (``nn.Embedding(sparse=True)``): DDP's average made right beside them, clipped by
rt.clip_grad_norm_, and refused in one line by the modes that work on dense tensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ddpkit
import workers
from ddpkit.errors import UsageError
from ddpkit.parallel.modes import check_combination
from ddpkit.parallel.options import SetupOptions


def _relative(a: dict, b: dict) -> float:
    flat_a = torch.cat([v.double().flatten() for v in a["weights"].values()])
    flat_b = torch.cat([v.double().flatten() for v in b["weights"].values()])
    return float((flat_a - flat_b).norm() / flat_a.norm())


@pytest.mark.timeout(120)
def test_ddp_x2_with_a_sparse_embedding_beside_a_dense_layer_trains_to_one_processs_weights():
    """torch's reducer divided the sparse gradient in place, and its values were the very gradient the
    linear layer's backward read next: that layer's gradients came out halved on 2 processes (6.8e-2
    from one process after 8 steps, in float64; torch's own DDP does the same). ddpkit's hook divides a copy."""
    one = workers.sparse_branches()
    two = ddpkit.launch(workers.sparse_branches, nprocs=2)
    assert torch.allclose(two[0]["first"]["lin"], one["first"]["lin"], rtol=1e-13, atol=0)
    assert torch.allclose(two[0]["first"]["emb"], one["first"]["emb"], rtol=1e-13, atol=1e-17)
    assert _relative(two[0], one) < 1e-13


@pytest.mark.timeout(120)
def test_rt_clip_grad_norm_clips_sparse_gradients_as_their_dense_ones():
    sparse, dense = workers.sparse_branches(True, 0.05), workers.sparse_branches(False, 0.05)
    assert min(dense["norms"]) > 0.05  # every step clipped
    assert _relative(sparse, dense) < 1e-13
    assert sparse["norms"] == pytest.approx(dense["norms"], rel=1e-13)
    two = ddpkit.launch(workers.sparse_branches, nprocs=2, args=(True, 0.05))
    assert _relative(two[0], sparse) < 1e-13


@pytest.mark.parametrize(
    ("options", "micro_shards", "says"),
    [
        ({}, 2, r"^micro_shards=2 does not take sparse gradients \(the fixed tree sums dense gradients\)"),
        ({"strategy": "fsdp"}, None, r"^strategy='fsdp' does not take sparse gradients"),
        ({"grad_compression": "fp16"}, None, r"^grad_compression='fp16' does not take sparse gradients"),
        ({"grad_compression": "powersgd"}, None, r"^grad_compression='powersgd' does not take"),
    ],
)
def test_modes_of_dense_tensors_refuse_a_sparse_embedding_in_one_line(options: dict, micro_shards: Any, says: str):
    model = torch.nn.Sequential(torch.nn.Embedding(5, 2, sparse=True))
    with pytest.raises(
        UsageError, match=says + r".*the model's '0' makes them \(sparse=True\): build it with sparse=False"
    ):
        check_combination(
            micro_shards=micro_shards, options=SetupOptions(**options), world_size=2, model=model, models_set_up=0
        )
    check_combination(  # the same model with dense gradients
        micro_shards=micro_shards,
        options=SetupOptions(**options),
        world_size=2,
        model=torch.nn.Sequential(torch.nn.Embedding(5, 2)),
        models_set_up=0,
    )


def test_nccl_refuses_a_sparse_embedding_in_one_line():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 2, sparse=True))
    with pytest.raises(UsageError, match=r"^the model's '0' makes sparse gradients .*which NCCL cannot all-reduce"):
        SetupOptions().check(model, device=torch.device("cpu"), backend="nccl", precision="fp32")
    SetupOptions().check(model, device=torch.device("cpu"), backend="gloo", precision="fp32")


def test_a_fault_tolerant_replica_refuses_a_sparse_embedding_unless_it_trains_apart():
    from ddpkit.parallel.replica import FaultTolerant
    from test_fault_tolerant import _Quorum

    bag = torch.nn.EmbeddingBag(5, 2, sparse=True)
    with pytest.raises(UsageError, match=r"^--fault-tolerant does not take sparse gradients .*'EmbeddingBag'"):
        FaultTolerant(_Quorum()).prepare(bag, SetupOptions())
    FaultTolerant(_Quorum()).prepare(bag, SetupOptions(sync="diloco", sync_every=4))  # its gradients stay its own
