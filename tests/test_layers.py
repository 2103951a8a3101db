"""The import layers of issue 26, checked by import-linter with the contracts in pyproject.toml."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import BIN, ROOT, clean_env


def _lint(src: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with the project's contracts, over the ``ddpkit`` package found in ``src``.

    COLUMNS is wide so that no contract's name is wrapped over two lines of the report.
    """
    return subprocess.run([str(BIN / "lint-imports"), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=src, env=clean_env(PYTHONPATH=str(src), COLUMNS="200"), capture_output=True, text=True,
                          timeout=120)


def test_the_layers_contracts_are_kept():
    done = _lint(ROOT / "src")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout and "ddpkit.dist stands on the base modules alone KEPT" in done.stdout
    assert "ddpkit.checkpoint stands on parallel, dist and the base modules alone KEPT" in done.stdout
    assert "ddpkit.parallel stands on dist, observe and the base modules alone KEPT" in done.stdout
    assert "no circles between the modules of ddpkit.parallel KEPT" in done.stdout
    assert "ddpkit.bench stands on runtime and below KEPT" in done.stdout
    assert "no circles between the modules of ddpkit.bench KEPT" in done.stdout
    assert "ddpkit.recipes stands on runtime and below KEPT" in done.stdout
    assert "nothing imports ddpkit.cli but python -m ddpkit KEPT" in done.stdout
    assert "no circles between the modules of ddpkit.cli KEPT" in done.stdout


@pytest.mark.parametrize("module, line, broken", [
    ("dist/host.py", "from ddpkit import runtime", "ddpkit.dist stands on the base modules alone BROKEN"),
    ("dist/host.py", "from ddpkit.dist import torchrun", "no circles between the modules of ddpkit.dist BROKEN"),
    ("errors.py", "from ddpkit.dist import collectives",
     "base modules (errors, _torch, entry, _files, rng, _argparse) import nothing above BROKEN"),
    ("_argparse.py", "from ddpkit import cli",
     "base modules (errors, _torch, entry, _files, rng, _argparse) import nothing above BROKEN"),
    ("checkpoint/pt.py", "from ddpkit import runtime",
     "ddpkit.checkpoint stands on parallel, dist and the base modules alone BROKEN"),
    ("parallel/ddp.py", "from ddpkit import runtime",
     "ddpkit.parallel stands on dist, observe and the base modules alone BROKEN"),
    ("bench/run.py", "from ddpkit import cli", "ddpkit.bench stands on runtime and below BROKEN"),
    ("bench/stopwatch.py", "from ddpkit.bench import run", "no circles between the modules of ddpkit.bench BROKEN"),
    ("recipes/models.py", "from ddpkit.bench import plan", "ddpkit.recipes stands on runtime and below BROKEN"),
    ("recipes/models.py", "from ddpkit import cli", "nothing imports ddpkit.cli but python -m ddpkit BROKEN"),
    ("dist/host.py", "from ddpkit.cli import run", "nothing imports ddpkit.cli but python -m ddpkit BROKEN"),
])
def test_an_upward_import_or_a_circle_breaks_them(tmp_path, module, line, broken):
    done = _lint_with(tmp_path, {module: line})
    assert done.returncode != 0 and broken in done.stdout, done.stdout[-3000:]


def test_two_commands_importing_each_other_break_the_cli_contract(tmp_path):
    done = _lint_with(tmp_path, {"cli/train.py": "from ddpkit.cli import predict",
                                 "cli/predict.py": "from ddpkit.cli import train"})
    assert done.returncode != 0 and "no circles between the modules of ddpkit.cli BROKEN" in done.stdout, \
        done.stdout[-3000:]


def _lint_with(tmp_path: Path, lines: dict[str, str]) -> subprocess.CompletedProcess:
    """``lint-imports`` over a copy of the package with each line appended to its module."""
    shutil.copytree(ROOT / "src" / "ddpkit", tmp_path / "ddpkit", ignore=shutil.ignore_patterns("__pycache__"))
    for module, line in lines.items():
        target = tmp_path / "ddpkit" / module
        target.write_text(target.read_text() + f"\n{line}  # an import up a layer, or round in a circle\n")
    return _lint(tmp_path)
