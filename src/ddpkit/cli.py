"""The ``ddpkit`` command line. Usage errors are one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

from ddpkit._argparse import Parser
from ddpkit.errors import DdpkitError, UsageError


def cmd_run(argv: Sequence[str]) -> int:
    from ddpkit.dist.torchrun import run
    from ddpkit.runargs import spec_of

    return run(spec_of(argv))


def cmd_doctor(argv: Sequence[str]) -> int:
    from ddpkit.doctor import examine

    parser = Parser(prog="ddpkit doctor", description="Check torch, devices, backends, launcher and network.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    opts = parser.parse_args(argv)
    report = examine()
    print(json.dumps(report.as_dict(), default=str, indent=2) if opts.json else report.render())
    return 0 if not report.problems else 1


def cmd_demo(argv: Sequence[str]) -> int:
    from ddpkit.demo import main as demo_main

    parser = Parser(prog="ddpkit demo", description="Run the built-in end-to-end demonstration.")
    parser.add_argument("--nproc", type=int, default=2, help="processes for the distributed runs (default 2)")
    parser.add_argument("--epochs", type=int, default=5, help="epochs of every run (default 5)")
    parser.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    opts = parser.parse_args(argv)
    if opts.nproc < 1 or opts.epochs < 1:
        raise UsageError("--nproc and --epochs must be at least 1")
    return demo_main(nproc=opts.nproc, out=opts.out, epochs=opts.epochs)


def _train_parser() -> argparse.ArgumentParser:
    from ddpkit.recipes.config import TrainConfig

    defaults = TrainConfig()
    parser = Parser(prog="ddpkit train", argument_default=argparse.SUPPRESS,
                     description="Train a built-in recipe in N processes; writes metrics, plots, "
                                 "checkpoints and summary.json into --out.")
    add = parser.add_argument
    add("--model", help=f"convnet, mlp, resnet18 or resnet50 (default {defaults.model})")
    add("--data", help=f"digits, mnist, cifar10 or synthetic (default {defaults.data})")
    add("--data-dir", dest="data_dir", help="directory with torchvision's files for mnist/cifar10")
    add("--nproc", type=int, help="processes per node (default 1)")
    add("--nnodes", type=int, help="nodes (default 1); each runs ddpkit train with its --node-rank")
    add("--node-rank", dest="node_rank", type=int, help="this node's index when --nnodes > 1")
    add("--master", help="HOST:PORT of node 0 when --nnodes > 1")
    add("--precision", help="fp32, bf16 or fp16 (default fp32)")
    add("--epochs", type=int, help=f"epochs (default {defaults.epochs})")
    add("--global-batch", dest="global_batch", type=int, help="samples per step across all processes (default 64)")
    add("--batch", type=int, help="samples per step per process (instead of --global-batch)")
    add("--lr", type=float, help=f"learning rate (default {defaults.lr})")
    add("--momentum", type=float, help=f"SGD momentum (default {defaults.momentum})")
    add("--scale-lr", dest="scale_lr", action="store_true", help="linear scaling rule with --batch")
    add("--sync-bn", dest="sync_bn", action="store_true", help="synchronise BatchNorm across processes")
    add("--grad-compression", dest="grad_compression", help="gradients on the wire: none, fp16, bf16 or "
        "powersgd (default none; see README 'Slow links')")
    add("--powersgd-rank", dest="powersgd_rank", type=int, help="rank of PowerSGD's factors (default 2)")
    add("--strategy", help="ddp (replicated, default) or fsdp (sharded parameters, gradients and optimizer "
        "state; checkpoints are directories of shards that resume on any world size)")
    add("--cpu-offload", dest="cpu_offload", action="store_true",
        help="with --strategy fsdp: keep shards and optimizer state in CPU memory")
    add("--workers", type=int, help="DataLoader workers per process (default 0)")
    add("--seed", type=int, help="seed (default 0)")
    add("--out", help=f"output directory (default {defaults.out})")
    add("--resume", help="checkpoint file or directory, or 'auto' (newest in OUT/checkpoints)")
    add("--checkpoint-every", dest="checkpoint_every", type=int, help="also save every N steps")
    add("--keep-checkpoints", dest="keep_checkpoints", type=int, help="newest checkpoints kept (default 3)")
    add("--max-restarts", dest="max_restarts", type=int, help="restarts of the group after a failure")
    add("--hang-timeout", dest="hang_timeout", type=float,
        help="seconds without progress before the job counts as hung and exits (default: no watchdog)")
    add("--eval-batch", dest="eval_batch", type=int, help="evaluation batch size (default 256)")
    add("--synthetic-size", dest="synthetic_size", type=int, help="samples of --data synthetic")
    add("--overwrite", action="store_true", help="replace the run in --out (its checkpoints, metrics, summary)")
    add("--config", help="YAML or TOML file of these settings; flags override it")
    return parser


def train_config(argv: Sequence[str]):
    """The validated TrainConfig of ``ddpkit train`` arguments (file settings, then flags)."""
    from ddpkit.recipes.config import TrainConfig, read_config_file, validate

    given = vars(_train_parser().parse_args(argv))
    settings = read_config_file(given.pop("config")) if "config" in given else {}
    settings.update(given)
    config = TrainConfig(**settings)
    validate(config)
    return config


def cmd_train(argv: Sequence[str]) -> int:
    from ddpkit.dist.torchrun import RunSpec, run
    from ddpkit.recipes.train import clear_previous_run, preflight

    config = train_config(argv)
    preflight(config)
    for path in clear_previous_run(config):
        print(f"ddpkit train: --overwrite removed {path}")
    spec = RunSpec("ddpkit.recipes.train", ["--config-json", config.to_json()], module=True,
                   nproc_per_node=config.nproc, max_restarts=config.max_restarts, nnodes=config.nnodes,
                   node_rank=config.node_rank, master=config.master)
    code = run(spec)
    if code == 0:
        print(f"ddpkit train: wrote {config.out}/summary.json")
    return code


def cmd_predict(argv: Sequence[str]) -> int:
    from ddpkit.dist.torchrun import RunSpec, run
    from ddpkit.recipes.predict import PredictConfig, prepare, to_json

    parser = Parser(prog="ddpkit predict",
                     description="Predict with a ddpkit train checkpoint; one row per input, in input order.")
    parser.add_argument("--checkpoint", required=True, help="checkpoint file (or directory: its newest)")
    parser.add_argument("--data", default="digits", help="digits, mnist, cifar10 or synthetic (default digits)")
    parser.add_argument("--data-dir", dest="data_dir", default=None, help="torchvision's files for mnist/cifar10")
    parser.add_argument("--split", default="test", help="train or test (default test)")
    parser.add_argument("--nproc", type=int, default=1, help="processes (default 1)")
    parser.add_argument("--batch", type=int, default=256, help="batch size per process (default 256)")
    parser.add_argument("--out", required=True,
                        help="FILE.csv (index,prediction,prob_0..), FILE.npy (probabilities) or FILE.pt")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    config = PredictConfig(**vars(parser.parse_args(argv)))
    path = prepare(config)
    spec = RunSpec("ddpkit.recipes.predict", ["--config-json", to_json(config), "--checkpoint-file", str(path)],
                   module=True, nproc_per_node=config.nproc)
    code = run(spec)
    if code == 0:
        print(f"ddpkit predict: wrote {config.out}")
    return code


def cmd_export(argv: Sequence[str]) -> int:
    """``ddpkit export``: one checkpoint's model weights as a plain ``torch.save`` state dict."""
    from pathlib import Path

    import torch

    from ddpkit import checkpoint
    from ddpkit.tracking import atomic_path

    parser = Parser(prog="ddpkit export", description="Write a checkpoint's model weights (sharded or not) "
                    "as one state dict with plain names, loadable with torch.load and model.load_state_dict.")
    parser.add_argument("--checkpoint", required=True, help="checkpoint (file, step directory, or a "
                        "checkpoint directory: its newest)")
    parser.add_argument("--out", required=True, help="FILE.pt to write")
    parser.add_argument("--key", default="model", help="the state entry to export (default model)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    opts = parser.parse_args(argv)
    source, out = Path(opts.checkpoint), Path(opts.out)
    if out.exists() and not opts.overwrite:
        raise UsageError(f"--out {out} exists; pass --overwrite to replace it")
    if not source.exists():
        raise UsageError(f"--checkpoint {source} does not exist")
    path = source if source.is_file() or checkpoint.dcp.is_dcp(source) else checkpoint.latest(source)
    if path is None:
        raise UsageError(f"--checkpoint {source}: no complete checkpoint in this directory")
    user = checkpoint.read(path)["user"]
    if opts.key not in user:
        raise DdpkitError(f"checkpoint {path} has no entry {opts.key!r}; it has {', '.join(sorted(user))}")
    with atomic_path(out) as tmp:
        torch.save(user[opts.key], tmp)
    print(f"ddpkit export: wrote {out} ({opts.key} of {path})")
    return 0


def cmd_bench(argv: Sequence[str]) -> int:
    from ddpkit.bench.run import cmd_bench as bench_main

    return bench_main(argv)


def cmd_slurm(argv: Sequence[str]) -> int:
    from ddpkit.slurm import cmd_slurm as slurm_main

    return slurm_main(argv)


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "run": (cmd_run, "start a script in N processes per node (over torch.distributed.run)"),
    "train": (cmd_train, "train a built-in recipe (convnet/mlp/resnet on digits/mnist/cifar10/synthetic)"),
    "predict": (cmd_predict, "predict with a ddpkit train checkpoint, one row per input in input order"),
    "bench": (cmd_bench, "measure throughput, scaling, memory and the step breakdown per mode"),
    "export": (cmd_export, "write a checkpoint's model weights (sharded or not) as one plain state dict"),
    "slurm": (cmd_slurm, "print an sbatch script that runs a script with ddpkit on N nodes"),
    "doctor": (cmd_doctor, "check this machine and launch for what would make a run fail"),
    "demo": (cmd_demo, "run the built-in end-to-end demonstration"),
}


def _usage() -> str:
    lines = ["usage: ddpkit COMMAND [OPTIONS]", "", "commands:"]
    lines += [f"  {name:<8} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "'ddpkit COMMAND --help' describes a command."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ddpkit`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from ddpkit import __version__

        print(f"ddpkit {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    try:
        if name not in COMMANDS:
            raise UsageError(f"unknown command {name!r}; choose one of {', '.join(COMMANDS)}")
        return COMMANDS[name][0](rest)
    except DdpkitError as exc:
        sys.stderr.write(f"ddpkit {name}: error: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write(f"ddpkit {name}: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
