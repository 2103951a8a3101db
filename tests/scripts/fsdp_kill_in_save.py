"""Train under strategy='fsdp', saving every step; killed inside the save of step ``argv[2]``
(argv[1]: the checkpoint directory). In a world of one, just before the step directory is renamed
into place (by the writer thread: saves are in the background); under ``ddpkit run -n N``, with
blocking saves, the last rank dies right after writing its shards, while rank 0 waits to commit. It resumes from checkpoint_dir (resume='auto') and prints the step it resumed at."""

import os
import signal
import sys

import torch
import torch.distributed.checkpoint

import ddpkit
import ddpkit.checkpoint.dcp

directory, kill_at = sys.argv[1], int(sys.argv[2])
rt = ddpkit.init(seed=0, checkpoint_dir=directory, resume="auto")
model = torch.nn.Linear(4, 2)
model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="fsdp")
state = {"model": model, "opt": opt}
found = rt.resume(state)
print(f"resumed from {found.name if found else None} at step {rt.global_step}", flush=True)
real_replace = os.replace


def killed(src, dst):
    if os.path.basename(dst) == f"ckpt-step{kill_at:08d}":
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)


def killed_after_shards(*args, **kwargs):
    written = real_dcp_save(*args, **kwargs)
    if rt.global_step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return written


ddpkit.checkpoint.dcp.os.replace = killed
real_dcp_save = torch.distributed.checkpoint.save
if rt.world_size > 1 and rt.rank == rt.world_size - 1:
    torch.distributed.checkpoint.save = killed_after_shards
for _ in range(4):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    rt.backward(loss)
    rt.step(opt)
    rt.save(directory, state, blocking=rt.world_size > 1)
