"""``ddpkit bench --checkpoints``: what a checkpoint costs the training loop, written in the
background (the default), with ``blocking=True``, and as a hand-written loop's ``torch.save``.

One ``ddpkit run`` job of ``--nproc`` processes (:mod:`ddpkit.bench.ckpt_worker`) trains the
three stretches one after the other, so they share the machine's state; ``checkpoints.json``
and ``checkpoints.md`` in ``--out`` hold, per stretch, the seconds the loop waits per save, the
seconds a background write takes behind the loop, and the host memory its copy holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ddpkit._files import write_text_atomic


def run(settings: Any) -> dict[str, Any]:
    """Run the job; what ``checkpoints.json`` holds, with the ratios to the plain ``torch.save``."""
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    n = settings.nproc[0]
    command = [
        sys.executable,
        "-m",
        "ddpkit",
        "run",
        "-n",
        str(n),
        "-m",
        "ddpkit.bench.ckpt_worker",
        "--out",
        str(out),
        "--model",
        settings.model,
        "--data",
        settings.data,
        "--batch",
        str(settings.batch * n),
        "--steps",
        str(settings.steps),
        "--checkpoint-every",
        str(settings.checkpoint_every),
        "--seed",
        str(settings.seed),
    ]
    print(f"bench: checkpoints of {settings.model} on {n} process(es) ...", flush=True)
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"bench --checkpoints: the run failed (exit {done.returncode}):\n" + done.stderr[-3000:])
    report = json.loads((out / "checkpoints.json").read_text())
    plain = report["stretches"]["plain"]["loop_wait_s"]
    for row in report["stretches"].values():
        row["wait_vs_plain"] = row["loop_wait_s"] / plain if plain else None
    report.update(model=settings.model, steps=settings.steps, checkpoint_every=settings.checkpoint_every)
    return report


def table(report: dict[str, Any]) -> str:
    """The report as a markdown table."""
    lines = [
        f"{report['model']} ({report['model_mb']:.0f} MB of weights, AdamW), {report['world_size']} process(es), "
        f"a save every {report['checkpoint_every']} steps",
        "",
        "| save | loop waits per save (s) | x plain torch.save | write behind the loop (s) | host memory held (MB) "
        "| median step (s) | stretch wall (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    names = {"plain": "plain torch.save (rank 0)", "blocking": "rt.save(blocking=True)", "background": "rt.save"}
    for kind, row in report["stretches"].items():
        write = row["background_write_s"]
        cells = [
            names[kind],
            f"{row['loop_wait_s']:.4f}",
            f"{row['wait_vs_plain']:.3f}" if row["wait_vs_plain"] is not None else "-",
            f"{write:.3f}" if write is not None else "-",
            f"{row['held_mb']:.0f}",
            f"{row['step_s']:.4f}",  # the wait is not all: a copy or a write behind the loop slows its steps
            f"{row['wall_s']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(report: dict[str, Any], out: Path) -> list[Path]:
    """``checkpoints.json`` (with the ratios) and ``checkpoints.md`` in ``out``."""
    json_path, md_path = out / "checkpoints.json", out / "checkpoints.md"
    write_text_atomic(json_path, json.dumps(report, indent=2) + "\n")
    write_text_atomic(md_path, f"`{report.get('command', '')}`\n\n{table(report)}\n")
    return [json_path, md_path]


__all__ = ["run", "table", "write"]
