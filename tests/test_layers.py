"""The import layers of issue 26, checked by import-linter with the contracts in pyproject.toml."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import BIN, ROOT, clean_env

LAYERS = "ddpkit's layers"
CIRCLES = "no circles between the modules of any ddpkit package"
CLI = "nothing imports ddpkit.cli but python -m ddpkit"


def _lint(src: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with the project's contracts, over the ``ddpkit`` package found in ``src``."""
    return subprocess.run(
        [str(BIN / "lint-imports"), str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=src,
        env=clean_env(PYTHONPATH=str(src), COLUMNS="200"),  # no name wrapped
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_layers_contracts_are_kept():
    done = _lint(ROOT / "src")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
    assert f"{LAYERS} KEPT" in done.stdout and f"{CIRCLES} KEPT" in done.stdout and f"{CLI} KEPT" in done.stdout


def test_the_root_holds_only_the_facade_and_the_base_modules():
    root = sorted(p.name for p in (ROOT / "src" / "ddpkit").iterdir() if p.name != "__pycache__")
    modules = [name for name in root if name.endswith(".py")]
    assert set(modules) <= {
        "__init__.py",
        "__main__.py",
        "_argparse.py",
        "_bounds.py",
        "_files.py",
        "_torch.py",
        "_tensors.py",
        "_version.py",
        "entry.py",
        "errors.py",
        "rng.py",
    }, modules


@pytest.mark.parametrize(
    "module, line, broken",
    [
        ("distributed/host.py", "from ddpkit import runtime", LAYERS),  # up from dist
        ("errors.py", "from ddpkit.distributed import collectives", LAYERS),  # up from the base
        ("observe/metrics.py", "from ddpkit.distributed import collectives", LAYERS),  # dist | observe: independent
        ("parallel/ddp.py", "from ddpkit.checkpoint import pt", LAYERS),  # up one layer
        ("checkpoint/pt.py", "from ddpkit.loop import state", LAYERS),
        ("loop/evaluate.py", "from ddpkit import runtime", LAYERS),  # the heartbeat that once did
        ("runtime/start.py", "from ddpkit.recipes import train", LAYERS),
        ("bench/run.py", "from ddpkit.cli import train", LAYERS),
        ("_argparse.py", "from ddpkit.cli import train", LAYERS),
        ("recipes/models.py", "from ddpkit import cli", CLI),
        ("bench/stopwatch.py", "from ddpkit.bench import run", CIRCLES),
        ("stray.py", "import torch", LAYERS),  # exhaustive: a new root module
        ("distributed/host.py", "from ddpkit.distributed import torchrun", CIRCLES),
        ("loop/streams/shards.py", "from ddpkit.loop.streams import lengths", CIRCLES),
    ],
)
def test_an_upward_import_a_new_root_module_or_a_circle_breaks_them(tmp_path, module, line, broken):
    shutil.copytree(ROOT / "src" / "ddpkit", tmp_path / "ddpkit", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "ddpkit" / module
    target.write_text((target.read_text() if target.exists() else "") + f"\n{line}  # an import up a layer\n")
    done = _lint(tmp_path)
    assert done.returncode != 0 and f"{broken} BROKEN" in done.stdout, done.stdout[-3000:]


def test_two_commands_importing_each_other_break_the_circles_contract(tmp_path):
    shutil.copytree(ROOT / "src" / "ddpkit", tmp_path / "ddpkit", ignore=shutil.ignore_patterns("__pycache__"))
    for module, line in {
        "cli/train.py": "from ddpkit.cli import predict",
        "cli/predict.py": "from ddpkit.cli import train",
    }.items():
        target = tmp_path / "ddpkit" / module
        target.write_text(target.read_text() + f"\n{line}  # round in a circle\n")
    done = _lint(tmp_path)
    assert done.returncode != 0 and f"{CIRCLES} BROKEN" in done.stdout, done.stdout[-3000:]


def test_import_ddpkit_does_nothing_to_the_process():
    """Nothing on import: no hook, no thread, no variable; ddpkit.init installs the excepthook."""
    import subprocess
    import sys

    code = (
        "import os, sys, threading; hook, threads, env = sys.excepthook, threading.active_count(), dict(os.environ)\n"
        "import ddpkit\n"
        "assert sys.excepthook is hook and threading.active_count() == threads and dict(os.environ) == env\n"
        "assert issubclass(ddpkit.UsageError, ValueError)\n"
        "rt = ddpkit.init()\n"
        "assert sys.excepthook is not hook\n"
        "print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
