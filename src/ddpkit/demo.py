"""``ddpkit demo``: the smallest real end-to-end job (replaced by training in the training issue)."""

from __future__ import annotations

import time

from ddpkit.launch import launch


def _worker() -> dict:
    import ddpkit

    rt = ddpkit.init()
    total = rt.all_reduce(rt.rank)
    rt.barrier()
    return {"rank": rt.rank, "world_size": rt.world_size, "rank_sum": int(total), "backend": rt.backend}


def main(nproc: int = 2) -> int:
    start = time.perf_counter()
    results = launch(_worker, nprocs=nproc)
    elapsed = time.perf_counter() - start
    first = results[0]
    expected = nproc * (nproc - 1) // 2
    print(f"ddpkit demo: {nproc} processes on {first['backend']} all-reduced their ranks: "
          f"world_size={first['world_size']} rank_sum={first['rank_sum']} (expected {expected}) "
          f"in {elapsed:.1f}s")
    return 0 if all(r["rank_sum"] == expected for r in results.values()) else 1
