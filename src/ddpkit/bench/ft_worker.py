"""The loop ``ddpkit bench --fault-tolerant`` times: one process of a replica or of a torchrun group.

    python -m ddpkit.bench.ft_worker --out DIR --model convnet --data digits --batch 60 --steps 48 \
        [--kill-at 10 --kill-who 1] [--checkpoint-every 8] [--min-step-s 0.3] \
        [--sync diloco --sync-every 3 --sync-dtype sparse]

Every process appends to ``DIR/events-<replica or rank>.jsonl`` a line per committed step (the
time, the attempt, the samples it trained on) and a ``start`` line; the one that is ``rt.is_main``
at the end saves ``DIR/weights.pt``. ``--kill-who`` (a replica under ``--fault-tolerant``, a rank
otherwise) SIGKILLs itself after committing step ``--kill-at`` in its first attempt.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit._torch import unwrap
from ddpkit.bench.workload import bench_dataset
from ddpkit.recipes.models import build_model


def main(argv: list[str] | None = None) -> None:
    """Train ``--steps`` steps of the global batch ``--batch`` and record each commit."""
    parser = argparse.ArgumentParser(prog="python -m ddpkit.bench.ft_worker")
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="convnet")
    parser.add_argument("--data", default="digits")
    parser.add_argument("--batch", type=int, required=True, help="the global batch")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-who", type=int, default=1)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument(
        "--min-step-s",
        type=float,
        default=0.0,
        help="sleep out each step to at least this long (a larger model's step)",
    )
    parser.add_argument("--sync", default="every-step", help="rt.setup(sync=...): local-sgd or diloco")
    parser.add_argument("--sync-every", type=int, default=None)
    parser.add_argument("--sync-dtype", default=None)
    parser.add_argument("--sync-fragments", type=int, default=1)
    parser.add_argument("--sync-delay", type=int, default=0)
    opts = parser.parse_args(argv)

    rt = ddpkit.init(
        seed=opts.seed,
        out_dir=opts.out,
        checkpoint_dir=os.path.join(opts.out, "checkpoints"),
        resume="auto",
        trackers=(),
    )
    me = int(os.environ.get("DDPKIT_FT_REPLICA", rt.rank))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    info = bench_dataset(opts.data, opts.batch, opts.model)
    torch.manual_seed(opts.seed)
    model = build_model(
        opts.model, num_classes=info.num_classes, in_channels=info.in_channels, image_size=info.image_size
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=opts.momentum)
    if opts.sync == "every-step":
        model, optimizer = rt.setup(model, optimizer, sync_batchnorm=rt.replica is None and rt.world_size > 1)
    else:  # the replicas (or ranks) train apart, and meet every --sync-every steps
        model, optimizer = rt.setup(
            model,
            optimizer,
            sync=opts.sync,
            sync_every=opts.sync_every,
            sync_dtype=opts.sync_dtype,
            sync_fragments=opts.sync_fragments,
            sync_delay=opts.sync_delay,
        )
    loader = rt.loader(info.dataset, global_batch_size=opts.batch, shuffle=True)
    state = {"model": model, "optimizer": optimizer}
    rt.resume(state)
    events = open(os.path.join(opts.out, f"events-{me}.jsonl"), "a", encoding="utf-8")

    def event(**row: object) -> None:
        events.write(json.dumps({"who": me, "attempt": attempt, "t": time.time(), **row}) + "\n")
        events.flush()

    event(kind="process", step=rt.global_step)
    started = False
    began = time.perf_counter()
    while rt.global_step < opts.steps:
        for _ in rt.epochs(1):  # one epoch a loop (each loop of rt.epochs runs its own n)
            for inputs, targets in loader:
                if not started:
                    started = True
                    event(
                        kind="start",
                        step=rt.global_step,
                        healed=bool(rt._run.world.quorum is not None and rt._run.world.quorum.healed),
                    )
                if opts.min_step_s > 0:
                    time.sleep(max(0.0, opts.min_step_s - (time.perf_counter() - began)))
                    began = time.perf_counter()
                loss = F.cross_entropy(model(inputs), targets)
                rt.backward(loss)
                if not rt.step(optimizer):
                    event(kind="redo", step=rt.global_step)
                    continue
                event(kind="step", step=rt.global_step, local=loader.local_count, loss=float(loss.detach()))
                if attempt == 0 and me == opts.kill_who and opts.kill_at is not None and rt.global_step >= opts.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                if opts.checkpoint_every and rt.global_step % opts.checkpoint_every == 0:
                    # on disk before the next step: restart-all's steps trained twice count from it
                    rt.checkpoint(state, blocking=True)
                if rt.global_step >= opts.steps:
                    break
    event(kind="end", step=rt.global_step)
    if rt.is_main:
        torch.save(
            {k: v.detach().cpu().clone() for k, v in unwrap(model).state_dict().items()},
            os.path.join(opts.out, "weights.pt"),
        )


if __name__ == "__main__":
    main()
