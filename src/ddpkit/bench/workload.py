"""The workload every bench loop runs: its arguments, its data set and its optimizer.

ddpkit's loop (:mod:`ddpkit.bench.worker`), the hand-written one (:mod:`ddpkit.bench.raw_ddp`)
and the peers of ``benchmarks/peers.py`` all parse :func:`worker_parser`'s arguments and build
the same data (:func:`bench_dataset`) and optimizer (:func:`make_optimizer`), so a comparison
differs only in the loop.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from ddpkit.errors import UsageError
from ddpkit.parallel.periodic_parts import EXCHANGES
from ddpkit.recipes.datasets import DatasetInfo, load_dataset

SYNTHETIC_POOL = 2048
"""Samples of ``--data synthetic`` (rounded up to whole global batches); epochs wrap around it."""


def worker_parser(prog: str) -> argparse.ArgumentParser:
    """The arguments every bench loop takes; the parent always passes every one of them."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--precision", required=True, choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--batch", type=int, required=True, help="samples per process per step")
    parser.add_argument("--steps", type=int, required=True, help="timed steps")
    parser.add_argument("--warmup", type=int, required=True, help="untimed steps before them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--result", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--grad-compression", default="none", choices=("none", "fp16", "bf16", "powersgd", "auto"))
    parser.add_argument("--data-format", default="map", choices=("map", "shards"))
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"))
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp"))
    parser.add_argument("--sync-bn", action="store_true", help="BatchNorm statistics across processes")
    parser.add_argument("--sync", default="every-step", choices=("every-step", "local-sgd", "diloco"))
    parser.add_argument("--sync-every", type=int, default=None, help="optimizer steps between infrequent syncs")
    parser.add_argument("--powersgd-rank", type=int, default=None, help="PowerSGD's rank (default: rt.setup's)")
    parser.add_argument("--sync-dtype", default=None, choices=EXCHANGES, help="the infrequent sync's exchange")
    parser.add_argument("--sync-fragments", type=int, default=1, help="Streaming DiLoCo's fragments")
    parser.add_argument("--sync-delay", type=int, default=0, help="inner steps an exchange runs in the background")
    parser.add_argument(
        "--micro-shards",
        type=int,
        default=None,
        help="rt.setup(micro_shards=M): each batch in M shards, summed along one tree (ddpkit's loop)",
    )
    return parser


def powersgd_start(warmup: int) -> int:
    """PowerSGD's plain steps in a bench: the warm-up ones (at least 2), so timed steps compress."""
    return max(2, warmup)


def bench_dataset(name: str, global_batch: int, model: str = "") -> DatasetInfo:
    """The training set cut to a whole number of global batches.

    Every step then holds exactly ``global_batch`` samples, and ddpkit's sharding equals
    ``DistributedSampler`` + ``DataLoader``'s (they agree when the size divides), which the
    bitwise parity check with the raw loop needs. ``model="tiny-lm"`` reads synthetic token
    sequences whatever ``name`` says (the bench refuses other data for it).

    Raises:
        UsageError: the data set holds fewer samples than one global batch.
    """
    if model == "tiny-lm":
        name = "tokens"
    if name in ("synthetic", "tokens"):
        size = -(-max(SYNTHETIC_POOL, global_batch) // global_batch) * global_batch
        return load_dataset(name, "train", synthetic_size=size)
    info = load_dataset(name, "train")
    usable = len(info.dataset) // global_batch * global_batch
    if usable == 0:
        raise UsageError(
            f"--data {name} has {len(info.dataset)} training samples, fewer than one "
            f"global batch of {global_batch}; lower --batch or --nproc"
        )
    if usable == len(info.dataset):
        return info
    return dataclasses.replace(info, dataset=torch.utils.data.Subset(info.dataset, range(usable)))


def make_optimizer(model: torch.nn.Module, opts: argparse.Namespace) -> torch.optim.Optimizer:
    """``--optimizer``: SGD with momentum, or AdamW (two state tensors per parameter)."""
    if opts.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=opts.lr)
    return torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=opts.momentum)
