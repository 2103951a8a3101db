"""Streaming data: iterable datasets and :class:`Shards`, sharded without duplicates or hangs.

* :mod:`ddpkit.streams.order`: where each sample goes (pure functions).
* :mod:`ddpkit.streams.shards`: :class:`Shards`, its lengths cache.
* :mod:`ddpkit.streams.reading`: reading shards in order, from a start; learning their lengths.
* :mod:`ddpkit.streams.tar`: :func:`read_tar` for WebDataset-format ``.tar`` shards.
* :mod:`ddpkit.streams.pieces`: what each DataLoader worker reads.
* :mod:`ddpkit.streams.loader`: :class:`StreamLoader`, what ``rt.loader`` returns for a stream.
"""

from ddpkit.streams.shards import ShardError, Shards
from ddpkit.streams.tar import read_tar

__all__ = ["ShardError", "Shards", "read_tar"]
