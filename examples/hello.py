"""Hello, world of processes: every rank contributes its rank; rank 0 prints the sum.

    python examples/hello.py                      # world_size=1 rank_sum=0
    ddpkit run -n 2 examples/hello.py             # world_size=2 rank_sum=1
    torchrun --nproc_per_node 3 examples/hello.py # world_size=3 rank_sum=3
    ddpkit run --standalone --nproc_per_node 2 examples/hello.py   # torchrun's flags work too
    srun --nodes 2 --ntasks-per-node=1 ddpkit run -n 4 examples/hello.py   # SLURM: world_size=8
"""

import ddpkit


def main() -> None:
    rt = ddpkit.init()
    rank_sum = rt.all_reduce(rt.rank)
    rt.print(f"world_size={rt.world_size} rank_sum={int(rank_sum)}")


if __name__ == "__main__":
    main()
