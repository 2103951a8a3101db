"""The runtime layer: ``rt``, the facade a user script holds, and :func:`init`, which makes it.

- :mod:`ddpkit.runtime.facade`: :class:`Runtime`, composing the place in the world, one
  :class:`~ddpkit.state.run.RunState` and the observers; each method hands its work on.
- :mod:`ddpkit.runtime.start`: :func:`init` (frozen :class:`Settings`, checked, then the join) and
  :func:`current`.
- :mod:`ddpkit.runtime.collectives`: ``ddpkit.all_reduce`` and the others, refused as ``rt``'s are.
"""

from ddpkit.runtime.facade import Runtime
from ddpkit.runtime.start import DEFAULT_SAVE_TIMEOUT_S, DEFAULT_TIMEOUT_S, Settings, current, init

__all__ = ["DEFAULT_SAVE_TIMEOUT_S", "DEFAULT_TIMEOUT_S", "Runtime", "Settings", "current", "init"]
