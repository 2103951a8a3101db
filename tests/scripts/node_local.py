"""Each node's local rank 0 prepares a node-local file first; its peers must find it ready.

ddpkit run --nnodes 2 --node-rank R --master HOST:PORT -n 2 tests/scripts/node_local.py DIR
"""

import os
import sys
import time

import ddpkit


def main() -> None:
    root = sys.argv[1]
    rt = ddpkit.init()
    env = ddpkit.detect()  # where this process stands: node and local rank
    marker = os.path.join(root, f"node{env.node_rank}.ready")
    with rt.local_main_first():
        if env.local_rank == 0:
            time.sleep(1.0)  # a slow preparation: peers must not run ahead
            with open(marker, "w") as handle:
                handle.write(str(os.getpid()))
            prepared_by = "self"
        else:
            if not os.path.exists(marker):
                raise RuntimeError(f"rank {rt.rank} ran before node {env.node_rank} was prepared")
            prepared_by = "peer"
    total = rt.all_reduce(1)
    rt.print(
        f"rank={rt.rank} node={env.node_rank} local_rank={env.local_rank} prepared_by={prepared_by} "
        f"world_size={rt.world_size} seen={int(total)}",
        all_ranks=True,
    )


if __name__ == "__main__":
    main()
