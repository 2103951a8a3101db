"""Print what a child of ``ddpkit run`` was given: OMP_NUM_THREADS and torch's intra-op threads."""

import os

import torch

print(
    f"rank {os.environ['RANK']} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} "
    f"torch_threads={torch.get_num_threads()}",
    flush=True,
)
