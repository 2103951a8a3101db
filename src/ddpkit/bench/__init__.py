"""``ddpkit bench``: throughput, scaling, memory and a per-step breakdown of each mode.

Every configuration runs in fresh processes, as ``ddpkit run`` starts them; the parent only
plans, launches and reports::

    ddpkit bench --model convnet --data synthetic --modes single,ddp,ddp-amp --nproc 2 \\
        --batch 32 --steps 50 --warmup 5 --out runs/bench
    ddpkit bench --modes ddp --nproc 2 --compare-raw --repeats 5 --out runs/parity
    ddpkit bench --model resnet18 --modes ddp --hosts 1,2 --nproc 1 --link-mbit 100 \\
        --grad-compression none,powersgd --batch 16 --steps 5 --warmup 2 --out runs/link

The modules, in the order a bench runs through them:

- :mod:`~ddpkit.bench.plan`: :class:`~ddpkit.bench.plan.BenchSettings` from the command line, and
  the rows (:class:`~ddpkit.bench.plan.Configuration`) they plan.
- :mod:`~ddpkit.bench.run`: each row in fresh processes, on this machine or on simulated hosts
  (:mod:`~ddpkit.bench.netsim`, over :mod:`~ddpkit.bench.netns`); ``--compare-raw``.
- In each process: :mod:`~ddpkit.bench.worker` (ddpkit's loop) or :mod:`~ddpkit.bench.raw_ddp`
  (the hand-written one), both on :mod:`~ddpkit.bench.workload` (arguments, data, optimizer)
  and timed by :mod:`~ddpkit.bench.stopwatch`.
- :mod:`~ddpkit.bench.summary`: a row's statistics from the per-rank measurements;
  :mod:`~ddpkit.bench.diagnose`: what bounds it, in words.
- :mod:`~ddpkit.bench.table` and :mod:`~ddpkit.bench.outputs`: the markdown table,
  ``bench.json``, ``bench.md`` and ``scaling.png`` (and the demo's report files).

The package re-exports nothing, so a worker started as ``python -m ddpkit.bench.worker``
imports only what its loop needs.
"""
