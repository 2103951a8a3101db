"""A small transformer language model on a synthetic token stream: gradient accumulation,
clipping, a warm-up + cosine learning-rate schedule (what most people train today).

The stream is ``ddpkit.Shards``: 16 shards of token sequences that ``read`` generates from the
shard's seed (in real use, one file or URL per shard). Every global batch holds the same samples
on any number of processes and workers, each rank reads only its own shards, and a resumed run
continues mid-epoch. The language is learnable: each sequence counts up from a random start
by a random stride, modulo the vocabulary, so the loss falls well below log(vocab).

    python examples/tiny_lm.py                           # one process
    ddpkit run -n 2 examples/tiny_lm.py                  # two: the same batches, the same loss
    torchrun --standalone --nproc_per_node 2 examples/tiny_lm.py
    srun --ntasks-per-node=1 ddpkit run -n 4 examples/tiny_lm.py   # SLURM; or: ddpkit slurm ...

Prints one final line: ``world_size=2 steps=... train_loss=... eval_loss=... eval_perplexity=...``.
"""

import argparse
import math

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.recipes.models import TinyLM      # embeddings, causal pre-norm transformer blocks, a linear head

VOCAB, LENGTH, PER_SHARD = 32, 33, 64          # 33 tokens: 32 inputs and 32 next-token targets


def read(shard: int, start: int = 0):
    """The sequences of one shard, from sample ``start`` on, the same every time."""
    for index in range(start, PER_SHARD):
        g = torch.Generator().manual_seed(shard * 100_003 + index)
        first, stride = torch.randint(VOCAB, (1,), generator=g), torch.randint(1, 5, (1,), generator=g)
        yield (first + stride * torch.arange(LENGTH)) % VOCAB


def lm_loss(model, sequences):
    logits = model(sequences[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), sequences[:, 1:].reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    rt = ddpkit.init(seed=0)
    stream = ddpkit.Shards(list(range(16)), read, lengths=[PER_SHARD] * 16)
    model = TinyLM(VOCAB, LENGTH - 1)            # 64 wide, 2 blocks; `ddpkit bench --model tiny-lm`: 256, 7
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(stream, global_batch_size=32, shuffle=True)
    total = args.epochs * math.ceil(len(loader) / args.accumulate)       # optimizer steps in the run
    warmup = max(1, total // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))

    for epoch in rt.epochs(args.epochs):
        for sequences in loader:
            with rt.accumulate(model, args.accumulate):          # all-reduce on the last micro-batch only
                loss = lm_loss(model, sequences)
                rt.backward(loss)
                rt.clip_grad_norm_(model, 1.0)                   # on the last micro-batch, the whole gradient
                if rt.step(optimizer):                           # True when the optimizer stepped
                    schedule.step()
        rt.print(f"epoch {epoch}: lr {schedule.get_last_lr()[0]:.2e}, step {rt.global_step}")

    train_loss = float(rt.all_reduce(loss.detach())) / rt.world_size     # the last batch, over all ranks
    held_out = torch.stack(list(read(shard=99)))                 # a shard no epoch read
    logits = ddpkit.predict(model, torch.utils.data.TensorDataset(held_out[:, :-1]), to="all")
    eval_loss = F.cross_entropy(logits.reshape(-1, VOCAB), held_out[:, 1:].reshape(-1)).item()
    rt.print(f"world_size={rt.world_size} steps={rt.global_step} train_loss={train_loss:.4f} "
             f"eval_loss={eval_loss:.4f} eval_perplexity={math.exp(eval_loss):.2f}")


if __name__ == "__main__":
    main()
