"""Training that logs every step to the trackers, checkpoints every few steps, and can be stopped.

    ddpkit run -n 2 --max-restarts 1 tests/scripts/tracked_train.py --out DIR --result weights.pt \
        --trackers tensorboard,wandb,mlflow [--kill-step 8] [--step-sleep 0.2]

``--kill-step S``: rank 1 SIGKILLs itself right after step S in the first attempt (a crash after
the checkpoint of an earlier step), ``--kill-delay`` seconds later (rank 0 waits in step S+1). ``--step-sleep``: seconds each step waits, so a test can send
a signal mid-epoch. A preemption (SIGTERM, SLURM's SIGUSR1) saves at the next step and exits 75.
"""

import argparse
import os
import signal
import time

import torch
import torch.nn.functional as F
from toy_data import NoisyToy

import ddpkit
import ddpkit._torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--trackers", default="tensorboard")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=3, help="checkpoint every this many steps")
    parser.add_argument("--kill-step", type=int, default=None)
    parser.add_argument("--kill-delay", type=float, default=0.0)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()

    rt = ddpkit.init(
        seed=4,
        out_dir=args.out,
        checkpoint_dir=os.path.join(args.out, "checkpoints"),
        resume="auto",
        trackers=args.trackers,
        run_name="tracked",
        config={"lr": 0.1},
    )
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(NoisyToy(), global_batch_size=8, shuffle=True)
    state = {"model": model, "optimizer": optimizer}
    resumed = rt.resume(state)
    print(
        f"rank {rt.rank} attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} starts at step "
        f"{rt.global_step} (resumed: {resumed is not None})",
        flush=True,
    )
    while rt.global_step < args.steps:
        for _ in rt.epochs(1):  # one epoch a loop (each loop of rt.epochs runs its own n)
            for images, labels in loader:
                loss = F.cross_entropy(model(images), labels)
                rt.backward(loss)
                rt.step(optimizer)
                rt.log({"loss": loss.detach(), "epoch": rt.epoch})
                time.sleep(args.step_sleep)
                if first_attempt and args.kill_step == rt.global_step and rt.rank == 1:
                    time.sleep(args.kill_delay)
                    os.kill(os.getpid(), signal.SIGKILL)
                if rt.preempted or rt.global_step % args.every == 0:
                    rt.checkpoint(state)  # preempted: saves, then exits 75
                if rt.global_step == args.steps:
                    break
    if rt.is_main:
        weights = {k: v.clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
        torch.save(weights, args.result)
        print("done", flush=True)


if __name__ == "__main__":
    main()
