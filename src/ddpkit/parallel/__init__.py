"""How the model is replicated or sharded: DDP and its buckets, FSDP, gradient compression,
PowerSGD, lazily averaged BatchNorm statistics, SyncBatchNorm on every backend.

What ``rt.setup`` does to a model, below the checkpoints and the loop. Its modules import only
one another, :mod:`ddpkit.distributed`, the observe modules and ddpkit's base modules, never the
layers above them:

- :mod:`ddpkit.parallel.ddp`: device, SyncBatchNorm, DDP with its buckets settled at setup, compile.
- :mod:`ddpkit.parallel.fsdp`: ``strategy="fsdp"`` (FSDP2's ``fully_shard``).
- :mod:`ddpkit.parallel.compression`: ``grad_compression``, the DDP communication hooks.
- :mod:`ddpkit.parallel.powersgd`: the PowerSGD hook itself.
- :mod:`ddpkit.parallel.lazy_buffers`: BatchNorm statistics averaged lazily, not broadcast.
- :mod:`ddpkit.parallel.sync_batchnorm`: a SyncBatchNorm that runs on CPU (gloo) too.

Nothing is re-exported here (the package itself imports nothing): import the module you need.
"""
