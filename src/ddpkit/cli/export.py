"""``ddpkit export``: one checkpoint's model weights as a plain ``torch.save`` state dict."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ddpkit import checkpoint
from ddpkit._argparse import Parser
from ddpkit._files import atomic_path
from ddpkit.errors import UsageError


def parser() -> argparse.ArgumentParser:
    """The parser of ``ddpkit export``."""
    parser = Parser(
        prog="ddpkit export",
        description="Write a checkpoint's model weights (sharded or not) "
        "as one state dict with plain names, loadable with torch.load and model.load_state_dict.",
    )
    parser.add_argument(
        "--checkpoint", required=True, help="checkpoint (file, step directory, or a checkpoint directory: its newest)"
    )
    parser.add_argument("--out", required=True, help="FILE.pt to write")
    parser.add_argument("--key", default="model", help="the state entry to export (default model)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    return parser


def cmd_export(argv: Sequence[str]) -> int:
    """``ddpkit export``: find the checkpoint, write its ``--key`` entry to ``--out``; 0 when written."""
    import torch

    opts = parser().parse_args(argv)
    source, out = Path(opts.checkpoint), Path(opts.out)
    refusal = f"--out {out} exists; pass --overwrite to replace it"
    checkpoint.check_output(out, overwrite=opts.overwrite, refusal=refusal)
    if not source.exists():
        raise UsageError(f"--checkpoint {source} does not exist")
    path = source if source.is_file() or checkpoint.dcp.is_dcp(source) else checkpoint.latest(source)
    if path is None:
        raise UsageError(f"--checkpoint {source}: no complete checkpoint in this directory")
    checkpoint.check_output(out, overwrite=opts.overwrite, refusal=refusal, source=path)  # (a copy, renamed)
    user = checkpoint.read(path)["user"]
    if opts.key not in user:
        raise UsageError(f"checkpoint {path} has no entry {opts.key!r}; it has {', '.join(sorted(user))}")
    with atomic_path(out) as tmp:
        torch.save(user[opts.key], tmp)
    print(f"ddpkit export: wrote {out} ({opts.key} of {path})")
    return 0
