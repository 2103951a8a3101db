"""ddpkit: PyTorch data-parallel training, correct and fast by default.

The same script runs under ``python``, ``torchrun``, ``ddpkit run``, ``srun`` and
:func:`ddpkit.launch`::

    import ddpkit

    rt = ddpkit.init()
    total = rt.all_reduce(rt.rank)
    rt.print(f"world_size={rt.world_size} rank_sum={int(total)}")

Heavy optional libraries (matplotlib, tensorboard, scikit-learn) are imported only by
the features that need them.
"""

from ddpkit._version import __version__
from ddpkit.distributed.environment import Environment, detect
from ddpkit.distributed.launch import LaunchError, launch
from ddpkit.errors import DdpkitError, UsageError
from ddpkit.loop.evaluate import evaluate, predict
from ddpkit.loop.predict_file import predict_to_file
from ddpkit.loop.streams import ShardError, Shards, read_tar
from ddpkit.parallel.lazy_buffers import sync_buffers
from ddpkit.rng import sample_rng
from ddpkit.runtime import Runtime, current, init
from ddpkit.runtime.collectives import all_gather, all_gather_object, all_reduce, broadcast_object

__all__ = [
    "DdpkitError",
    "Environment",
    "LaunchError",
    "Runtime",
    "ShardError",
    "Shards",
    "UsageError",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "broadcast_object",
    "current",
    "predict_to_file",
    "detect",
    "evaluate",
    "init",
    "launch",
    "predict",
    "read_tar",
    "sample_rng",
    "sync_buffers",
    "__version__",
]
