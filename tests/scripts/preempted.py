"""One process that signals itself, for the preemption tests.

    python tests/scripts/preempted.py --checkpoints DIR --result w.pt [--signal-step 5]
        [--signal-before-training] [--again-in-save | --kill-in-save]

``--signal-step S``: SIGTERM to itself after step S (first run only: a resumed run does not).
``--again-in-save``: a second SIGTERM while the preempted save writes its file.
``--kill-in-save``: SIGKILL while the preempted save writes (a grace period that ran out).
"""

import argparse
import os
import signal

import torch
import torch.nn.functional as F

import ddpkit
import ddpkit._torch
import ddpkit.checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--signal-step", type=int, default=None)
    parser.add_argument("--signal-before-training", action="store_true")
    parser.add_argument("--again-in-save", action="store_true")
    parser.add_argument("--kill-in-save", action="store_true")
    args = parser.parse_args()

    rt = ddpkit.init(seed=3, checkpoint_dir=args.checkpoints, resume="auto", trackers=())
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(40, 16, generator=generator), torch.randint(0, 4, (40,), generator=generator)
    )
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(data, global_batch_size=6, shuffle=True)
    state = {"model": model, "optimizer": optimizer}
    resumed = rt.resume(state) is not None
    if args.signal_before_training:
        os.kill(os.getpid(), signal.SIGTERM)
    if args.again_in_save or args.kill_in_save:
        real_replace = os.replace

        def replace(src, dst):  # the preempted save's file is written, not yet renamed
            # (not the save before it, which may still be written in the background)
            if rt.preempted and str(dst).endswith(f"step{rt.global_step:08d}.pt"):
                os.kill(os.getpid(), signal.SIGKILL if args.kill_in_save else signal.SIGTERM)
            return real_replace(src, dst)

        ddpkit.checkpoint.pt.os.replace = replace
    while rt.global_step < args.steps:
        for _ in rt.epochs(1):  # one epoch a loop (each loop of rt.epochs runs its own n)
            for x, y in loader:
                rt.backward(F.cross_entropy(model(x), y))
                rt.step(optimizer)
                if not resumed and rt.global_step == args.signal_step:
                    os.kill(os.getpid(), signal.SIGTERM)
                if rt.preempted or rt.global_step % 4 == 0:
                    rt.checkpoint(state)  # preempted: saves, then exits 75
                if rt.global_step == args.steps:
                    break
    torch.save({k: v.clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}, args.result)
    print("done", flush=True)


if __name__ == "__main__":
    main()
