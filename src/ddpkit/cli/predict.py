"""``ddpkit predict``: a train checkpoint's predictions; its flags are the fields of ``PredictConfig``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ddpkit._argparse import Parser, add_fields
from ddpkit.distributed.torchrun import RunSpec, run
from ddpkit.recipes.predict import PredictConfig, prepare, to_json


def parser() -> argparse.ArgumentParser:
    """The parser of ``ddpkit predict``: one flag per PredictConfig field (``--checkpoint``, ``--out`` required)."""
    parser = Parser(
        prog="ddpkit predict", description="Predict with a ddpkit train checkpoint; one row per input, in input order."
    )
    add_fields(parser, PredictConfig, aliases=PredictConfig.ALIASES)
    return parser


def cmd_predict(argv: Sequence[str]) -> int:
    """``ddpkit predict``: check everything, then predict in N processes; the job's exit code."""

    config = PredictConfig(**vars(parser().parse_args(argv)))
    path = prepare(config)
    spec = RunSpec(
        "ddpkit.recipes.predict",
        ["--config-json", to_json(config), "--checkpoint-file", str(path)],
        module=True,
        nproc_per_node=config.nproc,
    )
    code = run(spec)
    if code == 0:
        print(f"ddpkit predict: wrote {config.out}")
    return code
