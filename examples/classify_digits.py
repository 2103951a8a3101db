"""Classification with metrics over the whole test set and predictions in input order (seed 000).

The hand-written version shards the test set with a DistributedSampler, so each rank's accuracy
covers its shard only; all_gather'ing the predictions brings back padded duplicates in an
interleaved order nobody can map back to the inputs. Here ``ddpkit.evaluate`` counts every test
sample exactly once and ``ddpkit.predict`` returns one row per input, in input order, on any
number of processes, and the global batch keeps the result the same on 1 or N processes.

    python examples/classify_digits.py                           # one process
    ddpkit run -n 2 examples/classify_digits.py                  # two, the same numbers (*)
    torchrun --standalone --nproc_per_node 2 examples/classify_digits.py
    srun --ntasks-per-node=1 ddpkit run -n 4 examples/classify_digits.py   # SLURM, or: ddpkit slurm ...

Writes OUT/predictions.csv (index, label, predicted) and prints one line:
``world_size=2 test_accuracy=0.9861 test_count=360 macro_f1=0.9850 predictions=OUT/predictions.csv``.

(*) The same arithmetic up to the order of float sums (the gradients' allreduce, SyncBN's
statistics): on one Intel Xeon 1 and 2 processes matched to 4 decimals; on an AMD EPYC two
processes scored 0.9833, one test sample of 360 flipped. The count and the order are exact.
"""

import argparse
import csv
from pathlib import Path

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.recipes.datasets import load_dataset
from ddpkit.recipes.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default="runs/classify_digits")
    args = parser.parse_args()

    rt = ddpkit.init(seed=0)
    with rt.local_main_first():                 # one download/decode per machine, if there were one
        train, test = load_dataset("digits", "train"), load_dataset("digits", "test")
    model = build_model("convnet", num_classes=10, in_channels=1, image_size=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer, sync_batchnorm=True)   # BN statistics over the world
    loader = rt.loader(train.dataset, global_batch_size=64, shuffle=True)   # not per process: per step

    for epoch in rt.epochs(args.epochs):        # sets the loader's epoch: a new shuffle each time
        for images, labels in loader:
            rt.backward(F.cross_entropy(model(images), labels))
            rt.step(optimizer)
        rt.print(f"epoch {epoch}: test_accuracy={ddpkit.evaluate(model, test.dataset, num_classes=10)['accuracy']:.4f}")

    metrics = ddpkit.evaluate(model, test.dataset, num_classes=10)        # every test sample once
    logits = ddpkit.predict(model, test.dataset)                           # rank 0: len(test) rows, in order
    if rt.is_main:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "predictions.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["index", "label", "predicted"])
            for index, row in enumerate(logits.argmax(1).tolist()):
                writer.writerow([index, int(test.dataset[index][1]), row])
        assert len(logits) == metrics["count"] == len(test.dataset)
    macro_f1 = sum(metrics["f1"]) / len(metrics["f1"])
    rt.print(f"world_size={rt.world_size} test_accuracy={metrics['accuracy']:.4f} test_count={metrics['count']} "
             f"macro_f1={macro_f1:.4f} predictions={Path(args.out) / 'predictions.csv'}")


if __name__ == "__main__":
    main()
