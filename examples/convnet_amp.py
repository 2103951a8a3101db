"""A ConvNet with AMP (fp16 + loss scaling), SyncBatchNorm, checkpoints with the scaler, resume (seed 004).

The hand-written version needs mp.spawn, MASTER_ADDR/PORT, init_process_group,
convert_sync_batchnorm, a DistributedSampler with set_epoch, a seeded generator per rank, a
GradScaler's scale/step/update, rank-0 saving of model + scaler, and dist.reduce in the test.
Here each of those is one argument or one call; the checkpoint holds the model, the optimizer,
the loss scaler, the data position and every RNG, so a run stopped anywhere resumes exactly.

    python examples/convnet_amp.py                       # trains 3 epochs; run it again: resumes, done
    python examples/convnet_amp.py --epochs 5            # resumes from epoch 3 and trains two more
    ddpkit run -n 2 examples/convnet_amp.py              # two processes
    torchrun --standalone --nproc_per_node 2 examples/convnet_amp.py
    srun --ntasks-per-node=1 ddpkit run -n 4 examples/convnet_amp.py   # SLURM; or: ddpkit slurm ...

On a GPU the forward runs in fp16 on the tensor cores; on a CPU fp16 works too but is not faster
(use --precision bf16 on CPUs with AVX512-BF16/AMX). Prints one line at the end:
``world_size=2 precision=fp16 test_accuracy=... loss_scale=... resumed_from=... reload_equal=True``.
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.recipes.datasets import load_dataset


class ConvNet(torch.nn.Module):
    """The seed's ConvNet, for 8x8 digits (two conv + BatchNorm blocks, then a linear layer)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.layer1 = torch.nn.Sequential(torch.nn.Conv2d(1, 16, 5, padding=2), torch.nn.BatchNorm2d(16),
                                          torch.nn.ReLU(), torch.nn.MaxPool2d(2))
        self.layer2 = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 5, padding=2), torch.nn.BatchNorm2d(32),
                                          torch.nn.ReLU(), torch.nn.MaxPool2d(2))
        self.fc = torch.nn.Linear(2 * 2 * 32, num_classes)

    def forward(self, x):
        return self.fc(self.layer2(self.layer1(x)).flatten(1))


def build(rt):
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return rt.setup(model, optimizer, sync_batchnorm=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--precision", default="fp16", help="fp16 (AMP + GradScaler), bf16 or fp32")
    parser.add_argument("--checkpoints", default="runs/convnet_amp/checkpoints")
    args = parser.parse_args()
    if args.epochs < 1:
        parser.error("--epochs must be at least 1")

    rt = ddpkit.init(seed=0, precision=args.precision, checkpoint_dir=args.checkpoints, resume="auto")
    train, test = load_dataset("digits", "train"), load_dataset("digits", "test")
    model, optimizer = build(rt)
    loader = rt.loader(train.dataset, global_batch_size=64, shuffle=True, num_workers=2)
    state = {"model": model, "optimizer": optimizer}
    found = rt.resume(state)                    # the newest checkpoint in --checkpoints, if any

    for epoch in rt.epochs(args.epochs):        # starts after the resumed epoch
        for images, labels in loader:
            with rt.autocast():
                loss = F.cross_entropy(model(images), labels)
            rt.backward(loss)                   # scaled under fp16
            rt.step(optimizer)                  # unscaled, skipped on inf/nan, scaler updated
        saved = rt.checkpoint(state)            # atomic; rank 0 writes; the scaler goes with it
        rt.print(f"epoch {epoch}: saved {Path(saved).name}")

    # What a crash-and-restart would do: a fresh model and optimizer, loaded from the newest checkpoint.
    again, again_opt = build(rt)
    rt.load(args.checkpoints, {"model": again, "optimizer": again_opt})
    equal = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    metrics = ddpkit.evaluate(again, test.dataset, num_classes=10, autocast=rt.autocast)
    scale = rt.precision.scaler.get_scale() if rt.precision.scaler is not None else None
    rt.print(f"world_size={rt.world_size} precision={args.precision} test_accuracy={metrics['accuracy']:.4f} "
             f"loss_scale={scale} resumed_from={found.name if found else None} reload_equal={equal}")


if __name__ == "__main__":
    main()
