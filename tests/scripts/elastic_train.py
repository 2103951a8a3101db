"""Training that kills itself with SIGKILL once (first attempt), or twice, for fault-tolerance tests.

    ddpkit run -n 2 --max-restarts 2 tests/scripts/elastic_train.py --checkpoints DIR \
        --result weights.pt --kill-step 7 --kill-rank 1 [--kill-in-save] [--precision fp16]

Every rank prints ``rank R started at step S`` when it finishes: S > 0 proves that this process
was started by a restart and resumed, not merely that some process did.
"""

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from toy_data import NoisyToy

import ddpkit
import ddpkit._torch
import ddpkit.checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--kill-step", type=int, default=None)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--kill-in-save", action="store_true")
    parser.add_argument("--kill-again-step", type=int, default=None, help="and once more in the second attempt")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    args = parser.parse_args()

    rt = ddpkit.init(
        seed=4, checkpoint_dir=args.checkpoints, resume="auto", keep_checkpoints=2, precision=args.precision
    )
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if args.kill_in_save and first_attempt and rt.rank == 0:
        real_replace = os.replace

        def replace(src, dst):  # die after the temp file is written, before it is renamed
            if str(dst).endswith(f"ckpt-step{args.kill_step:08d}.pt"):
                os.kill(os.getpid(), signal.SIGKILL)
            return real_replace(src, dst)

        ddpkit.checkpoint.pt.os.replace = replace

    model = torch.nn.Sequential(
        torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(NoisyToy(), global_batch_size=8, shuffle=True)
    state = {"model": model, "optimizer": optimizer}
    if rt.resume(state):
        rt.print(f"resumed at step {rt.global_step}")
    started_at = rt.global_step
    while rt.global_step < args.steps:
        for _epoch in rt.epochs(1):  # one epoch a loop (each loop of rt.epochs runs its own n)
            for images, labels in loader:
                with rt.autocast():
                    loss = F.cross_entropy(model(images), labels)
                rt.backward(loss)
                rt.step(optimizer)
                kill_here = args.kill_step == rt.global_step and rt.rank == args.kill_rank
                if first_attempt and kill_here and not args.kill_in_save:
                    os.kill(os.getpid(), signal.SIGKILL)
                second_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "1"
                if second_attempt and args.kill_again_step == rt.global_step and rt.rank == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
                rt.checkpoint(state)
                if rt.global_step == args.steps:
                    break
    print(f"rank {rt.rank} started at step {started_at}", flush=True)
    if rt.is_main:
        weights = {k: v.clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
        torch.save(weights, args.result)
        print(f"done after {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} restart(s)")


if __name__ == "__main__":
    main()
