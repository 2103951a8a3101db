"""The prepared GPU check (``make gpu-check``): one command for a machine with CUDA torch, ≤ 8 minutes.

It installs nothing and imports ddpkit from ``src`` (``PYTHONPATH=src``), so it runs on an image
that has CUDA torch and pytest and none of ddpkit's extras. In order, each with its own time limit:

1. what the machine is: the GPU, torch, CUDA and which of ddpkit's optional modules import;
2. every test marked ``gpu`` (``pytest -m gpu -rs``): nccl DDP, autocast, fsdp, SyncBatchNorm,
   pinned loading, DataParallel, micro-shards on one GPU with 1 process against 2 processes
   sharing it over gloo (bitwise), an op without a deterministic kernel refused in one line;
3. ``ddpkit bench`` rows of DDP and DDP+AMP on ResNet-18 (synthetic data), and the same DDP row
   with ``--micro-shards 1`` beside it.

The report goes to the terminal and to ``OUT/gpu-check.md`` (``$OUT`` where the device tool sets it,
else ``runs/gpu-check``), ready to paste into BENCHMARKS.md. The exit code is 0 only when every part
passed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = ["numpy", "tqdm", "psutil", "sklearn", "pytest_timeout", "matplotlib"]
GPU_TESTS = ["tests/test_gpu.py", "tests/test_runtime.py"]
"""The files holding tests marked gpu (tests/test_bench.py checks the list): only they are collected,
so a module the image lacks in another test file stops no GPU test."""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def _text(part: bytes | str | None) -> str:
    return part.decode(errors="replace") if isinstance(part, bytes) else part or ""


def _run(title: str, command: list[str], limit: int, out: Path, report: list[str]) -> bool:
    print(f"\n== {title}: {' '.join(command)}", flush=True)
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, env=_env(), text=True, capture_output=True, timeout=limit, check=False)
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:  # its output so far comes as bytes, text=True or not
        text = "".join(_text(part) for part in (exc.stdout, exc.stderr)) + f"\n(stopped after {limit} s)"
        code = 124
    seconds = time.monotonic() - start
    print(text[-6000:], flush=True)
    verdict = "passed" if code == 0 else f"FAILED (exit {code})"
    report += [
        f"### {title}: {verdict} in {seconds:.0f} s",
        "",
        "```",
        f"$ {' '.join(command)}",
        text[-4000:].rstrip(),
        "```",
        "",
    ]
    (out / (re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") + ".log")).write_text(text)
    return code == 0


def main() -> int:
    out = Path(os.environ.get("OUT") or ROOT / "runs" / "gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    import torch

    # bench folders hold many files; the device tool brings back at most 8 from $OUT, so they go beside it
    work = Path(tempfile.mkdtemp(prefix="gpu-check-")) if os.environ.get("OUT") else out
    report = ["## GPU check", ""]
    if not torch.cuda.is_available():
        print(f"make gpu-check: torch {torch.__version__} sees no CUDA GPU (CPU wheel, or no driver)", file=sys.stderr)
        return 2
    missing = [m for m in OPTIONAL if importlib.util.find_spec(m) is None]
    machine = (
        f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, {os.cpu_count()} CPU cores; "
        f"optional modules missing: {', '.join(missing) or 'none'}"
    )
    print(machine, flush=True)
    report += [machine, ""]
    py = sys.executable
    results = [
        _run(
            "Tests marked gpu",
            [py, "-m", "pytest", "-m", "gpu", "-rs", "-q", "-p", "no:cacheprovider", *GPU_TESTS],
            280,
            out,
            report,
        )
    ]
    bench = [py, "-m", "ddpkit", "bench", "--model", "resnet18", "--data", "synthetic", "--nproc", "1"]
    bench += ["--batch-size", "64", "--steps", "30", "--warmup", "5"]
    results.append(
        _run(
            "Bench DDP and DDP+AMP",
            [*bench, "--modes", "ddp,ddp-amp", "--out-dir", str(work / "bench")],
            90,
            out,
            report,
        )
    )
    results.append(
        _run(
            "Bench micro-shards",
            [*bench, "--modes", "ddp", "--micro-shards", "1", "--out-dir", str(work / "bench-ms")],
            60,
            out,
            report,
        )
    )
    (out / "gpu-check.md").write_text("\n".join(report) + "\n")
    print(f"\nmake gpu-check: {sum(results)} of {len(results)} parts passed; the report is {out / 'gpu-check.md'}")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
