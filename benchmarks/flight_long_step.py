"""What the watchdog's reads of a full flight recorder cost a step that runs Python for seconds.

    ddpkit run -n 2 benchmarks/flight_long_step.py HANG STEPS     (HANG: -1 the default watchdog, 0 off)

Each rank fills the recorder's ring (2100 collectives), then runs steps of ~8 s: Python-bound
forwards of a 200-layer MLP with no ddpkit call (no progress for the watchdog: it looks at the
recorder from 3 s on), then one DDP step. Rank 0 prints the mean step time of steps 2 onwards.
BENCHMARKS.md, "The flight recorder's part", holds what it printed.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import ddpkit

hang = float(sys.argv[1])
steps = int(sys.argv[2])
torch.set_num_threads(1)
rt = ddpkit.init(seed=0, trackers=(), hang_timeout=None if hang < 0 else hang)
t = torch.ones(1)
for _ in range(2100):  # a full ring of 2000, as after some hundred steps of DDP
    dist.all_reduce(t)
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(200)])
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
model, optimizer = rt.setup(model, optimizer)
x = torch.randn(8, 16)
times = []
for _ in range(steps):
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(6000):  # seconds of Python-bound forwards with no ddpkit call: no progress beat
            model.module(x)
    loss = model(x).square().mean()
    rt.backward(loss)
    rt.step(optimizer)
    times.append(time.perf_counter() - start)
mean = sum(times[1:]) / (len(times) - 1)
os.write(
    1,
    f"hang={hang} rank {rt.rank}: {mean:.3f} s a step (steps 2..{steps}: {' '.join(f'{s:.2f}' for s in times[1:])})\n".encode(),
)
rt.close()
