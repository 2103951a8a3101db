"""One process, DDP and DDP + AMP side by side on a ResNet-18 with CIFAR-10-shaped data (seed 003).

The seed timed single-GPU, DataParallel, DDP and DDP + AMP training by hand, with a script per
mode. Here one function trains; ``ddpkit.launch`` runs it as each mode, with the same global
batch, so the modes differ only in how the work is spread. Data: CIFAR-10 from torchvision's
files with --data-dir, else synthetic 3x32x32 images (nothing is downloaded).

    python examples/compare_modes.py                     # single, ddp x2, ddp x2 + AMP: a table
    ddpkit run -n 2 examples/compare_modes.py            # only the world it was started in
    torchrun --standalone --nproc_per_node 2 examples/compare_modes.py --precision bf16
    srun --ntasks-per-node=1 ddpkit run -n 4 examples/compare_modes.py   # SLURM; or: ddpkit slurm ...

For the full picture (DataParallel on GPUs, where the time goes, a diagnosis per row, a plot):
``ddpkit bench --model resnet18 --data synthetic --modes single,dp,ddp,ddp-amp --nproc 1,2``.
Prints one final line: ``fastest=ddp-amp x2 samples_per_s=... speedup_vs_single=...``
(under a launcher: ``world_size=2 precision=fp32 samples_per_s=...``).
"""

import argparse
import time

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.recipes.datasets import load_dataset
from ddpkit.recipes.models import build_model


def measure(precision: str, steps: int, global_batch: int, data_dir: str | None) -> float:
    """Train ResNet-18 for ``steps`` timed steps (after one warm-up) in this world; samples/s."""
    rt = ddpkit.init(seed=0, precision=precision)
    if data_dir:
        train = load_dataset("cifar10", "train", data_dir).dataset
    else:
        train = load_dataset("synthetic", "train", synthetic_size=global_batch * (steps + 1)).dataset
    model = build_model("resnet18", num_classes=10, in_channels=3, image_size=32)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                sync_batchnorm=True)
    loader = rt.loader(train, global_batch_size=global_batch, shuffle=True, drop_last=True)
    started = None
    for step, (images, labels) in enumerate(loader):
        if step == 1:
            rt.barrier()
            started = time.perf_counter()
        with rt.autocast():
            loss = F.cross_entropy(model(images), labels)
        rt.backward(loss)
        rt.step(optimizer)
        if step == steps:
            break
    rt.barrier()
    rate = global_batch * steps / (time.perf_counter() - started)
    return float(rt.all_reduce(rate)) / rt.world_size     # the same number on every rank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2, help="timed steps per mode (default 2)")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--nproc", type=int, default=2, help="processes of the DDP modes (default 2)")
    parser.add_argument("--precision", default=None, help="AMP precision (default: fp16 on GPU, bf16 on CPU)")
    parser.add_argument("--data-dir", default=None, help="torchvision's CIFAR-10 files (default: synthetic)")
    args = parser.parse_args()
    amp = args.precision or ("fp16" if torch.cuda.is_available() else "bf16")
    work = (args.steps, args.global_batch, args.data_dir)

    if ddpkit.detect().launcher != "none":          # started by ddpkit run, torchrun or srun: this world only
        precision = args.precision or "fp32"
        rate = measure(precision, *work)
        rt = ddpkit.current()
        rt.print(f"world_size={rt.world_size} precision={precision} samples_per_s={rate:.1f}")
        return

    modes = [("single", 1, "fp32"), ("ddp", args.nproc, "fp32"), ("ddp-amp", args.nproc, amp)]
    rates = {}
    for name, nproc, precision in modes:
        rates[f"{name} x{nproc}"] = ddpkit.launch(measure, nprocs=nproc, args=(precision, *work))[0]
    single = rates["single x1"]
    print(f"{'mode':<14}{'samples/s':>10}{'vs single':>11}")
    for label, rate in rates.items():
        print(f"{label:<14}{rate:>10.1f}{rate / single:>10.2f}x")
    if rates[f"ddp-amp x{args.nproc}"] < rates[f"ddp x{args.nproc}"]:
        print(f"note: {amp} ran slower than fp32: this hardware does not accelerate it (bf16 needs "
              "AVX512-BF16 or AMX on a CPU, fp16 a GPU); 'ddpkit bench' names what bounds each mode")
    fastest = max(rates, key=rates.get)
    print(f"fastest={fastest} samples_per_s={rates[fastest]:.1f} speedup_vs_single={rates[fastest] / single:.2f}")


if __name__ == "__main__":
    main()
