"""Plain PyTorch DDP training loop that ``ddpkit bench --compare-raw`` measures ddpkit against.

The loop itself is :mod:`ddpkit.bench.raw_ddp` (``src/ddpkit/bench/raw_ddp.py``): it ships inside the
package so that an installed ddpkit, without this checkout, can run the comparison, and so
that ``ddpkit bench`` starts it exactly as it starts its own worker (``-m`` under the same
launcher). This file runs it from a checkout, for reading it side by side with the seeds::

    torchrun --nproc-per-node 2 benchmarks/raw_ddp.py --model convnet --data synthetic \\
        --precision fp32 --batch 32 --steps 50 --warmup 5 --result raw.json
"""

import sys

from ddpkit.bench.raw_ddp import main

if __name__ == "__main__":
    sys.exit(main())
