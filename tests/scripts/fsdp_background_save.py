"""Under strategy='fsdp' a save returns before its step directory is sealed, and holds the state
of its step while the loop goes on changing it."""

import os
import sys
import time

import torch

import ddpkit
import ddpkit.checkpoint.dcp as kdcp

directory = sys.argv[1]
real_seal = kdcp._seal


def slow_seal(*args):
    time.sleep(2)
    real_seal(*args)


kdcp._seal = slow_seal

rt = ddpkit.init(seed=0)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
model, opt = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=0.05), strategy="fsdp")
state = {"model": model, "opt": opt}


def step():
    rt.backward(model(torch.randn(8, 6)).pow(2).mean())
    rt.step(opt)


step()
step()
rt.save(os.path.join(directory, "blocking"), state, blocking=True)
path = rt.save(os.path.join(directory, "background"), state)
# one write of the whole line: the two ranks share stdout, and print's parts may interleave with the other's
sys.stdout.write(f"returned before the seal: {not path.exists()}\n")
sys.stdout.flush()
for _ in range(3):
    step()
rt.close()
