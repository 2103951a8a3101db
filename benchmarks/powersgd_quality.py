"""What PowerSGD's defaults cost in accuracy on short runs of MLPs it was not tuned on.

Trains each MLP of a grid (widths, depths, optimizers, learning rates, global batches) on digits
for ``--steps`` optimizer steps, once per seed, with ``--grad-compression`` (and any
``--powersgd-rank``/``--powersgd-start``), and prints one JSON line per run: the test accuracy.
Run it once with ``none`` and once with ``powersgd`` and compare line by line::

    ddpkit run -n 2 benchmarks/powersgd_quality.py --grad-compression none --steps 40
    ddpkit run -n 2 benchmarks/powersgd_quality.py --grad-compression powersgd --steps 40

Every run is one ``rt.setup`` of a fresh model in the same job (a process start per run would
take most of the time).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.recipes.datasets import load_dataset

GRID = {
    "widths": ((512, 512), (1024,), (128, 64), (2048, 256)),
    "optimizer": ("sgd", "adamw"),
    "global_batch": (64, 256),
}
"""The held-out MLPs: none of them is ``--model mlp`` (256, 128), which the defaults were chosen on."""
LR = {"sgd": 0.05, "adamw": 1e-3}


def mlp(widths: tuple[int, ...], inputs: int, classes: int) -> torch.nn.Module:
    """``inputs`` -> each of ``widths`` (ReLU) -> ``classes``."""
    layers: list[torch.nn.Module] = [torch.nn.Flatten()]
    for width in widths:
        layers += [torch.nn.Linear(inputs, width), torch.nn.ReLU()]
        inputs = width
    return torch.nn.Sequential(*layers, torch.nn.Linear(inputs, classes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/powersgd_quality.py")
    parser.add_argument("--grad-compression", default="none")
    parser.add_argument("--powersgd-rank", type=int, default=None)
    parser.add_argument("--powersgd-start", type=int, default=None)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=3)
    opts = parser.parse_args(argv)
    rt = ddpkit.init(seed=0)
    train = load_dataset("digits", "train")
    test = load_dataset("digits", "test")
    knobs = {k: v for k, v in (("powersgd_rank", opts.powersgd_rank), ("powersgd_start", opts.powersgd_start)) if v}
    compression = None if opts.grad_compression == "none" else opts.grad_compression
    for run, (widths, name, batch, seed) in enumerate(itertools.product(*GRID.values(), range(opts.seeds))):
        torch.manual_seed(seed)
        model = mlp(widths, train.in_channels * train.image_size**2, train.num_classes)
        opt = (torch.optim.SGD(model.parameters(), lr=LR[name], momentum=0.9) if name == "sgd"
               else torch.optim.AdamW(model.parameters(), lr=LR[name]))
        model, opt = rt.setup(model, opt, grad_compression=compression, **knobs)
        loader = rt.loader(train.dataset, global_batch_size=batch, shuffle=True, name=f"train-{run}")
        steps = 0
        while steps < opts.steps:
            for inputs, targets in loader:
                rt.backward(F.cross_entropy(model(inputs), targets))
                rt.step(opt)
                steps += 1
                if steps == opts.steps:
                    break
        accuracy = ddpkit.evaluate(model, test.dataset, num_classes=train.num_classes)["accuracy"]
        if rt.is_main:
            print(json.dumps({"widths": list(widths), "optimizer": name, "global_batch": batch, "seed": seed,
                              "compression": opts.grad_compression, **knobs, "steps": steps,
                              "accuracy": accuracy}), flush=True)
    rt.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
