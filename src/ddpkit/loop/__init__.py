"""The training loop, below the runtime: its steps and its data, on the run's state (:mod:`ddpkit.state`).

- :mod:`ddpkit.loop.steps`: backward, step, clip, accumulate, epochs, should_stop.
- :mod:`ddpkit.loop.build`: ``rt.loader``'s options and the loader it makes.
- :mod:`ddpkit.loop.sampler`, :mod:`ddpkit.loop.batch`, :mod:`ddpkit.loop.loader`: map-style data
  in global batches; :mod:`ddpkit.loop.streams`: iterable data and :class:`ddpkit.Shards`.
- :mod:`ddpkit.loop.evaluate`: exact evaluation and order-preserving prediction.

Nothing is re-exported here: import the module you need (the public names are on ``ddpkit``).
"""
