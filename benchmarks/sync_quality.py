"""What a compression or an infrequent sync costs in quality, at the same number of samples.

Trains ``tiny-lm`` (the 5.7M-parameter transformer of ``ddpkit bench --model tiny-lm``, AdamW, on
the synthetic Markov-chain tokens) or the digits ConvNet (SGD with momentum, as ``ddpkit train``)
for a fixed number of optimizer steps of one global batch, then prints one JSON line: the
held-out loss (tiny-lm: mean next-token cross-entropy on the test split; ConvNet: test loss and
accuracy), evaluated on the synced weights::

    ddpkit run -n 2 benchmarks/sync_quality.py --model tiny-lm --steps 600 --sync diloco --sync-every 50
    ddpkit run -n 2 benchmarks/sync_quality.py --model convnet --epochs 3 --grad-compression powersgd
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.parallel.periodic_parts import EXCHANGES
from ddpkit.recipes.datasets import load_dataset
from ddpkit.recipes.models import build_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/sync_quality.py")
    parser.add_argument("--model", choices=("tiny-lm", "convnet"), default="tiny-lm")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps (else --epochs)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs, where --steps is 0")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=None, help="inner lr (default: 1e-3 AdamW / 0.05 SGD)")
    parser.add_argument("--grad-compression", default="none")
    parser.add_argument("--sync", default="every-step")
    parser.add_argument("--sync-every", type=int, default=None)
    parser.add_argument("--sync-dtype", default=None, choices=EXCHANGES)
    parser.add_argument("--sync-fragments", type=int, default=1, help="Streaming DiLoCo's fragments")
    parser.add_argument("--sync-delay", type=int, default=0, help="inner steps an exchange runs in the background")
    parser.add_argument("--outer-lr", type=float, default=None, help="default: 0.7 with --sync-every; without, the average (x sqrt(world) for AdamW)")
    parser.add_argument("--outer-momentum", type=float, default=None, help="default: 0.9 with --sync-every, 0 without")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sparse-density", type=float, default=None,
                        help="the share a given sparse exchange sends (default: SPARSE_DENSITIES[0])")
    opts = parser.parse_args(argv)
    if opts.sparse_density:
        from ddpkit.parallel import periodic_parts

        periodic_parts.SPARSE_DENSITY = opts.sparse_density

    rt = ddpkit.init(seed=opts.seed)
    lm = opts.model == "tiny-lm"
    train = load_dataset("tokens" if lm else "digits", "train", synthetic_size=8192)
    test = load_dataset("tokens" if lm else "digits", "test", synthetic_size=512)
    model = build_model(opts.model, num_classes=train.num_classes, in_channels=train.in_channels,
                        image_size=train.image_size)
    if lm:
        optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr or 1e-3, weight_decay=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=opts.lr or 0.05, momentum=0.9)
    extra = {} if opts.sync == "every-step" else {"sync": opts.sync, "sync_every": opts.sync_every,
                                                  "sync_fragments": opts.sync_fragments, "sync_delay": opts.sync_delay,
                                                  "outer_lr": opts.outer_lr, "outer_momentum": opts.outer_momentum,
                                                  "sync_dtype": opts.sync_dtype}
    compression = None if opts.grad_compression == "none" else opts.grad_compression
    model, optimizer = rt.setup(model, optimizer, grad_compression=compression,
                                sync_batchnorm=not lm and opts.sync == "every-step", **extra)
    loader = rt.loader(train.dataset, global_batch_size=opts.global_batch, shuffle=True)
    epochs = math.ceil(opts.steps / len(loader)) if opts.steps else opts.epochs
    for _ in rt.epochs(epochs):
        for inputs, targets in loader:
            rt.backward(F.cross_entropy(model(inputs), targets))
            rt.step(optimizer)
            if opts.steps and rt.global_step >= opts.steps:
                break
        if opts.steps and rt.global_step >= opts.steps:
            break
    from ddpkit.parallel import periodic

    syncer = periodic.of(model)
    if syncer is not None:
        syncer.finish()     # the loop left rt.epochs by break: the final exchange, what is in flight included
    if lm:
        logits = ddpkit.predict(model, torch.utils.data.TensorDataset(test.dataset.tokens[:, :-1]), to="all")
        result = {"val_loss": F.cross_entropy(logits, test.dataset.tokens[:, 1:]).item()}
    else:
        metrics = ddpkit.evaluate(model, test.dataset, num_classes=10)
        result = {"test_loss": metrics["loss"], "test_accuracy": metrics["accuracy"]}
    if rt.is_main:
        print(json.dumps({"model": opts.model, "world_size": rt.world_size, "steps": rt.global_step,
                          "samples": rt.global_step * opts.global_batch, "grad_compression": opts.grad_compression,
                          "sync": opts.sync, "sync_every": syncer.every if syncer else None,
                          "sync_decision": syncer.decision if syncer else None, "sync_dtype": opts.sync_dtype,
                          "sync_fragments": opts.sync_fragments, "sync_delay": syncer.delay if syncer else 0,
                          "seed": opts.seed, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
