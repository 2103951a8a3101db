"""Writes (and continues) the checkpoint tests/test_checkpoint.py loads with today's code.

Run once with an earlier ddpkit on the path; the files it wrote are committed:

    PYTHONPATH=<checkout of 040cd72>/src python tests/data/earlier_checkpoint.py tests/data/v040cd72

It trains 3 steps of a small model with BatchNorm, dropout, a scheduler and a shuffled loader and
saves; then, in a fresh process as a restarted job would, the same ddpkit loads the checkpoint,
trains 4 steps more (crossing an epoch) and the final weights' digest is written. Today's code,
loading the checkpoint and training the same 4 steps (``--resume DIR``), must end on that digest.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import torch

import ddpkit

STEPS_BEFORE, STEPS_AFTER = 3, 4


def build(rt):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(40, 6, generator=generator), torch.randint(0, 3, (40,), generator=generator)
    )
    loader = rt.loader(data, global_batch_size=8, shuffle=True)
    return model, optimizer, scheduler, loader


def train(rt, model, optimizer, scheduler, loader, steps: int) -> None:
    done = 0
    for _ in rt.epochs(100):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            rt.backward(loss)
            rt.step(optimizer)
            scheduler.step()
            done += 1
            if done == steps:
                return


def digest(model) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rt = ddpkit.init(seed=0)
    model, optimizer, scheduler, loader = build(rt)
    train(rt, model, optimizer, scheduler, loader, STEPS_BEFORE)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}  # the loop is ddpkit's own
    rt.save(out / "ckpt.pt", state)
    resumed = subprocess.run(
        [sys.executable, __file__, "--resume", str(out)], capture_output=True, text=True, check=True
    )
    expected = json.loads(resumed.stdout.strip().splitlines()[-1])
    (out / "expected.json").write_text(json.dumps({**expected, "ddpkit": ddpkit.__version__}) + "\n")


def resume(directory: Path) -> None:
    rt = ddpkit.init(seed=0)
    model, optimizer, scheduler, loader = build(rt)
    rt.load(directory / "ckpt.pt", {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    train(rt, model, optimizer, scheduler, loader, STEPS_AFTER)
    print(json.dumps({"digest": digest(model), "step": rt.global_step}))


if __name__ == "__main__":
    if sys.argv[1] == "--resume":
        resume(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]))
