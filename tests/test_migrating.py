"""docs/migrating.md stays true: it is linked from the README, every ddpkit name it shows exists,
the `ddpkit run` command lines it shows parse, and its before/after line counts are recounted."""

from __future__ import annotations

import re

import ddpkit
from ddpkit.cli.run import parser as run_parser
from helpers import ROOT

DOC = ROOT / "docs" / "migrating.md"


def _text() -> str:
    return DOC.read_text()


def test_the_readme_links_it():
    assert "](docs/migrating.md)" in (ROOT / "README.md").read_text()


def test_every_ddpkit_name_it_shows_exists():
    text = _text()
    runtime_names = set(re.findall(r"\brt\.(\w+)", text))
    module_names = set(re.findall(r"\bddpkit\.(\w+)", text)) - {"py"}
    assert {"setup", "loader", "backward", "step", "accumulate", "evaluate"} & (runtime_names | module_names)
    rt = ddpkit.init()
    try:
        assert [n for n in sorted(runtime_names) if not hasattr(rt, n)] == []
    finally:
        rt.close()
    assert [n for n in sorted(module_names) if not hasattr(ddpkit, n)] == []
    init_args = set(re.findall(r"ddpkit\.init\(([^)]*)\)", text))
    keywords = {k for args in init_args for k in re.findall(r"(\w+)=", args)}
    import inspect

    assert keywords and keywords <= set(inspect.signature(ddpkit.init).parameters)


def test_every_ddpkit_run_flag_it_shows_is_taken():
    options = {s for action in run_parser()._actions for s in action.option_strings}
    prose = re.sub(r"```.*?```", "", _text(), flags=re.S)  # spans outside the code blocks
    spans = re.findall(r"`([^`]+)`", prose)
    run_spans = [s for s in spans if s.startswith("ddpkit run")]
    flags = {f for s in run_spans for f in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", s)}
    assert "--nproc_per_node" in {f for s in spans for f in re.findall(r"--[\w-]+", s)}
    assert flags and flags <= options, flags - options
    for text in ("--nproc_per_node", "--nproc-per-node", "--standalone", "--master_addr", "--rdzv_endpoint"):
        assert text in options


def test_before_and_after_line_counts_are_the_blocks_own():
    text = _text()
    section = text[text.index("### Before and after") :]
    before, after = re.findall(r"```python\n(.*?)```", section, re.S)[:2]
    counts = []
    for block in (before, after):
        lines = block.rstrip("\n").split("\n")
        counts.append((len(lines), sum(1 for line in lines if line.strip())))
    (b_all, b_code), (a_all, a_code) = counts
    said = re.search(
        r"Before: \*\*(\d+) lines\*\* \((\d+) not blank\).*?After: \*\*(\d+) lines\*\* \((\d+) not\s+blank\)",
        section,
        re.S,
    )
    assert said is not None
    assert tuple(int(g) for g in said.groups()) == (b_all, b_code, a_all, a_code)
    assert "DistributedSampler" in before and "DistributedSampler" not in after
    compile(before, "before", "exec")
    compile(after, "after", "exec")
