"""The hand-written DDP training of the seeds' blog posts, whole epochs: what ``ddpkit demo`` compares.

Plain ``torch.distributed`` as the tutorials write it: ``DistributedSampler`` (padding the last
batch with repeated samples), the single process's batch size on every process (so the
effective batch grows with the world size), ``set_epoch`` every epoch, plain BatchNorm, and rank 0
evaluating the whole test set on its own. It trains the same model on the same data with the same
seed and optimizer as ``ddpkit train``, and rank 0 saves its final weights and the test loss
after each epoch, so the demo can say how far from one process's result this loop ends::

    ddpkit run -n 2 -m ddpkit.bench.raw_train --model convnet --data digits --epochs 5 --batch 64 \\
        --lr 0.05 --momentum 0.9 --seed 0 --out runs/demo/hand-written-ddp-x2

``benchmarks/raw_ddp.py --epochs N ...`` runs it from a checkout. From ddpkit it takes only the
model and data builders (plain ``nn.Module`` and ``Dataset``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from ddpkit.recipes.datasets import load_dataset
from ddpkit.recipes.models import build_model

WEIGHTS = "weights.pt"
"""What rank 0 saves in ``--out``: ``{"model": state_dict, "test_loss": [per epoch]}``."""


def parser() -> argparse.ArgumentParser:
    """The loop's arguments."""
    parser = argparse.ArgumentParser(prog="python -m ddpkit.bench.raw_train")
    parser.add_argument("--model", default="convnet")
    parser.add_argument("--data", default="digits")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--batch", type=int, default=64, help="samples per process per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="directory rank 0 writes weights.pt into")
    return parser


def test_loss(model: torch.nn.Module, dataset: Any, device: torch.device) -> float:
    """Mean cross-entropy over the whole of ``dataset``, in eval mode (rank 0 alone, as the posts do)."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, targets in DataLoader(dataset, batch_size=256):
            logits = model(inputs.to(device))
            total += F.cross_entropy(logits, targets.to(device), reduction="sum").item()
            count += len(targets)
    model.train()
    return total / count


def train(opts: argparse.Namespace) -> None:
    """Train ``opts.epochs`` epochs; rank 0 writes ``weights.pt`` into ``opts.out``."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:  # as the blog posts do: each rank's own GPU before NCCL's (else every rank's context lands on GPU 0)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        train_set, test_set = load_dataset(opts.data, "train"), load_dataset(opts.data, "test")
        torch.manual_seed(opts.seed)
        model = build_model(
            opts.model,
            num_classes=train_set.num_classes,
            in_channels=train_set.in_channels,
            image_size=train_set.image_size,
        ).to(device)
        model = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=opts.momentum)
        sampler = DistributedSampler(
            train_set.dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=opts.seed
        )
        loader = DataLoader(train_set.dataset, batch_size=opts.batch, sampler=sampler)
        losses = []
        for epoch in range(opts.epochs):
            sampler.set_epoch(epoch)
            for inputs, targets in loader:
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(model(inputs.to(device)), targets.to(device)).backward()
                optimizer.step()
            if rank == 0:
                losses.append(test_loss(model.module, test_set.dataset, device))
            dist.barrier()
        if rank == 0:
            out = Path(opts.out)
            out.mkdir(parents=True, exist_ok=True)
            torch.save(
                {"model": {k: v.cpu() for k, v in model.module.state_dict().items()}, "test_loss": losses},
                out / WEIGHTS,
            )
            (out / "summary.json").write_text(
                json.dumps(
                    {
                        "world_size": world_size,
                        "batch_per_process": opts.batch,
                        "epochs": opts.epochs,
                        "test_loss": losses,
                    }
                )
                + "\n"
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ddpkit.bench.raw_train`` under a launcher."""
    opts = parser().parse_args(argv)
    if "RANK" not in os.environ:
        sys.stderr.write(
            "start the hand-written loop under a launcher: ddpkit run -n 2 -m ddpkit.bench.raw_train ...\n"
        )
        return 2
    train(opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
