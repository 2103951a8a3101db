"""A complete ddpkit training script: the seeds' ConvNet on scikit-learn's digits.

    python examples/train_digits.py                          # one process
    ddpkit run -n 2 examples/train_digits.py --epochs 3      # two processes, same results
    torchrun --standalone --nproc_per_node 2 examples/train_digits.py
    ddpkit slurm --nodes 2 examples/train_digits.py | sbatch # a cluster

Rank 0 prints one line at the end: world_size, test_accuracy and test_count.
"""

import argparse

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.recipes.datasets import load_dataset
from ddpkit.recipes.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--checkpoints", default=None, help="directory to save into and resume from")
    args = parser.parse_args()

    rt = ddpkit.init(seed=0, checkpoint_dir=args.checkpoints, resume="auto" if args.checkpoints else None)
    with rt.local_main_first():
        train, test = load_dataset("digits", "train"), load_dataset("digits", "test")
    model = build_model("convnet", num_classes=10, in_channels=1, image_size=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer, sync_batchnorm=True)
    loader = rt.loader(train.dataset, global_batch_size=64, shuffle=True)
    state = {"model": model, "optimizer": optimizer}
    rt.resume(state)

    for epoch in rt.epochs(args.epochs):
        for images, labels in loader:
            with rt.autocast():
                loss = F.cross_entropy(model(images), labels)
            rt.backward(loss)
            rt.step(optimizer)
        metrics = ddpkit.evaluate(model, test.dataset, num_classes=10)
        rt.print(f"epoch {epoch}: test_accuracy={metrics['accuracy']:.4f}")
        if args.checkpoints:
            rt.checkpoint(state)
    final = ddpkit.evaluate(model, test.dataset, num_classes=10)
    rt.print(f"world_size={rt.world_size} test_accuracy={final['accuracy']:.4f} test_count={final['count']}")


if __name__ == "__main__":
    main()
