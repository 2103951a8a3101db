"""What ``ddpkit demo`` shows first: how far each run ends from one process's weights, in numbers and curves.

ddpkit's claim is that a run's result does not depend on the number of processes: the same global
batches in the same order, each rank's share weighted by its true count, BatchNorm statistics
that do not depend on the split. :func:`max_rel_diff` measures it on the final weights;
:func:`opening_line` says it in one sentence beside the hand-written loop of the seeds' blog posts
(:mod:`ddpkit.bench.raw_train`), and :func:`plot_losses` draws the test-loss curves on top of
each other with their difference from one process's beneath.

With ``--micro-shards`` (:mod:`ddpkit.parallel.exact`, the demo's rows where the process count is
a power of two) the runs do the same additions and end at the same bits. Without it, SyncBatchNorm
leaves float32 rounding: a sum over 64 samples and two sums over 32 differ in the last bit, and a
ReLU or max-pool input within that bit of its threshold then goes the other way, which the
following steps carry on; in float64 those runs agree to 1e-14 (``tests/test_invariance.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ddpkit import checkpoint
from ddpkit._files import atomic_path
from ddpkit.bench.raw_train import WEIGHTS

SAME_WEIGHTS = 1e-5
"""Largest relative difference called "the same weights" (float32 runs)."""
BF16_TOLERANCE = 0.5
"""bf16 rows against one fp32 process: bf16 keeps 8 bits of mantissa (a relative rounding of
0.4% per operation), so over hundreds of steps its weights end a large share of their size
apart; they are compared within this tolerance, with their accuracy in the table."""


def max_rel_diff(reference: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor]) -> float:
    """The largest relative difference between two state dicts: over every floating tensor, its
    largest absolute difference over the reference tensor's largest absolute value."""
    worst = 0.0
    for name, ref in reference.items():
        if not ref.is_floating_point():
            continue
        ref64, other64 = ref.detach().double().cpu(), other[name].detach().double().cpu()
        scale = ref64.abs().max().item()
        worst = max(worst, (ref64 - other64).abs().max().item() / (scale if scale > 0 else 1.0))
    return worst


def final_weights(run_summary: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The model state of a ``ddpkit train`` run's final checkpoint (its ``summary.json``)."""
    return checkpoint.read(Path(run_summary["final_checkpoint"]))["user"]["model"]


def hand_written_weights(out: Path) -> dict[str, Any]:
    """What :mod:`ddpkit.bench.raw_train` saved: ``{"model": state_dict, "test_loss": [...]}``."""
    return torch.load(out / WEIGHTS, map_location="cpu", weights_only=True)


def opening_line(rows: Sequence[Mapping[str, Any]], hand_written: float, nproc: int) -> str:
    """The demo's first sentence: the DDP fp32 row's distance from one process, beside the
    hand-written loop's, then each bf16 row's within :data:`BF16_TOLERANCE`."""
    ddp = next(r for r in rows if r["mode"] == "ddp" and r["precision"] == "fp32")
    ours = ddp["max_rel_diff_vs_single"]
    seeds = f"hand-written DDP with DistributedSampler and the per-process batch ends {hand_written:.0e} away"
    if ours == 0:
        said = [
            f"DDP x{nproc} ends at the same weights as one process, bit for bit (max relative difference 0); {seeds}."
        ]
    elif ours <= SAME_WEIGHTS:
        said = [f"DDP x{nproc} ends at the same weights as one process (max relative difference {ours:.0e}); {seeds}."]
    else:
        said = [
            f"DDP x{nproc} ends {ours:.0e} from one process's weights (max relative difference), where {seeds}"
            f" ({hand_written / max(ours, 1e-30):.0f}x farther): ddpkit trains on one process's global batches "
            "with its BatchNorm statistics, and what is left is float32 rounding (a sum over 64 samples and two "
            "sums over 32 differ in the last bit, and a ReLU or max-pool input within that bit of its threshold "
            "then goes the other way); in float64 the same runs agree to 1e-14."
        ]
    for row in rows:
        if row["precision"] == "bf16":
            within = "within" if row["max_rel_diff_vs_single"] <= BF16_TOLERANCE else "outside"
            said.append(
                f"{row['mode'].upper()} x{row['processes']} bf16 ends {row['max_rel_diff_vs_single']:.0e} "
                f"from one fp32 process, {within} bf16's tolerance of {BF16_TOLERANCE:g} (8 bits of mantissa)."
            )
    return " ".join(said)


def write_summary(out: Path, rows: Sequence[Mapping[str, Any]], hand_written: float, opening: str) -> Path:
    """``out/guarantee.json``: each run's ``max_rel_diff_vs_single``, the hand-written loop's, the
    tolerances they were held to, and the opening line.

    Args:
        out: the demo's output directory.
        rows: the demo's rows, each with ``run`` and ``max_rel_diff_vs_single``.
        hand_written: the hand-written loop's largest relative difference from one process.
        opening: :func:`opening_line`'s sentence.
    """
    summary = {
        "max_rel_diff_vs_single": {row["run"]: row["max_rel_diff_vs_single"] for row in rows},
        "hand_written_max_rel_diff_vs_single": hand_written,
        "same_weights_tolerance": SAME_WEIGHTS,
        "bf16_tolerance": BF16_TOLERANCE,
        "opening": opening,
    }
    target = out / "guarantee.json"
    with atomic_path(target) as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
    return target


def plot_losses(
    out: Path, curves: Mapping[str, Sequence[float]], reference: str, notes: Mapping[str, str] | None = None
) -> Path:
    """Test loss per epoch of every run on one axis, and beneath it each run's absolute difference
    from ``reference``'s (log scale), saved as ``out/loss.png``.

    Args:
        out: the demo's output directory.
        curves: each run's test loss per epoch, by run name, in the legend's order.
        reference: the run the lower panel subtracts (drawn in the upper panel only).
        notes: a few words after a run's name in the lower panel's legend (what its difference is).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2))
    base = curves[reference]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (name, losses) in enumerate(curves.items()):
        epochs = list(range(1, len(losses) + 1))
        style = {"marker": "o", "label": name, "color": colors[index % len(colors)]}
        if name != reference and name.startswith(("ddp", "dp")):
            style.update(linestyle="--", marker="x")  # drawn over the reference: both stay visible
        top.plot(epochs, losses, **style)
        if name != reference:
            gaps = [max(abs(a - b), 1e-12) for a, b in zip(losses, base)]
            note = (notes or {}).get(name)
            bottom.plot(epochs, gaps, **{**style, "label": f"{name}: {note}" if note else name})
    top.set_ylabel("test loss")
    top.set_title(f"ddpkit demo: test loss per epoch; beneath, its difference from {reference}", fontsize="medium")
    top.legend()
    bottom.set_yscale("log")
    bottom.set_ylabel(f"|test loss - {reference}|")
    bottom.set_xlabel("epoch")
    bottom.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    bottom.legend(fontsize="small")
    figure.tight_layout()
    target = out / "loss.png"
    with atomic_path(target) as tmp:
        figure.savefig(tmp, format="png", dpi=100)
    plt.close(figure)
    return target


def epoch_losses(run_dir: Path) -> list[float]:
    """The test loss after each epoch of a ``ddpkit train`` run (its ``metrics.jsonl``)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [r["test_loss"] for r in rows]
