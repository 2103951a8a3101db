"""The digits ConvNet trained by fault-tolerant replicas, some of which SIGKILL themselves once.

    ddpkit run --fault-tolerant -n 3 --max-restarts 1 tests/scripts/ft_train.py --out DIR \
        [--kill 2:17] [--kill 0:30]

``--micro-shards M``: the run of ``rt.setup(micro_shards=M)``, which ends at one process's bits.
``--sync diloco --sync-every H [--sync-dtype D]``: the replicas train apart and meet every H steps; each
replica saves the model it holds after the loop to ``DIR/final-R-A.pt`` (replica R, attempt A).
``--kill-in-exchange R:N``: replica R SIGKILLs itself as its N-th exchange starts (first attempt).
``--kill R:S``: replica R SIGKILLs itself right after committing step S (or the first it commits
after S, when it joined later), in its first attempt.
Every replica appends to ``DIR/events-R.jsonl`` one line per committed step (its attempt, the
step, the epoch, the samples it trained on in that step, their sum over the step's quorum through
``rt.all_reduce``, the time), a ``start`` line with whether
it healed from a peer and what it resumed from, and an ``eval`` line after each epoch (the test
samples counted, the accuracy); the replica that ends first in the last quorum saves
``DIR/weights.pt``. Without ``--fault-tolerant`` (``python``, ``ddpkit run -n W``) it trains the
same run uninterrupted.
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.nn.functional as F

import ddpkit
import ddpkit._torch
from ddpkit.recipes.datasets import load_dataset
from ddpkit.recipes.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=60)
    parser.add_argument("--kill", action="append", default=[], help="R:S, replica R dies after step S")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument(
        "--fail-once",
        type=int,
        default=None,
        help="every replica reports an error to torchft in step S, once: the step is redone",
    )
    parser.add_argument("--micro-shards", type=int, default=None, help="rt.setup(micro_shards=M): the same bits")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step waits (a longer run)")
    parser.add_argument("--grad-compression", default=None, help="rt.setup(grad_compression=...)")
    parser.add_argument("--sync", default="every-step", help="rt.setup(sync=...): diloco, local-sgd")
    parser.add_argument("--sync-every", type=int, default=None, help="rt.setup(sync_every=H)")
    parser.add_argument("--sync-dtype", default=None, help="rt.setup(sync_dtype=...)")
    parser.add_argument("--sync-fragments", type=int, default=1, help="rt.setup(sync_fragments=F)")
    parser.add_argument("--sync-delay", type=int, default=0, help="rt.setup(sync_delay=T)")
    parser.add_argument("--clip", type=float, default=None, help="rt.clip_grad_norm_(model, C) before each step")
    parser.add_argument(
        "--kill-in-exchange", default=None, help="R:N, replica R dies inside its N-th exchange (first attempt)"
    )
    args = parser.parse_args()
    kills = {int(r): int(s) for r, s in (item.split(":") for item in args.kill)}

    if args.kill_in_exchange and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        _die_in_exchange(*(int(v) for v in args.kill_in_exchange.split(":")))
    rt = ddpkit.init(
        seed=0, out_dir=args.out, checkpoint_dir=os.path.join(args.out, "checkpoints"), resume="auto", trackers=()
    )
    replica = rt.replica or 0  # which replica this is (None without --fault-tolerant)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    info = load_dataset("digits", "train")
    test = load_dataset("digits", "test")
    torch.manual_seed(0)
    model = build_model(
        "convnet", num_classes=info.num_classes, in_channels=info.in_channels, image_size=info.image_size
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    apart = {}
    if args.sync != "every-step":  # DiLoCo or local SGD (the replicas train apart, meeting every H steps)
        apart = dict(
            sync=args.sync,
            sync_every=args.sync_every,
            sync_dtype=args.sync_dtype,
            sync_fragments=args.sync_fragments,
            sync_delay=args.sync_delay,
        )
    model, optimizer = rt.setup(
        model, optimizer, micro_shards=args.micro_shards, grad_compression=args.grad_compression, **apart
    )
    loader = rt.loader(info.dataset, global_batch_size=args.batch, shuffle=True)
    state = {"model": model, "optimizer": optimizer}
    rt.resume(state)
    events = open(os.path.join(args.out, f"events-{replica}.jsonl"), "a", encoding="utf-8")

    def event(**row):
        events.write(json.dumps({"replica": replica, "attempt": attempt, "t": time.time(), **row}) + "\n")
        events.flush()

    started = failed = False
    for epoch in rt.epochs(args.epochs):
        for images, labels in loader:
            if not started:
                started = True
                healed = rt._run.world.quorum is not None and rt._run.world.quorum.healed
                event(kind="start", step=rt.global_step, healed=healed, source=rt._run.loop.resumed_from)
            time.sleep(args.step_sleep)
            shards = counted = 0
            if args.micro_shards:  # the shards this replica computes in this step's quorum
                for shard_images, shard_labels in rt.shards(images, labels):
                    rt.backward(F.cross_entropy(model(shard_images), shard_labels))
                    shards += 1
                    counted += len(shard_labels)
            else:
                rt.backward(F.cross_entropy(model(images), labels))
                counted = loader.local_count
            norm = None if args.clip is None else float(rt.clip_grad_norm_(model, args.clip))
            summed = rt.all_reduce(float(counted))  # inside the step: over its quorum, the global batch
            if args.fail_once is not None and rt.global_step + 1 == args.fail_once and not failed:
                failed = True  # as if a collective of this step had failed
                rt._run.world.quorum.manager.report_error(RuntimeError("injected by ft_train.py"))
            if not rt.step(optimizer):
                event(kind="redo", step=rt.global_step)
                continue
            event(
                kind="step",
                step=rt.global_step,
                epoch=rt.epoch,
                loop_epoch=epoch,  # what rt.epochs yielded: a replica that healed into a later epoch names it too
                local=loader.local_count,
                total=loader.global_count,
                summed=summed,
                shards=shards,
                norm=norm,
            )
            if attempt == 0 and replica in kills and rt.global_step >= kills[replica]:
                os.kill(os.getpid(), signal.SIGKILL)
            if args.checkpoint_every and rt.global_step % args.checkpoint_every == 0:
                rt.checkpoint(state)
        metrics = ddpkit.evaluate(model, test.dataset, num_classes=test.num_classes)
        event(
            kind="eval",
            step=rt.global_step,
            epoch=epoch,
            count=metrics["count"],
            correct=metrics["correct"],
            accuracy=metrics["accuracy"],
        )
    from ddpkit.parallel import periodic

    syncer = periodic.of(model)  # an infrequent sync: how its period came to be (chosen from the link, or given)
    event(kind="end", step=rt.global_step, decision=None if syncer is None else syncer.decision)
    if args.sync != "every-step":  # every replica's model after the loop: the replicas' common one
        mine = {k: v.detach().clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
        torch.save(
            mine, os.path.join(args.out, f"final-{rt.replica if rt.replica is not None else rt.rank}-{attempt}.pt")
        )
    if rt.is_main:
        weights = {k: v.detach().clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
        torch.save(weights, os.path.join(args.out, "weights.pt"))


def _die_in_exchange(replica: int, nth: int) -> None:
    """Replica ``replica`` SIGKILLs itself as its ``nth`` exchange over the quorum starts: the others are
    in that collective (or about to be) when it dies."""
    if int(os.environ.get("DDPKIT_FT_REPLICA", "-1")) != replica:
        return
    from ddpkit.parallel import periodic

    calls = {"n": 0}

    def dying(method):
        def call(self, tensor):
            calls["n"] += 1
            if calls["n"] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
            return method(self, tensor)

        return call

    periodic.QuorumMeet.sum_ = dying(periodic.QuorumMeet.sum_)
    periodic.QuorumMeet.gather = dying(periodic.QuorumMeet.gather)


if __name__ == "__main__":
    main()
