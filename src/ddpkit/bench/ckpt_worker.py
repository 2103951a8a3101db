"""The loop ``ddpkit bench --checkpoints`` times: what a save costs the training loop.

    python -m ddpkit.bench.ckpt_worker --out DIR --model mlp-large --batch 64 --steps 24 \
        --checkpoint-every 4

One job trains three stretches of ``--steps`` steps, saving every ``--checkpoint-every``:
``background`` (``rt.checkpoint(state)``, the default), ``blocking`` (``blocking=True``) and
``plain`` (rank 0's ``torch.save`` of the same state dicts, the others waiting at a barrier, as a
hand-written loop saves). Rank 0 writes ``DIR/checkpoints.json``: per stretch the seconds the loop
waited in each save, and for the background one the seconds each write took behind the loop and
the host memory its copy held.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.bench.workload import bench_dataset
from ddpkit.checkpoint import background
from ddpkit.recipes.models import build_model


def main(argv: list[str] | None = None) -> None:
    """Time the three stretches and write ``checkpoints.json`` (rank 0)."""
    parser = argparse.ArgumentParser(prog="python -m ddpkit.bench.ckpt_worker")
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="mlp-large")
    parser.add_argument("--data", default="synthetic")
    parser.add_argument("--batch", type=int, required=True, help="the global batch")
    parser.add_argument("--steps", type=int, required=True, help="steps of each stretch")
    parser.add_argument("--checkpoint-every", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)

    rt = ddpkit.init(seed=opts.seed, out_dir=opts.out, trackers=(), keep_checkpoints=2)
    info = bench_dataset(opts.data, opts.batch, opts.model)
    torch.manual_seed(opts.seed)
    model = build_model(
        opts.model, num_classes=info.num_classes, in_channels=info.in_channels, image_size=info.image_size
    )
    model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    loader = rt.loader(info.dataset, global_batch_size=opts.batch, shuffle=True)
    state = {"model": model, "optimizer": optimizer}
    found: dict[str, dict[str, object]] = {}
    for kind in ("plain", "blocking", "background"):
        waits, step_s, done = [], [], len(background.WRITER.finished)
        steps = 0
        began = time.perf_counter()
        while steps < opts.steps:
            for inputs, targets in loader:
                start = time.perf_counter()
                rt.backward(F.cross_entropy(model(inputs), targets))
                rt.step(optimizer)
                step_s.append(time.perf_counter() - start)
                steps += 1
                if steps % opts.checkpoint_every == 0:
                    start = time.perf_counter()
                    if kind == "plain":
                        if rt.is_main:  # what a hand-written loop does: rank 0 saves, the others wait
                            torch.save(
                                {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                                os.path.join(opts.out, "plain.pt"),
                            )
                        rt.barrier()
                    else:
                        rt.save(os.path.join(opts.out, kind), state, blocking=kind == "blocking")
                    waits.append(time.perf_counter() - start)
                if steps >= opts.steps:
                    break
        if kind == "background":
            rt.barrier()
            background.WRITER.wait()  # the last write, so its time is counted
        wall = time.perf_counter() - began
        written = background.WRITER.finished[done:] if kind == "background" else []
        if len(written) == len(waits):  # and what the next steps waited for each copy behind the loop
            waits = [wait + d.step_wait_s for wait, d in zip(waits, written)]
        found[kind] = {
            "saves": len(waits),
            "loop_wait_s": statistics.median(waits),
            "loop_wait_max_s": max(waits),
            "step_s": statistics.median(step_s),
            "wall_s": wall,
            "background_write_s": statistics.median(d.write_s for d in written) if written else None,
            "held_mb": max(d.held_bytes for d in written) / 2**20 if written else 0.0,
            "failed": [d.error for d in written if d.error],
        }
    if rt.is_main:
        state_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
        with open(os.path.join(opts.out, "checkpoints.json"), "w", encoding="utf-8") as handle:
            json.dump({"world_size": rt.world_size, "model_mb": state_mb, "stretches": found}, handle, indent=2)
    rt.close()


if __name__ == "__main__":
    main()
