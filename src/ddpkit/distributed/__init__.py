"""Our place in the world: environment detection, process groups, stores, collectives,
``ddpkit run`` and :func:`ddpkit.launch`.

The distributed plumbing, below everything that trains, evaluates or checkpoints. Its modules
import only one another and ddpkit's base modules (:mod:`ddpkit.errors`, :mod:`ddpkit._torch`,
:mod:`ddpkit.entry`), never the layers above them:

- :mod:`ddpkit.distributed.environment`: which launcher started us (:class:`~ddpkit.distributed.environment.Environment`,
  :func:`~ddpkit.distributed.environment.detect`); SLURM's variables in :mod:`ddpkit.distributed.slurm_env`.
- :mod:`ddpkit.distributed.host`: this machine's cores, addresses, interfaces and free ports.
- :mod:`ddpkit.distributed.process_group`: device, backend, init and destroy of the default group.
- :mod:`ddpkit.distributed.stores`: where a job's stores live and which interface its sockets bind.
- :mod:`ddpkit.distributed.store_sync`: meeting points through the store (who arrived, rank 0's outcome).
- :mod:`ddpkit.distributed.collectives`: reductions, gathers and the barrier, identity in a world of one.
- :mod:`ddpkit.distributed.torchrun`: ``ddpkit run`` on top of ``torch.distributed.run``.
- :mod:`ddpkit.distributed.launch`: :func:`ddpkit.launch`, a function in N processes.

Nothing is re-exported here (the package itself imports nothing): import the module you need.
"""
