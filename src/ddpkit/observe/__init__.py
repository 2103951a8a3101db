"""What a running job shows and watches: heartbeats and the hang watchdog, metrics, progress.

Beside :mod:`ddpkit.distributed` on the layer above the base modules; it imports only the base modules,
so every layer above (parallel, checkpoint, loop, runtime) may send it heartbeats and lines:

- :mod:`ddpkit.observe.heartbeats`: what a hang looks like (pure functions of each rank's
  heartbeat and a clock), and :func:`~ddpkit.observe.heartbeats.beat`, the module-level heartbeat
  that loop and checkpoint code send without knowing the runtime.
- :mod:`ddpkit.observe.watchdog`: the thread that publishes heartbeats, names the stuck rank and
  ends the job (``ddpkit.init(hang_timeout=...)``).
- :mod:`ddpkit.observe.metrics`: ``rt.log``'s files (JSON lines, CSV, TensorBoard) and loss.png.
- :mod:`ddpkit.observe.progress`: tqdm bars on rank 0, and whole printed lines (``rt.print``).

Nothing is re-exported here: import the module you need.
"""
