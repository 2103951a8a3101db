"""``python -m ddpkit.entry SCRIPT [ARGS...]`` (or ``-m MODULE``): run a worker's script as ``python``
would, then end the process without interpreter teardown (:mod:`ddpkit.distributed.entry`)::

    torchrun --nproc-per-node 4 -m ddpkit.entry train.py --lr 0.1
    srun python -m ddpkit.entry train.py --lr 0.1
"""

from ddpkit.distributed.entry import main

if __name__ == "__main__":
    main()
