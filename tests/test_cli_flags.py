"""The flags of ``ddpkit train`` and ``ddpkit predict`` are made from their config dataclasses.

Each flag's help is its field's docstring, written once (``ddpkit._argparse.add_fields``); the
flags themselves are the ones the hand-written parsers had (listed here as they were on main
before issue 26's step 7).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import pytest

from ddpkit import cli
from ddpkit._argparse import Parser, add_fields, field_docs
from ddpkit.cli.train import NOT_FLAGS
from ddpkit.errors import UsageError
from ddpkit.recipes.config import TrainConfig, check, validate
from ddpkit.recipes.predict import PredictConfig

TRAIN_FLAGS = {
    "--batch",
    "--checkpoint-every",
    "--config",
    "--cpu-offload",
    "--data",
    "--data-dir",
    "--epochs",
    "--eval-batch",
    "--global-batch",
    "--grad-compression",
    "--hang-timeout",
    "--keep-checkpoints",
    "--lr",
    "--master",
    "--max-restarts",
    "--model",
    "--momentum",
    "--nnodes",
    "--node-rank",
    "--nproc",
    "--out",
    "--overwrite",
    "--powersgd-rank",
    "--precision",
    "--resume",
    "--scale-lr",
    "--seed",
    "--strategy",
    "--sync-bn",
    "--no-sync-bn",
    "--synthetic-size",
    "--workers",
    "--sync",
    "--sync-every",
    "--outer-lr",
    "--outer-momentum",
    "--tracker",
    "--run-name",
    "--log-every",
    "--micro-shards",
}
NEW_TRAIN_FLAGS = {
    "--global-batch-size",
    "--batch-size",
    "--sync-batchnorm",
    "--no-sync-batchnorm",
    "--num-workers",
    "--out-dir",
    "--trackers",
    "--eval-batch-size",
}
"""The API's names (issue 42): the flags above stay as their aliases."""
PREDICT_FLAGS = {"--batch", "--checkpoint", "--data", "--data-dir", "--nproc", "--out", "--overwrite", "--split"}
FAULT_TOLERANT_FLAGS = {"--fault-tolerant", "--min-replicas", "--quorum-timeout", "--secret-file"}
"""ddpkit run --fault-tolerant's, which ddpkit train takes too."""
NEW_FLAGS = {"train": NEW_TRAIN_FLAGS | FAULT_TOLERANT_FLAGS, "predict": {"--batch-size"}}
SWITCHES = {"train": {"--cpu-offload", "--overwrite", "--scale-lr", "--fault-tolerant"}, "predict": {"--overwrite"}}
PAIRS = {
    "train": {"--sync-bn", "--no-sync-bn", "--sync-batchnorm", "--no-sync-batchnorm"},
    "predict": set(),
}  # bool | None: decided later when not given


def _help(command: str, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def _squashed(text: str) -> str:
    """``text`` without white space: argparse wraps help lines (at hyphens too)."""
    return "".join(text.split())


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        option: action
        for action in parser._actions
        for option in action.option_strings
        if option not in ("-h", "--help")
    }


@pytest.mark.parametrize("command, config, skip", [("train", TrainConfig, NOT_FLAGS), ("predict", PredictConfig, ())])
def test_every_field_docstring_is_the_help_of_its_flag(command, config, skip, capsys, monkeypatch):
    text = _help(command, capsys, monkeypatch)
    docs = field_docs(config)
    assert set(docs) == {f.name for f in dataclasses.fields(config)}, "every field has a docstring"
    for name, doc in docs.items():
        if name in skip:
            continue
        assert f"--{name.replace('_', '-')}" in text
        assert _squashed(doc) in _squashed(text), f"{config.__name__}.{name}: {doc!r} not in --help"


@pytest.mark.parametrize("command, before", [("train", TRAIN_FLAGS), ("predict", PREDICT_FLAGS)])
def test_the_flags_are_the_ones_before(command, before):
    flags = _flags(getattr(cli, command).parser())
    assert set(flags) == before | NEW_FLAGS[command]
    assert {flag for flag, action in flags.items() if isinstance(action, argparse._StoreTrueAction)} == SWITCHES[
        command
    ]
    assert {flag for flag, action in flags.items() if isinstance(action, argparse.BooleanOptionalAction)} == PAIRS[
        command
    ]


def test_sync_bn_is_decided_by_the_model_unless_given():
    parser = cli.train.parser()
    assert "sync_batchnorm" not in vars(parser.parse_args([]))
    for off, on in (("--no-sync-batchnorm", "--sync-batchnorm"), ("--no-sync-bn", "--sync-bn")):
        assert vars(parser.parse_args([off])) == {"sync_batchnorm": False}
        assert vars(parser.parse_args([on])) == {"sync_batchnorm": True}
    assert TrainConfig().sync_batchnorm is None


def test_train_flags_not_given_leave_the_config_and_its_file_alone():
    parser = cli.train.parser()
    assert vars(parser.parse_args([])) == {}
    assert vars(parser.parse_args(["--hang-timeout", "2.5", "--sync-bn", "--global-batch", "32"])) == {
        "hang_timeout": 2.5,
        "sync_batchnorm": True,
        "global_batch_size": 32,
    }


@pytest.mark.parametrize("old, new", sorted(TrainConfig.ALIASES.items()))
def test_an_earlier_flag_is_its_api_name_and_the_help_names_it_once(old, new, capsys, monkeypatch):
    parser = cli.train.parser()
    value = "1"
    flag, earlier = "--" + new.replace("_", "-"), "--" + old.replace("_", "-")
    action = _flags(parser)[flag]
    argv = [] if isinstance(action, argparse.BooleanOptionalAction) else [value]
    assert vars(parser.parse_args([earlier, *argv])) == vars(parser.parse_args([flag, *argv]))
    assert vars(parser.parse_args([flag, *argv])).keys() == {new}
    text = _help("train", capsys, monkeypatch)
    assert text.count(f"{earlier} ") == 0 and f"(also {earlier}" in _squashed(text).replace("(also", "(also ")


def test_a_config_file_takes_the_earlier_names_and_refuses_both(tmp_path):
    from ddpkit.recipes.config import read_config_file

    (tmp_path / "old.yaml").write_text("global-batch: 32\nsync_bn: false\nout: somewhere\nworkers: 2\n")
    assert read_config_file(str(tmp_path / "old.yaml")) == {
        "global_batch_size": 32,
        "sync_batchnorm": False,
        "out_dir": "somewhere",
        "num_workers": 2,
    }
    (tmp_path / "both.yaml").write_text("out: a\nout-dir: b\n")
    with pytest.raises(UsageError, match="out is the earlier name of out_dir; give one of them"):
        read_config_file(str(tmp_path / "both.yaml"))


def test_predict_flags_carry_their_defaults_and_require_the_rest():
    opts = cli.predict.parser().parse_args(["--checkpoint", "c.pt", "--out", "p.csv"])
    assert PredictConfig(**vars(opts)) == PredictConfig(checkpoint="c.pt", out="p.csv")
    with pytest.raises(UsageError, match="--out"):
        cli.predict.parser().parse_args(["--checkpoint", "c.pt"])


@dataclass
class _Example:
    name: str
    """A required
    name, on two lines."""
    rate: float | None = None
    """A rate of 5% or more."""
    count: int = 3
    """How many."""
    quiet: bool = False
    """Say less."""
    extra: dict = dataclasses.field(default_factory=dict)


def test_add_fields_types_defaults_switches_and_help():
    parser = Parser(prog="example")
    add_fields(parser, _Example, skip=("extra",))
    assert vars(parser.parse_args(["--name", "x", "--rate", "0.5", "--quiet"])) == {
        "name": "x",
        "rate": 0.5,
        "count": 3,
        "quiet": True,
    }
    text = " ".join(parser.format_help().split())
    assert "A required name, on two lines." in text and "A rate of 5% or more." in text
    assert "How many. (default 3)" in text
    with pytest.raises(UsageError, match="invalid int value"):
        parser.parse_args(["--name", "x", "--count", "many"])


def test_a_field_without_docstring_or_flag_type_is_refused():
    with pytest.raises(TypeError, match="extra has no docstring"):
        add_fields(Parser(prog="example"), _Example)

    @dataclass
    class Switched:
        loud: bool = True
        """On by default."""

    with pytest.raises(TypeError, match="default False"):
        add_fields(Parser(prog="example"), Switched)


def test_check_is_pure_and_validate_adds_the_probes(tmp_path):
    config = TrainConfig(data="mnist", data_dir=str(tmp_path / "missing"), out_dir=str(tmp_path / "run"))
    check(config)  # the settings alone are fine: nothing looks at the disk
    with pytest.raises(UsageError, match="is not a directory"):
        validate(config)
    with pytest.raises(UsageError, match="--nnodes must be at least 1"):
        check(TrainConfig(nnodes=0))
