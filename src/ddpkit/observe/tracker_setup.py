"""Choosing the trackers of a run and checking them before it starts: which names, whether each is installed and can start, and the configuration every tracker run records."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ddpkit._version import __version__
from ddpkit.errors import UsageError, one_line

NAMES = ("tensorboard", "wandb", "mlflow")
"""The trackers ``init(trackers=...)`` and ``ddpkit train --tracker`` take."""
DEFAULT = ("tensorboard",)
"""What ``init`` writes when ``trackers`` is not given (besides ``metrics.jsonl`` and ``.csv``)."""
REMOTE = ("wandb", "mlflow")
"""Trackers that receive a row once a checkpoint covers it (see the module's text)."""


_INSTALL = {
    "wandb": "pip install 'ddpkit[wandb]'",
    "mlflow": "pip install 'ddpkit[mlflow]'",
    "tensorboard": "pip install 'ddpkit[train]'",
}


def names(trackers: str | Sequence[str] | None) -> tuple[str, ...]:
    """The trackers of ``init(trackers=...)`` or ``--tracker a,b``, checked and without repeats.

    Raises:
        UsageError: a name that is not one of :data:`NAMES`.
    """
    if trackers is None:
        return DEFAULT
    items = [t.strip() for t in trackers.split(",")] if isinstance(trackers, str) else list(trackers)
    chosen: list[str] = []
    for item in items:
        if item == "" and isinstance(trackers, str):
            continue
        if item not in NAMES:
            raise UsageError(f"unknown tracker {item!r}; choose from {', '.join(NAMES)}")
        if item not in chosen:
            chosen.append(item)
    return tuple(chosen)


def mlflow_uri(out_dir: str | os.PathLike) -> str:
    """MLflow's tracking URI: ``MLFLOW_TRACKING_URI``, else a SQLite store ``out_dir/mlflow.db``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(out_dir).resolve() / 'mlflow.db'}"


def problem(chosen: Sequence[str], out_dir: str | os.PathLike | None) -> str | None:
    """Why one of ``chosen`` cannot start here, in one line; None when all can.

    Imports each library and, for MLflow, opens its store (creating a local one); for W&B online,
    looks for credentials without asking for them. Run on global rank 0 only.
    """
    if chosen and out_dir is None:
        return f"trackers {', '.join(chosen)} need ddpkit.init(out_dir=...) (their files go there)"
    for name in chosen:
        try:
            if name == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            elif name == "wandb":
                import wandb
            else:
                import mlflow  # noqa: F401
        except Exception as exc:  # ImportError, or a broken install of the library
            return f"tracker {name!r} is not installed ({one_line(str(exc), 80)}): {_INSTALL[name]}"
        if name == "wandb" and _wandb_online() and not wandb.login(prompt=False, verify=False):
            return (
                "tracker 'wandb' runs online but no W&B API key is set: run `wandb login`, "
                "set WANDB_API_KEY, or set WANDB_MODE=offline"
            )
        if name == "mlflow":
            assert out_dir is not None
            uri = mlflow_uri(out_dir)
            _quiet_mlflow()
            try:
                from mlflow.tracking import MlflowClient

                with _env(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="15"):
                    MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
            except Exception as exc:
                return (
                    f"tracker 'mlflow' cannot open tracking URI {uri!r} ({one_line(str(exc), 120)}); "
                    "set MLFLOW_TRACKING_URI to a store this machine can reach"
                )
    return None


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Set the variables the user did not set, for the block (a server that is down answers at once)."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _quiet_mlflow() -> None:
    """MLflow's local store announces every table it creates at INFO; keep its warnings only."""
    import logging

    for name in ("mlflow.store.db.utils", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _wandb_online() -> bool:
    return os.environ.get("WANDB_MODE", "online").lower() not in ("offline", "disabled", "dryrun")


def run_config(settings: Mapping[str, Any], config: Mapping[str, Any] | None, world_size: int) -> dict[str, Any]:
    """What a tracker records as the run's params: ``init``'s settings, ``config=``, the world size,
    ddpkit's and torch's versions and the git commit of the working directory, if any."""
    import torch

    found: dict[str, Any] = {f"ddpkit.{k}": v for k, v in settings.items() if k != "config"}
    found.update({"world_size": world_size, "ddpkit_version": __version__, "torch_version": torch.__version__})
    commit = _git_commit()
    if commit:
        found["git_commit"] = commit
    found.update(dict(config or {}))
    return found


def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


__all__ = ["DEFAULT", "NAMES", "REMOTE", "mlflow_uri", "names", "problem", "run_config"]
