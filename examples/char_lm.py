"""A character-level language model trained the nanoGPT way, on a text already on this machine.

nanoGPT's ``shakespeare_char`` recipe: the characters of a text become tokens, the first 90% trains
and the last 10% validates, each sample is a window of ``BLOCK`` characters whose targets are the
same window shifted by one, and a small causal transformer learns the next character with AdamW,
a warm-up and a cosine schedule, its gradients clipped; the loss is taken as nanoGPT takes it,
``F.cross_entropy(logits.view(-1, V), targets.view(-1))``. The text is the source of Python's own
``textwrap`` module (``--text PATH`` takes any other): nothing is downloaded. The validation loss
is ``ddpkit.evaluate`` over every character of the held-out part once, on any number of processes
(``class_dim=-1``: the logits are ``(B, T, V)``).

    python examples/char_lm.py                           # one process
    ddpkit run -n 2 examples/char_lm.py                  # two: the same batches, the same loss
    torchrun --standalone --nproc_per_node 2 examples/char_lm.py
    srun --ntasks-per-node=1 ddpkit run -n 4 examples/char_lm.py   # SLURM; or: ddpkit slurm ...

Prints one final line: ``world_size=2 steps=... train_loss=... val_loss=... val_tokens=...``.
"""

import argparse
import math
import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.recipes.models import TinyLM      # embeddings, causal pre-norm transformer blocks, a linear head

BLOCK = 32


class Windows(torch.utils.data.Dataset):
    """Windows of ``BLOCK`` characters every ``stride``; the targets are the next characters."""

    def __init__(self, tokens: torch.Tensor, stride: int) -> None:
        self.tokens, self.stride = tokens, stride

    def __len__(self) -> int:
        return (len(self.tokens) - BLOCK - 1) // self.stride + 1

    def __getitem__(self, index: int):
        start = index * self.stride
        return self.tokens[start:start + BLOCK], self.tokens[start + 1:start + BLOCK + 1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--text", default=textwrap.__file__, help="the text to learn (default: textwrap.py)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    text = Path(args.text).read_text(encoding="utf-8")
    chars = sorted(set(text))
    tokens = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(0.9 * len(tokens))
    train, val = Windows(tokens[:split], BLOCK // 2), Windows(tokens[split:], BLOCK)   # val: each character once

    rt = ddpkit.init(seed=0)
    model = TinyLM(len(chars), BLOCK)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.99))
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(train, global_batch_size=32, shuffle=True)
    total = args.epochs * len(loader)
    warmup = max(1, total // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))

    for epoch in rt.epochs(args.epochs, start=1):
        for x, y in loader:
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            rt.backward(loss)
            rt.clip_grad_norm_(model, 1.0)
            rt.step(optimizer)
            schedule.step()
        metrics = ddpkit.evaluate(model, val, num_classes=len(chars), class_dim=-1, batch_size=64)
        rt.print(f"epoch {epoch}: val loss {metrics['loss']:.4f} over {metrics['count']} characters")

    train_loss = float(rt.all_reduce(loss.detach())) / rt.world_size     # the last batch, over all ranks
    rt.print(f"world_size={rt.world_size} steps={rt.global_step} train_loss={train_loss:.4f} "
             f"val_loss={metrics['loss']:.4f} val_tokens={metrics['count']}")


if __name__ == "__main__":
    main()
