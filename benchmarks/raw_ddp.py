"""Plain PyTorch DDP training loop that ``ddpkit bench --compare-raw`` measures ddpkit against.

The loop itself is :mod:`ddpkit.bench.raw_ddp` (``src/ddpkit/bench/raw_ddp.py``): it ships inside the
package so that an installed ddpkit, without this checkout, can run the comparison, and so
that ``ddpkit bench`` starts it exactly as it starts its own worker (``-m`` under the same
launcher). This file runs it from a checkout, for reading it side by side with the seeds::

    torchrun --nproc-per-node 2 benchmarks/raw_ddp.py --model convnet --data synthetic \\
        --precision fp32 --batch 32 --steps 50 --warmup 5 --result raw.json

With ``--epochs N`` it trains whole epochs the way the seeds' blog posts do instead
(:mod:`ddpkit.bench.raw_train`: DistributedSampler, the per-process batch, rank 0 evaluating),
which ``ddpkit demo`` runs to say how far from one process's weights that loop ends::

    torchrun --nproc-per-node 2 benchmarks/raw_ddp.py --epochs 5 --model convnet --data digits \\
        --batch 64 --out runs/hand-written
"""

import sys

if __name__ == "__main__":
    if "--epochs" in sys.argv[1:]:
        from ddpkit.bench.raw_train import main
    else:
        from ddpkit.bench.raw_ddp import main
    sys.exit(main())
