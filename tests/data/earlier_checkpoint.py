"""Writes (and continues) the checkpoint tests/test_checkpoint.py loads with today's code.

Run once with an earlier ddpkit on the path; the files it wrote are committed:

    PYTHONPATH=<checkout of 040cd72>/src python tests/data/earlier_checkpoint.py tests/data/v040cd72

It trains 3 steps of a small model with BatchNorm, dropout, a scheduler and a shuffled loader and
saves; then, in a fresh process as a restarted job would, the same ddpkit loads the checkpoint,
trains 4 steps more (crossing an epoch) and the final weights' digest is written. Today's code,
loading the checkpoint and training the same 4 steps (``--resume DIR``), must end on that digest.

The final weights' bits depend on the CPU's kernels (an Intel AVX-512 machine and the AMD one the
fixture was first written on round matmuls apart), so ``expected.json`` holds the earlier code's
digest for each kind of CPU it was run on (``--resume`` with the earlier ddpkit on the path), and
facts that hold on any CPU: the restored state's digest, each step's sample indices and the random
generator's state after it (dropout's masks), and the final weights for a close comparison where
no digest was recorded for the CPU.
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


def train(rt, model, optimizer, scheduler, loader, steps: int, seen: list | None = None) -> None:
    """``steps`` steps; ``seen`` gets each step's sample indices and the generator's state after it."""
    done = 0
    for _ in rt.epochs(100):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            rt.backward(loss)
            rt.step(optimizer)
            scheduler.step()
            if seen is not None:
                rows = loader.dataset.tensors[0]
                indices = [int((rows == row).all(dim=1).nonzero()[0]) for row in x]
                seen.append([indices, hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()])
            done += 1
            if done == steps:
                return


def digest(model) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def restored(model, optimizer) -> str:
    """The digest of the weights and the optimizer's state as loaded: bytes read, on any CPU alike."""
    h = hashlib.sha256(digest(model).encode())
    for index, entry in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(entry.items()):
            h.update(f"{index}/{key}".encode())
            h.update(value.numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode())
    return h.hexdigest()


def cpu_kind() -> str:
    """The CPU's vendor and the kernels torch picked for it (``GenuineIntel AVX512``)."""
    vendor = "unknown"
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("vendor_id"):
                vendor = line.split(":", 1)[1].strip()
                break
    return f"{vendor} {torch.backends.cpu.get_cpu_capability()}"


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
    found = json.loads(resumed.stdout.strip().splitlines()[-1])
    expected = {
        "step": found["step"],
        "ddpkit": ddpkit.__version__,
        "digests": {found["cpu"]: found["digest"]},  # run --resume on other CPUs to add theirs
        "facts": found["facts"],
        "weights": found["weights"],
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


def resume(directory: Path) -> None:
    rt = ddpkit.init(seed=0)
    model, optimizer, scheduler, loader = build(rt)
    rt.load(directory / "ckpt.pt", {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    facts = {"restored": restored(model, optimizer), "steps": []}
    train(rt, model, optimizer, scheduler, loader, STEPS_AFTER, facts["steps"])
    weights = {name: tensor.flatten().tolist() for name, tensor in sorted(model.state_dict().items())}
    print(
        json.dumps(
            {"digest": digest(model), "step": rt.global_step, "cpu": cpu_kind(), "facts": facts, "weights": weights}
        )
    )


if __name__ == "__main__":
    if sys.argv[1] == "--resume":
        resume(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]))
