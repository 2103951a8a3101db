"""``ddpkit demo``: the seeds' comparison on real data, end to end.

Trains the seeds' ConvNet on scikit-learn's digits as a single process, DDP x N in fp32 and
DDP x N in bf16 (and DataParallel when two or more GPUs are visible), each in fresh
processes through ``ddpkit train``, then measures each configuration's step as ``ddpkit bench``
does (the same model, data, global batch and precision) for a diagnosis per row: what bounds it,
the shares of a step, the threads per process. It prints the table, the diagnoses and a verdict
for this machine, and writes ``report.md``, ``report.json``, ``scaling.png`` and ``loss.png``
into ``runs/demo``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from ddpkit._argparse import Parser
from ddpkit.errors import DdpkitError, UsageError
from ddpkit.dist.torchrun import RunSpec, run
from ddpkit.recipes.config import TrainConfig, validate
from ddpkit.bench.outputs import write_report
from ddpkit.bench.table import COLUMNS, add_speedup, markdown_table


def cmd_demo(argv: Sequence[str]) -> int:
    """``ddpkit demo``: parse ``--nproc``, ``--epochs`` and ``--out``, then run :func:`main`."""
    parser = Parser(prog="ddpkit demo", description="Run the built-in end-to-end demonstration.")
    parser.add_argument("--nproc", type=int, default=2, help="processes for the distributed runs (default 2)")
    parser.add_argument("--epochs", type=int, default=5, help="epochs of every run (default 5)")
    parser.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    opts = parser.parse_args(argv)
    if opts.nproc < 1 or opts.epochs < 1:
        raise UsageError("--nproc and --epochs must be at least 1")
    return main(nproc=opts.nproc, out=opts.out, epochs=opts.epochs)


def modes(nproc: int, gpus: int) -> list[tuple[str, dict[str, Any]]]:
    """(mode name, TrainConfig overrides) of every configuration the demo compares."""
    found = [("single", {"nproc": 1, "precision": "fp32"})]
    if gpus >= 2:
        found.append(("dp", {"nproc": 1, "precision": "fp32", "data_parallel": True}))
    found.append(("ddp", {"nproc": nproc, "precision": "fp32"}))
    found.append(("ddp", {"nproc": nproc, "precision": "bf16"}))
    return found


def _train(config: TrainConfig) -> dict[str, Any]:
    validate(config)
    code = run(RunSpec("ddpkit.recipes.train", ["--config-json", config.to_json()], module=True,
                       nproc_per_node=config.nproc))
    if code != 0:
        raise DdpkitError(f"demo run into {config.out} failed (exit code {code}); see the output above")
    return json.loads((Path(config.out) / "summary.json").read_text())


def main(nproc: int = 2, out: str = "runs/demo", epochs: int = 5) -> int:
    """Train and measure every mode, print the table, the diagnoses and the verdict, write the files."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rows = []
    for mode, overrides in modes(nproc, gpus):
        name = f"{mode}-x{overrides['nproc']}-{overrides['precision']}"
        print(f"== {name}", flush=True)
        config = TrainConfig(model="convnet", data="digits", epochs=epochs, out=f"{out}/{name}",
                             overwrite=True, **overrides)
        summary = _train(config)
        print(f"== {name}: measuring a step as ddpkit bench does", flush=True)
        step = _measure(mode, overrides, gpus, Path(out) / "bench" / f"{name}.json")
        rows.append({"mode": mode, "processes": summary["world_size"], "precision": summary["precision"],
                     "wall_seconds": summary["wall_seconds"], "samples_per_second": summary["samples_per_second"],
                     "test_accuracy": summary["test_accuracy"], "test_loss": summary["test_loss"],
                     "run": name, "step": step})
    rows = add_speedup(rows)
    rows = [_diagnosed(row, [r["step"] for r in rows]) for row in rows]
    said = verdict(rows)
    note = (f"ConvNet on scikit-learn digits ({epochs} epochs, global batch 64, SGD lr 0.05), "
            f"{'CUDA' if gpus else 'CPU'}; wall s is the whole training process, samples/s the "
            "training steps alone. The diagnoses come from a separate measured run of each "
            "configuration (as `ddpkit bench`: 3 warm-up + 20 timed steps); in the shares, communication is "
            "what DDP's backward took beyond a backward without gradient sync.\n\n## Diagnosis\n\n"
            + "\n".join(f"- {row['run']}: {row['diagnosis']}" for row in rows)
            + f"\n\n## Verdict\n\n{said}")
    paths = write_report(out, [{k: v for k, v in r.items() if k != "step"} for r in rows], title="ddpkit demo",
                         columns=COLUMNS, extra_markdown=note)
    _plot_losses(Path(out), [row["run"] for row in rows])
    print()
    print(markdown_table(rows, COLUMNS))
    print()
    for row in rows:
        print(f"{row['run']}: {row['diagnosis']}")
    print(f"\n{said}")
    print(f"\nreport: {paths['markdown']}  plot: {paths['plot']}  losses: {Path(out) / 'loss.png'}")
    return 0


def _measure(mode: str, overrides: dict[str, Any], gpus: int, result: Path) -> dict[str, Any]:
    """A ``ddpkit bench`` row of this configuration: 64 samples a step, as the training used."""
    from ddpkit.bench.plan import Configuration, Settings
    from ddpkit.bench.run import measure

    nproc, devices = overrides["nproc"], (gpus if overrides.get("data_parallel") else 1)
    config = Configuration(mode, nproc, overrides["precision"], devices=devices)
    settings = Settings(model="convnet", data="digits", batch=max(1, 64 // (nproc * devices)), steps=20,
                        warmup=3, out=str(result.parent))
    return measure(config, settings, result)


def _diagnosed(row: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    """``row`` with the bench diagnosis of its step, the step's shares and its threads per process."""
    from ddpkit.bench.diagnose import bound_word, diagnose

    step = row["step"]
    diagnosis = diagnose(step, steps)
    return {**row, "diagnosis": diagnosis, "bound": bound_word(diagnosis), "shares": shares(step),
            "threads_per_process": step["threads_per_process"], "cores": step["cores"]}


def shares(step: dict[str, Any]) -> dict[str, float]:
    """Shares of a mean step: compute, communication (the allreduce left exposed), waiting for the
    slowest rank, and data. They add up to 1."""
    phases, total = step["breakdown"], step["mean_step_seconds"]
    comm = step.get("comm") or {}
    exposed = comm.get("exposed_seconds")
    if exposed is None and comm:
        exposed = min(comm["allreduce_seconds"], phases["backward"])
    exposed = exposed or 0.0
    busy = phases["forward"] + phases["backward"] + phases["optimizer"]
    waiting = max(0.0, total - busy - phases["data_wait"])
    parts = {"compute": max(0.0, busy - exposed), "communication": min(exposed, busy), "waiting": waiting,
             "data": phases["data_wait"]}
    whole = sum(parts.values()) or 1.0
    return {name: value / whole for name, value in parts.items()}


def verdict(rows: list[dict[str, Any]]) -> str:
    """Two or three sentences for this machine, from the measured rows."""
    single = rows[0]
    ddp = next((r for r in rows if r["mode"] == "ddp" and r["precision"] == "fp32"), None)
    if ddp is None:
        return ""
    cores, threads, n = ddp["cores"], ddp["threads_per_process"], ddp["processes"]
    split = ", ".join(f"{name} {value:.0%}" for name, value in ddp["shares"].items() if value >= 0.005)
    bound = ddp["diagnosis"].split(";")[0].removeprefix("bound by ").split(" (")[0]
    said = [f"On this machine ({cores} cores, {n} processes of {threads} thread(s) each), DDP x{n} runs at "
            f"{ddp['speedup']:.2f}x the samples/s of one process: it is bound by {bound} (a step is {split})."]
    fast = [r for r in rows if r["precision"] != "fp32" and "not accelerated" in r["diagnosis"]]
    for row in fast:
        said.append(f"{row['precision']} runs at {row['speedup']:.2f}x: {row['diagnosis'].split(':')[0]}.")
    if ddp["speedup"] < 1.0:
        said.append("What would change it: more compute per step (a bigger model or batch), so the fixed "
                    "per-step costs and the gradient exchange weigh less, and more cores, machines or GPUs "
                    "to run on; `ddpkit bench --model resnet18 --data synthetic --modes single,ddp --nproc 2` "
                    "measures a bigger model here.")
    else:
        said.append(f"{single['mode']} is the baseline; `ddpkit bench` explains each row in more detail.")
    return " ".join(said)


def _plot_losses(out: Path, runs: list[str]) -> None:
    """Test loss per epoch of every run in one picture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, axis = plt.subplots(figsize=(7, 4))
    for name in runs:
        rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line]
        axis.plot([r["epoch"] + 1 for r in rows], [r["test_loss"] for r in rows], marker="o", label=name)
    axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axis.set_xlabel("epoch")
    axis.set_ylabel("test loss")
    axis.set_title("ddpkit demo: test loss per epoch")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "loss.png", dpi=100)
    plt.close(figure)
