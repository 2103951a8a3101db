"""A stream whose first global batch takes ~6 s to read in a DataLoader worker, under hang_timeout=3.

``steady``: a sample every 0.075 s (progress the watchdog must see); ``stalled``: 6 s before the
first sample (no progress: the watchdog must fire).
"""

import sys
import time

import torch

import ddpkit


def steady(shard, start=0):
    for index in range(start, 80):
        time.sleep(0.075)
        yield torch.tensor([float(index)])


def stalled(shard, start=0):
    time.sleep(6)
    yield from (torch.tensor([float(index)]) for index in range(start, 80))


if __name__ == "__main__":
    rt = ddpkit.init(hang_timeout=3)
    read = steady if sys.argv[1] == "steady" else stalled
    loader = rt.loader(ddpkit.Shards([0], read, lengths=[80]), global_batch_size=80, num_workers=1)
    for batch in loader:
        rt.print(f"batch of {len(batch)}")
