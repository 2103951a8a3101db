"""Streaming data: iterable datasets and :class:`Shards`, sharded without duplicates or hangs.

* :mod:`ddpkit.loop.streams.order`: where each sample goes (pure functions).
* :mod:`ddpkit.loop.streams.shards`: :class:`Shards`, its lengths cache, and reading it in order, from a start.
* :mod:`ddpkit.loop.streams.evaluation`: a stream split for evaluation and prediction.
* :mod:`ddpkit.loop.streams.lengths`: learning the shards' lengths across ranks and workers.
* :mod:`ddpkit.loop.streams.tar`: :func:`read_tar` for WebDataset-format ``.tar`` shards.
* :mod:`ddpkit.loop.streams.pieces`: what each DataLoader worker reads.
* :mod:`ddpkit.loop.streams.loader`: :class:`StreamLoader`, what ``rt.loader`` returns for a stream.
"""

from ddpkit.loop.streams.shards import ShardError, Shards
from ddpkit.loop.streams.tar import read_tar

__all__ = ["ShardError", "Shards", "read_tar"]
