"""``ddpkit train``: a built-in recipe in N processes; its flags are the fields of ``TrainConfig``.

Each field of :class:`~ddpkit.recipes.config.TrainConfig` is one flag (``--global-batch-size`` for
``global_batch_size``), its help the field's docstring; the flags' earlier names (``--global-batch``,
``--sync-bn``, ``--out``, ...) stay as aliases, from ``TrainConfig.ALIASES``. A flag that is not given stays out of the
namespace, so a ``--config`` file's value, then the dataclass default, applies.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ddpkit._argparse import Parser, add_fields
from ddpkit.cli.run import fault_tolerant_job
from ddpkit.distributed import ft_launch
from ddpkit.distributed.ft_launch import FaultTolerantSpec
from ddpkit.distributed.torchrun import RunSpec, run
from ddpkit.recipes.config import TrainConfig, read_config_file, validate
from ddpkit.recipes.train import clear_previous_run, preflight

RECIPE = "ddpkit.recipes.train"
"""The module each process (or replica) of ``ddpkit train`` runs."""

NOT_FLAGS = ("data_parallel", "extra")
"""TrainConfig fields with no flag: DataParallel is a row of ``ddpkit demo``, ``extra`` is for code."""


def parser() -> argparse.ArgumentParser:
    """The parser of ``ddpkit train``: one flag per TrainConfig field, and ``--config FILE``."""
    parser = Parser(
        prog="ddpkit train",
        argument_default=argparse.SUPPRESS,
        description="Train a built-in recipe in N processes; writes metrics, plots, "
        "checkpoints and summary.json into --out-dir.",
    )
    add_fields(parser, TrainConfig, skip=NOT_FLAGS, aliases=TrainConfig.ALIASES)
    parser.add_argument("--config", help="YAML or TOML file of these settings; flags override it")
    return parser


def train_config(argv: Sequence[str]) -> TrainConfig:
    """The validated TrainConfig of ``ddpkit train`` arguments (file settings, then flags)."""
    given = vars(parser().parse_args(argv))
    settings = read_config_file(given.pop("config")) if "config" in given else {}
    settings.update(given)
    config = TrainConfig(**settings)
    validate(config)
    return config


def cmd_train(argv: Sequence[str]) -> int:
    """``ddpkit train``: check the settings, clear an overwritten run, train; the job's exit code."""

    config = train_config(argv)
    replicas = fault_tolerant(config) if config.fault_tolerant else None  # checked before anything is read
    preflight(config)
    for path in clear_previous_run(config):
        kept = " (files of your own in it stay)" if path.is_dir() else ""
        print(f"ddpkit train: --overwrite removed {path}{kept}")
    if replicas is not None:
        code = ft_launch.run(replicas)
    else:
        code = run(
            RunSpec(
                RECIPE,
                ["--config-json", config.to_json()],
                module=True,
                nproc_per_node=config.nproc,
                max_restarts=config.max_restarts,
                nnodes=config.nnodes,
                node_rank=config.node_rank,
                master=config.master,
            )
        )
    if code == 0:
        print(f"ddpkit train: wrote {config.out_dir}/summary.json")
    return code


def fault_tolerant(config: TrainConfig) -> FaultTolerantSpec:
    """``--fault-tolerant``: the recipe as ``ddpkit run --fault-tolerant`` runs a script, ``--nproc``
    replicas of one process each on this node; checked before any data is read or output cleared."""
    spec = fault_tolerant_job(
        RECIPE,
        ["--config-json", config.to_json()],
        module=True,
        replicas=config.nproc,
        nnodes=config.nnodes,
        node_rank=config.node_rank,
        master=config.master,
        min_replicas=config.min_replicas,
        max_restarts=config.max_restarts,
        quorum_timeout=config.quorum_timeout,
        secret_file=config.secret_file,
    )
    ft_launch.validate(spec)
    return spec
