"""``ddpkit bench``: measure each mode in fresh processes, print the table, write the files.

The flags are :func:`ddpkit.bench.flags.parse_settings`'s; the work is :mod:`ddpkit.bench`'s.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from pathlib import Path

from ddpkit.bench import ckpt, ft
from ddpkit.bench.flags import parse_settings
from ddpkit.bench.flags import parser as bench_parser
from ddpkit.bench.outputs import write_outputs
from ddpkit.bench.run import run_bench


def parser() -> argparse.ArgumentParser:
    """The parser of ``ddpkit bench`` (:func:`ddpkit.bench.flags.parser`)."""
    return bench_parser()


def cmd_bench(argv: Sequence[str]) -> int:
    """``ddpkit bench``: run, print the table, write bench.json, bench.md and scaling.png."""

    settings = parse_settings(argv)
    for chosen, comparison in ((settings.checkpoints, ckpt), (settings.fault_tolerant, ft)):
        if chosen:  # a comparison of its own instead of the table
            found = comparison.run(settings)
            found["command"] = shlex.join(["ddpkit", "bench", *argv])
            print(comparison.table(found))
            print(f"bench: wrote {', '.join(str(p) for p in comparison.write(found, Path(settings.out)))}")
            return 0
    report = run_bench(settings)
    report["command"] = shlex.join(["ddpkit", "bench", *argv])
    paths = write_outputs(Path(settings.out), report)
    print(f"bench: wrote {', '.join(str(p) for p in paths)}")
    return 0
