"""The manual: it builds in strict mode, its references cover the code, and its code blocks run.

The site is built once (Sphinx, ``-W -n``: any warning, a broken link or reference, fails) into a
temporary folder. The API reference must hold every name of ``ddpkit.__all__`` and the CLI
reference every command and flag of the real parsers, so a new name or flag without docs fails
here. Every ``python`` and ``bash`` block of the README and the pages runs unless a comment
``<!-- not-run: reason -->`` stands right above it; the marked ones are counted and listed. A
fragment that takes a model or data for granted says so with ``<!-- runs-after: tiny rt -->``:
it runs after those files of ``tests/docs_setup/`` (a small model, random data, a runtime).
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ddpkit
from ddpkit.cli import COMMANDS
from helpers import BIN, ROOT, clean_env

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```(python|bash)\s*$")
_NOT_RUN = re.compile(r"^<!-- not-run: (.+) -->$")
_RUNS_AFTER = re.compile(r"^<!-- runs-after: ([\w ]+) -->$")
SETUP = ROOT / "tests" / "docs_setup"


def _blocks() -> list[tuple[str, str, str, str | None]]:
    """(where, language, code, reason not run) of every python and bash block; a block marked
    ``runs-after`` has the setup files it names in front of its code."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        index = 0
        while index < len(lines):
            fence = _FENCE.match(lines[index])
            if not fence:
                index += 1
                continue
            end = index + 1
            while not lines[end].startswith("```"):
                end += 1
            reason = _NOT_RUN.match(lines[index - 1]) if index else None
            after = _RUNS_AFTER.match(lines[index - 1]) if index else None
            setup = (
                "".join((SETUP / f"{name}.py").read_text() + "\n" for name in after.group(1).split()) if after else ""
            )
            found.append(
                (
                    f"{page.relative_to(ROOT)}:{index + 1}",
                    fence.group(1),
                    setup + "\n".join(lines[index + 1 : end]),
                    reason.group(1) if reason else None,
                )
            )
            index = end + 1
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-n", "--keep-going", "-q", "-b", "html", str(ROOT / "docs"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert built.returncode == 0 and not built.stderr.strip(), built.stderr[-4000:]
    return out


@pytest.mark.timeout(300)
def test_the_site_builds_in_strict_mode_with_every_public_name(site):
    html = (site / "reference" / "api.html").read_text()
    missing = [name for name in ddpkit.__all__ if f'id="ddpkit.{name}"' not in html]
    assert missing == [], f"names of ddpkit.__all__ without an entry in docs/reference/api.md: {missing}"
    for config in ("TrainConfig", "PredictConfig", "Settings", "LoaderOptions", "SetupOptions"):
        assert re.search(rf'id="ddpkit\.[\w.]*\.{config}"', html), config


@pytest.mark.timeout(300)
def test_the_cli_reference_has_every_command_and_flag_of_the_real_parsers(site):
    import importlib

    html = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", (site / "reference" / "cli.html").read_text()))
    for name in COMMANDS:
        parser = importlib.import_module(f"ddpkit.cli.{name}").parser()
        flags = {s for action in parser._actions for s in action.option_strings if s not in ("-h", "--help")}
        assert f"ddpkit {name}" in html, name
        missing = sorted(flag for flag in flags if flag not in html)
        assert missing == [], f"ddpkit {name}: flags missing from the CLI reference: {missing}"


def test_the_readme_is_a_front_page_with_the_set_up_commands_first():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    shown = [line for line in lines if not _NOT_RUN.match(line) and not _RUNS_AFTER.match(line)]  # GitHub hides them
    assert shown[:5] == [
        "# ddpkit",
        "",
        "```bash",
        "make demo   # creates .venv, installs ddpkit, runs the built-in end-to-end demo",
        "make test   # creates .venv, installs ddpkit with test extras, runs the test suite",
    ]
    for link in re.findall(r"\]\(((?:docs/)[^)#]+)", "\n".join(lines)):
        assert (ROOT / link).exists(), link


def test_every_block_runs_or_says_why_not(capsys):
    blocks = _blocks()
    skipped = [(where, reason) for where, _, _, reason in blocks if reason]
    with capsys.disabled():
        print(f"\n{len(skipped)} of {len(blocks)} code blocks are marked not runnable here:")
        for where, reason in skipped:
            print(f"  {where}: {reason}")
    assert len(blocks) - len(skipped) >= 13  # the count this suite has run since the setup files


def _runnable() -> list[Any]:
    """Every runnable block; a page's first two in make test, the others in make test-slow (5 s each)."""
    found, seen = [], collections.Counter()
    for where, language, code, reason in _blocks():
        if reason:
            continue
        seen[where.rsplit(":", 1)[0]] += 1
        marks = [pytest.mark.slow] if seen[where.rsplit(":", 1)[0]] > 2 else []
        found.append(pytest.param(where, language, code, marks=marks, id=where))
    return found


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where, language, code", _runnable())
def test_a_runnable_block_runs(where, language, code, tmp_path):
    env = clean_env(PATH=f"{BIN}:{clean_env()['PATH']}")
    if language == "python":
        done = subprocess.run(
            [str(BIN / "python"), "-c", code], capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env
        )
    else:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env
        )
    assert done.returncode == 0, f"{where}\n{done.stderr[-3000:]}"
    for expected in re.findall(r"#\s*(world_size=\d+ rank_sum=\d+)", code):  # what the comments promise
        assert expected in done.stdout, f"{where}: {expected!r} not printed\n{done.stdout[-2000:]}"


def _documented_keys(section: str) -> list[str]:
    text = (ROOT / "docs" / "reference" / "outputs.md").read_text()
    part = text[text.index(section) :]
    part = part[: part.index("\n## ", 1)] if "\n## " in part[1:] else part
    return re.findall(r"^\| `(\w+)` \|", part, re.M)


def _dict_keys(path: Path, name: str) -> list[str]:
    """The string keys of the dict literal assigned to ``name`` in ``path``."""
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(getattr(t, "id", None) == name for t in targets) and isinstance(node.value, ast.Dict):
            return [key.value for key in node.value.keys if isinstance(key, ast.Constant)]
    raise AssertionError(f"no dict {name} in {path}")


def test_the_output_keys_page_lists_every_key_the_code_writes():
    src = ROOT / "src" / "ddpkit"
    assert _documented_keys("## `summary.json`") == _dict_keys(src / "recipes" / "train.py", "summary")
    assert _documented_keys("## A sharded checkpoint's `manifest.json`") == _dict_keys(
        src / "checkpoint" / "dcp.py", "manifest"
    )


def test_the_output_keys_page_lists_every_key_of_the_fault_tolerant_bench():
    from ddpkit.bench import ft

    src = ROOT / "src" / "ddpkit"
    report = _dict_keys(src / "bench" / "ft.py", "report")
    assert _documented_keys("## `ft.json`")[: len(report)] == report
    t = 1000.0
    events = [
        {"who": w, "attempt": 0, "kind": "step", "step": s, "local": 20, "t": t + s} for w in (0, 1, 2) for s in (1, 2)
    ]
    events += [
        {"who": 1, "attempt": 1, "kind": "process", "step": 0, "t": t + 9},
        {"who": 1, "attempt": 1, "kind": "step", "step": 4, "local": 20, "t": t + 10},
        {"who": 0, "attempt": 0, "kind": "step", "step": 3, "local": 30, "t": t + 4},
    ]
    row = {**ft.measure(events, kill_at=2), **ft.TIMED}
    assert _documented_keys("## `ft.json`")[len(report) :] == list(row)
    assert row["recovery_s"] == 2.0 and row["heal_s"] == 1.0 and row["rejoined_s_after_kill"] == 8.0


def _returned_keys(path: Path, function: str) -> list[str]:
    """The string keys of the dict literals ``function`` in ``path`` returns (or appends)."""
    import ast

    tree = ast.parse(path.read_text())
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            for inner in ast.walk(node):
                value = (
                    inner.value
                    if isinstance(inner, ast.Return)
                    else (
                        inner.args[0]
                        if isinstance(inner, ast.Call) and getattr(inner.func, "attr", "") == "append" and inner.args
                        else None
                    )
                )
                for literal in value.elts if isinstance(value, ast.List) else [value]:
                    if isinstance(literal, ast.Dict):
                        found += [k.value for k in literal.keys if isinstance(k, ast.Constant) and k.value not in found]
    assert found, f"no dict returned by {function} in {path}"
    return found


def test_the_output_keys_page_lists_every_key_of_bench_json_and_the_demo_report():
    src = ROOT / "src" / "ddpkit"
    bench = src / "bench"
    assert _documented_keys("## `bench.json`") == _dict_keys(bench / "run.py", "report") + ["raw_vs_ddpkit", "command"]
    row = {
        *_returned_keys(bench / "summary.py", "summarize"),
        *_returned_keys(bench / "summary.py", "not_applicable"),
        "diagnosis",
        "verify",
        "exact_vs_plain",  # set by run_bench on --compare-exact's micro-shard rows
    }
    assert set(_documented_keys("## A `bench.json` row")) == row
    comm = [
        k
        for k in _returned_keys(bench / "wire.py", "split") + _returned_keys(bench / "summary.py", "_comm")
        if k not in ("payload_call_s", "overlap")
    ]  # the first is renamed, the second moves up a level
    assert set(_documented_keys("## A row's `comm`")) == set(comm)
    fixes = {
        *_returned_keys(bench / "diagnose.py", "recommendations"),
        *_returned_keys(bench / "diagnose.py", "_infrequent"),
        *_returned_keys(bench / "diagnose.py", "checked"),
        *_returned_keys(src / "cli" / "demo.py", "_verify"),
    }
    assert set(_documented_keys("## A row's `verify`")) == fixes | {"measured_samples_per_second"}
    assert set(_documented_keys("## `raw_vs_ddpkit`")) == set(_returned_keys(bench / "run.py", "compare_raw"))
    demo = [k for k in _returned_keys(src / "cli" / "demo.py", "main") if k != "step"]  # dropped before writing
    demo += [
        "max_rel_diff_vs_single",
        "speedup",
        "efficiency",
        *_returned_keys(src / "cli" / "demo.py", "_diagnosed"),
        "verify",
    ]
    assert _documented_keys("## `report.json`") == demo
