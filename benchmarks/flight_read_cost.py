"""What one read of torch's flight recorder costs the watchdog's thread, by how many entries it holds.

    ddpkit run -n 2 benchmarks/flight_read_cost.py

Each rank makes 30 collectives, times 20 reads (``ddpkit.observe.collectives.flight``: the dump and
its unpickling), then makes 2500 more (a full ring of 2000) and times 20 reads again. The watchdog
reads the recorder once a second while its rank has made no progress for 3 s, and once as the rank
closes. BENCHMARKS.md, "The flight recorder's part", holds what it printed.
"""

import os
import time

import torch
import torch.distributed as dist

import ddpkit
from ddpkit.observe import collectives

rt = ddpkit.init(seed=0, trackers=(), hang_timeout=0)  # the watchdog off: its own reads would not count
t = torch.ones(10)
for made in (30, 2500):
    for _ in range(made):
        dist.all_reduce(t)
    start = time.perf_counter()
    for _ in range(20):
        seen = collectives.flight()
    took = (time.perf_counter() - start) / 20 * 1e3
    os.write(1, f"rank {rt.rank}: {took:.2f} ms a read, the default group's last #{seen.last}\n".encode())
rt.close()
