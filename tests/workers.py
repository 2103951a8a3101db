"""Functions run in child processes by tests (module level so spawned children can import them)."""

from __future__ import annotations

import ddpkit


def rank_sum() -> dict:
    rt = ddpkit.init()
    return {"rank": rt.rank, "world_size": rt.world_size, "sum": int(rt.all_reduce(rt.rank))}


def fail_on_rank_one() -> None:
    rt = ddpkit.init()
    if rt.rank == 1:
        raise ValueError("rank one refuses")
    rt.barrier()


def gather_uneven() -> list:
    import torch

    rt = ddpkit.init()
    rows = torch.full((rt.rank, 2), float(rt.rank))  # rank 0 holds zero rows
    gathered = rt.all_gather(rows)
    means = rt.all_reduce(torch.tensor([float(rt.rank)]), op="mean")
    return [gathered.tolist(), means.tolist(), rt.all_reduce(rt.rank, op="max")]
