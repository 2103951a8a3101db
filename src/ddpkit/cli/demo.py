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

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpkit._argparse import Parser
from ddpkit.bench import guarantee
from ddpkit.bench.diagnose import bound_word, checked, diagnose, recommendations
from ddpkit.bench.outputs import verified_line, write_report
from ddpkit.bench.plan import BenchSettings, Configuration
from ddpkit.bench.run import measure
from ddpkit.bench.table import COLUMNS, add_speedup, markdown_table
from ddpkit.cli.demo_verdict import closest, exact_threads, shares, verdict
from ddpkit.distributed.torchrun import RunSpec, run
from ddpkit.errors import DdpkitError, UsageError
from ddpkit.recipes.config import TrainConfig, validate


def _rel_diff_cell(value: float) -> str:
    """``0 (bitwise)`` for equal bits, else the difference in one significant digit."""
    return "0 (bitwise)" if value == 0 else f"{value:.0e}"


DEMO_COLUMNS = [
    *COLUMNS[:3],
    ("micro_shards", "micro-shards", "{:d}"),
    *COLUMNS[3:],
    ("max_rel_diff_vs_single", "max rel. diff vs single", _rel_diff_cell),
]
"""The demo's table: the comparison's columns and how far each run's weights end from one process's."""


def parser() -> argparse.ArgumentParser:
    """The parser of ``ddpkit demo``."""
    parser = Parser(prog="ddpkit demo", description="Run the built-in end-to-end demonstration.")
    parser.add_argument("--nproc", type=int, default=2, help="processes for the distributed runs (default 2)")
    parser.add_argument("--epochs", type=int, default=5, help="epochs of every run (default 5)")
    parser.add_argument(
        "--out-dir", "--out", dest="out", default="runs/demo", help="output directory (default runs/demo)"
    )
    return parser


def cmd_demo(argv: Sequence[str]) -> int:
    """``ddpkit demo``: parse ``--nproc``, ``--epochs`` and ``--out-dir``, then run :func:`main`."""
    opts = parser().parse_args(argv)
    if opts.nproc < 1 or opts.epochs < 1:
        raise UsageError("--nproc and --epochs must be at least 1")
    return main(nproc=opts.nproc, out=opts.out, epochs=opts.epochs)


def modes(nproc: int, gpus: int) -> list[tuple[str, dict[str, Any]]]:
    """(mode name, TrainConfig overrides) of every configuration the demo compares.

    The first row is one process on every core, the speed a DDP row must beat. Where ``nproc`` is
    a power of two, a second single process and the DDP rows train with ``micro_shards=nproc``
    (:mod:`ddpkit.parallel.exact`): the same bits on 1 and ``nproc`` processes. Otherwise the DDP
    rows keep ``ddpkit train``'s default, SyncBatchNorm (the same weights up to float rounding)."""
    exact = {"micro_shards": nproc} if nproc & (nproc - 1) == 0 else {}
    found = [("single", {"nproc": 1, "precision": "fp32"})]  # every core: the speed to beat
    if exact:
        found.append(("single", {"nproc": 1, "precision": "fp32", **exact}))  # the weights to match
    if gpus >= 2:
        found.append(("dp", {"nproc": 1, "precision": "fp32", "data_parallel": True}))
    found.append(("ddp", {"nproc": nproc, "precision": "fp32", **exact}))
    found.append(("ddp", {"nproc": nproc, "precision": "bf16", **exact}))
    return found


def _train(config: TrainConfig) -> dict[str, Any]:
    validate(config)
    code = run(
        RunSpec("ddpkit.recipes.train", ["--config-json", config.to_json()], module=True, nproc_per_node=config.nproc)
    )
    if code != 0:
        raise DdpkitError(f"demo run into {config.out_dir} failed (exit code {code}); see the output above")
    return json.loads((Path(config.out_dir) / "summary.json").read_text())


def main(nproc: int = 2, out: str = "runs/demo", epochs: int = 5) -> int:
    """Train and measure every mode, compare the weights, print the guarantee, the table, the
    diagnoses (each fix measured) and the verdict, and write the files."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rows, weights = [], {}
    for mode, overrides in modes(nproc, gpus):
        shards = overrides.get("micro_shards")
        name = f"{mode}-x{overrides['nproc']}-{overrides['precision']}" + (f"-ms{shards}" if shards else "")
        print(f"== {name}", flush=True)
        config = TrainConfig(
            model="convnet", data="digits", epochs=epochs, out_dir=f"{out}/{name}", overwrite=True, **overrides
        )
        summary = _train(config)
        weights[name] = guarantee.final_weights(summary)
        print(f"== {name}: measuring a step as ddpkit bench does", flush=True)
        step = _measure(mode, overrides, gpus, Path(out) / "bench" / f"{name}.json", sync_bn=summary["sync_bn"])
        rows.append(
            {
                "mode": mode,
                "processes": summary["world_size"],
                "precision": summary["precision"],
                "wall_seconds": summary["wall_seconds"],
                "samples_per_second": summary["samples_per_second"],
                "test_accuracy": summary["test_accuracy"],
                "test_loss": summary["test_loss"],
                "sync_bn": summary["sync_bn"],
                "micro_shards": summary.get("micro_shards"),
                "run": name,
                "step": step,
            }
        )
    singles = {row["micro_shards"]: row["run"] for row in rows if row["mode"] == "single"}
    rows = [
        {
            **row,
            "max_rel_diff_vs_single": guarantee.max_rel_diff(
                weights[singles[row["micro_shards"]]], weights[row["run"]]
            ),
        }
        for row in rows
    ]  # each against the single process of the same settings
    exact_single = next(r for r in rows if r["mode"] == "ddp")["micro_shards"]
    reference_run = singles[exact_single]
    reference = weights[reference_run]
    hand_written = _hand_written(nproc, epochs, Path(out) / f"hand-written-ddp-x{nproc}")
    seeds_diff = guarantee.max_rel_diff(reference, hand_written["model"])
    opening = guarantee.opening_line(rows, seeds_diff, nproc)
    guarantee.write_summary(Path(out), rows, seeds_diff, opening)
    rows = add_speedup(rows)
    rows = [_diagnosed(row, [r["step"] for r in rows]) for row in rows]
    rows = [{**row, "verify": _verify(row, [r["step"] for r in rows], gpus, Path(out) / "bench")} for row in rows]
    nearest = closest(rows, gpus, Path(out) / "bench")
    said = verdict(rows, nearest)
    checks = [f"- {row['run']}: {verified_line(row['verify'])}" for row in rows if row["verify"]]
    note = (
        f"ConvNet on scikit-learn digits ({epochs} epochs, global batch 64, SGD lr 0.05), "
        f"{'CUDA' if gpus else 'CPU'}; wall s is the whole training process, samples/s the "
        "training steps alone, and the speed-up is against the first row, one process on every core; "
        "max rel. diff is the largest relative difference of a run's final weights from those of the "
        "single process trained with the same settings. "
        + (
            f"The rows named `-ms{nproc}` train with `--micro-shards {nproc}`: each global batch in {nproc} "
            f"shards with their own BatchNorm statistics, computed on {exact_threads(rows, nproc)} "
            "thread(s) each and summed along one fixed tree, so one process and DDP do the same additions "
            "(the single process computes its shards one after another, on a share of the cores). "
            if exact_single
            else "BatchNorm is synchronised across processes (`ddpkit train`'s default). "
        )
        + "The diagnoses come from a separate measured run of each "
        "configuration as `ddpkit bench` runs it (the same micro-shards; 3 warm-up + 20 timed steps); "
        "in the shares, communication is what DDP's backward (or the micro-shards' exchange after it) took "
        "beyond a backward without gradient sync.\n\n## Diagnosis\n\n"
        + "\n".join(f"- {row['run']}: {row['diagnosis']}" for row in rows)
        + ("\n\n## Diagnosis checked by measuring it\n\n" + "\n".join(checks) if checks else "")
        + f"\n\n## Verdict\n\n{said}"
    )
    paths = write_report(
        out,
        [{k: v for k, v in r.items() if k != "step"} for r in rows],
        title="ddpkit demo",
        columns=DEMO_COLUMNS,
        extra_markdown=note,
        opening=opening,
    )
    curves = {
        row["run"]: guarantee.epoch_losses(Path(out) / row["run"])
        for row in rows
        if row["micro_shards"] == exact_single
    }
    curves[f"hand-written-ddp-x{nproc}"] = hand_written["test_loss"]
    notes = {
        row["run"]: f"weights equal bit for bit; evaluation's float32 rounding, test set split in {nproc}"
        for row in rows
        if row["run"] in curves
        and row["run"] != reference_run
        and row["max_rel_diff_vs_single"] == 0
        and row["processes"] > 1
    }
    guarantee.plot_losses(Path(out), curves, reference_run, notes)
    print()
    print(opening)
    print()
    print(markdown_table(rows, DEMO_COLUMNS))
    print()
    for row in rows:
        print(f"{row['run']}: {row['diagnosis']}")
    for row in rows:
        if row["verify"]:
            print(f"checked {row['run']}: {verified_line(row['verify'], markdown=False)}")
    print(f"\n{said}")
    print(f"\nreport: {paths['markdown']}  plot: {paths['plot']}  losses: {Path(out) / 'loss.png'}")
    return 0


def _hand_written(nproc: int, epochs: int, out: Path) -> dict[str, Any]:
    """The seeds' hand-written DDP loop on the same data: its final weights and test losses."""
    print(f"== hand-written DDP x{nproc} (DistributedSampler, 64 samples per process)", flush=True)
    args = [
        "--model",
        "convnet",
        "--data",
        "digits",
        "--epochs",
        str(epochs),
        "--batch",
        "64",
        "--lr",
        "0.05",
        "--momentum",
        "0.9",
        "--seed",
        "0",
        "--out",
        str(out),
    ]
    code = run(RunSpec("ddpkit.bench.raw_train", args, module=True, nproc_per_node=nproc))
    if code != 0:
        raise DdpkitError(f"the hand-written DDP run into {out} failed (exit code {code}); see the output above")
    return guarantee.hand_written_weights(out)


def _measure(
    mode: str,
    overrides: dict[str, Any],
    gpus: int,
    result: Path,
    *,
    batch_factor: int = 1,
    grad_compression: str = "none",
    sync_bn: bool = False,
) -> dict[str, Any]:
    """A ``ddpkit bench`` row of this configuration: 64 samples a step and BatchNorm as the training
    used (times ``batch_factor``, with ``grad_compression``, where a diagnosis's fix is measured)."""

    nproc, devices = overrides["nproc"], (gpus if overrides.get("data_parallel") else 1)
    config = Configuration(
        mode,
        nproc,
        overrides["precision"],
        devices=devices,
        grad_compression=grad_compression,
        sync_bn=sync_bn,
        micro_shards=overrides.get("micro_shards"),
    )
    settings = BenchSettings(
        model="convnet",
        data="digits",
        batch=max(1, 64 // (nproc * devices)) * batch_factor,
        steps=20,
        warmup=3,
        out=str(result.parent),
    )
    return measure(config, settings, result)


def _diagnosed(row: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    """``row`` with the bench diagnosis of its step, the step's shares and its threads per process."""
    step = row["step"]
    diagnosis = diagnose(step, steps)
    return {
        **row,
        "diagnosis": diagnosis,
        "bound": bound_word(diagnosis),
        "shares": shares(step),
        "threads_per_process": step["threads_per_process"],
        "cores": step["cores"],
    }


def _verify(row: dict[str, Any], steps: list[dict[str, Any]], gpus: int, runs: Path) -> dict[str, Any] | None:
    """Measure the fix ``row``'s diagnosis predicts the most of (as ``ddpkit bench --diagnose-verify``)."""
    fixes = recommendations(row["step"], steps)
    if not fixes:
        return None
    fix = fixes[0]
    overrides = {
        "nproc": row["processes"] if row["mode"] != "dp" else 1,
        "precision": row["precision"],
        "data_parallel": row["mode"] == "dp",
        "micro_shards": row.get("micro_shards"),
    }
    print(f"== {row['run']}: measuring the diagnosis's fix, {fix['change']}", flush=True)
    measured = _measure(
        row["mode"],
        overrides,
        gpus,
        runs / f"verify-{row['run']}.json",
        batch_factor=fix.get("batch_factor", 1),
        grad_compression=fix.get("grad_compression", "none"),
        sync_bn=row["sync_bn"],
    )
    return {**checked(fix, measured["samples_per_second"]), "step": measured}
