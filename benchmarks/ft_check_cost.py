"""What a fault-tolerant replica's check costs one call: ``rt.all_reduce`` of one element inside a step.

    ddpkit run --fault-tolerant -n 2 --min-replicas 2 benchmarks/ft_check_cost.py on
    ddpkit run --fault-tolerant -n 2 --min-replicas 2 benchmarks/ft_check_cost.py off

``off`` replaces ``Replica.announce`` (the check before each quorum collective) by a no-op on every
replica. Replica 0 prints the milliseconds per call of each step, sorted (200 calls a step, 8 steps).
BENCHMARKS.md, "A fault-tolerant replica's checks", holds what it printed.
"""

import sys
import time

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.distributed import ft

rt = ddpkit.init(seed=0, trackers=())
if sys.argv[1] == "off":
    ft.Replica.announce = lambda self, *args, **kwargs: None
net = torch.nn.Linear(4, 2)
model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
per_call = []
for x, y in rt.loader(data, global_batch_size=8):
    rt.backward(F.cross_entropy(model(x), y))
    one = torch.ones(1)
    start = time.perf_counter()
    for _ in range(200):
        rt.all_reduce(one)
    per_call.append((time.perf_counter() - start) / 200)
    rt.step(optimizer)
if rt.replica == 0:
    print(sys.argv[1], "ms per call:", " ".join(f"{1e3 * v:.3f}" for v in sorted(per_call)), flush=True)
