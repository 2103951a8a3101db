"""``ddpkit demo``: the seeds' comparison on real data, end to end.

Trains the seeds' ConvNet on scikit-learn's digits as a single process, DDP x N in fp32 and
DDP x N in bf16 (and DataParallel when two or more GPUs are visible), each in fresh
processes through ``ddpkit train``, then prints the comparison table and writes
``report.md``, ``report.json``, ``scaling.png`` and ``loss.png`` into ``runs/demo``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddpkit.errors import DdpkitError
from ddpkit.launch import RunSpec, run
from ddpkit.recipes.config import TrainConfig, validate
from ddpkit.report import COLUMNS, add_speedup, markdown_table, write_report


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
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rows = []
    for mode, overrides in modes(nproc, gpus):
        name = f"{mode}-x{overrides['nproc']}-{overrides['precision']}"
        print(f"== {name}", flush=True)
        config = TrainConfig(model="convnet", data="digits", epochs=epochs, out=f"{out}/{name}",
                             overwrite=True, **overrides)
        summary = _train(config)
        rows.append({"mode": mode, "processes": summary["world_size"], "precision": summary["precision"],
                     "wall_seconds": summary["wall_seconds"], "samples_per_second": summary["samples_per_second"],
                     "test_accuracy": summary["test_accuracy"], "test_loss": summary["test_loss"],
                     "run": name})
    rows = add_speedup(rows)
    note = (f"ConvNet on scikit-learn digits ({epochs} epochs, global batch 64, SGD lr 0.05), "
            f"{'CUDA' if gpus else 'CPU'}; wall s is the whole training process, samples/s the "
            "training steps alone.")
    paths = write_report(out, rows, title="ddpkit demo", columns=COLUMNS, extra_markdown=note)
    _plot_losses(Path(out), [row["run"] for row in rows])
    print()
    print(markdown_table(rows, COLUMNS))
    print(f"\nreport: {paths['markdown']}  plot: {paths['plot']}  losses: {Path(out) / 'loss.png'}")
    return 0


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
