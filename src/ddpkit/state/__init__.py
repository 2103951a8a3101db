"""What a run holds from step to step, as types the layers above share.

- :mod:`ddpkit.state.run`: :class:`~ddpkit.state.run.RunState`, everything one run carries (what
  ``rt`` composes), one :class:`~ddpkit.state.run.Entry` a set-up model;
- :mod:`ddpkit.state.loop`: :class:`~ddpkit.state.loop.LoopState`, where the loop stands (epoch,
  step, loader positions): what a restart needs to continue exactly;
- :mod:`ddpkit.state.precision`: :class:`~ddpkit.state.precision.Precision`, autocast, the fp16
  scaler and the optimizer step.

It sits below :mod:`ddpkit.checkpoint` and :mod:`ddpkit.loop`, which read and change it, and above
:mod:`ddpkit.parallel`, whose modes it holds.
"""
