"""The training loop, below the runtime: where it stands, its steps, its data and its precision.

- :mod:`ddpkit.loop.state`: :class:`~ddpkit.loop.state.LoopState` (epoch, step, loader positions,
  the accumulation group) and :class:`~ddpkit.loop.state.RunState`, everything a run carries.
- :mod:`ddpkit.loop.steps`: backward, step, clip, accumulate, epochs, should_stop.
- :mod:`ddpkit.loop.build`: ``rt.loader``'s options and the loader it makes.
- :mod:`ddpkit.loop.sampler`, :mod:`ddpkit.loop.batch`, :mod:`ddpkit.loop.loader`: map-style data
  in global batches; :mod:`ddpkit.loop.streams`: iterable data and :class:`ddpkit.Shards`.
- :mod:`ddpkit.loop.precision`: autocast, the fp16 GradScaler and the optimizer step.
- :mod:`ddpkit.loop.evaluate`: exact evaluation and order-preserving prediction.

Nothing is re-exported here: import the module you need (the public names are on ``ddpkit``).
"""
