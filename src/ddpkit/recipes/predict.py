"""``ddpkit predict``: predictions of a ``ddpkit train`` checkpoint, one row per input, in input order.

The parent process checks everything (:func:`prepare`) before any worker starts; each worker
(:func:`main`, started under ``ddpkit run -m ddpkit.recipes.predict``) predicts its contiguous
shard and rank 0 writes the file.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

import ddpkit
from ddpkit import checkpoint
from ddpkit._files import atomic_path
from ddpkit.errors import DdpkitError, UsageError
from ddpkit.recipes.datasets import DATASETS, SPLITS, load_dataset
from ddpkit.recipes.models import build_model

SUFFIXES = (".csv", ".npy", ".pt")


@dataclass
class PredictConfig:
    """One ``ddpkit predict`` run."""

    # Earlier names of flags that still work: old name -> field.
    ALIASES: ClassVar[dict[str, str]] = {"batch": "batch_size"}

    checkpoint: str
    """A checkpoint written by ddpkit train (a file, or a directory: its newest)."""
    out: str
    """Output file: .csv (index,prediction,prob_0..), .npy (probabilities) or .pt (tensors)."""
    data: str = "digits"
    """Data set to predict on: digits, mnist, cifar10 or synthetic."""
    data_dir: str | None = None
    """Directory with torchvision's files for mnist and cifar10 (nothing is downloaded)."""
    split: str = "test"
    """Which split of the data set: train or test."""
    nproc: int = 1
    """Processes on this machine."""
    batch_size: int = 256
    """Batch size per process."""
    overwrite: bool = False
    """Replace an existing output file."""


def prepare(config: PredictConfig) -> Path:
    """Validate paths, checkpoint, recipe and data; returns the checkpoint file to read.

    Raises:
        UsageError: anything wrong with what the user named (exit code 2).
    """
    try:
        return _prepare(config)
    except UsageError:
        raise
    except DdpkitError as exc:
        raise UsageError(str(exc)) from None


def _prepare(config: PredictConfig) -> Path:
    out = Path(config.out)
    if out.suffix not in SUFFIXES:
        raise UsageError(f"--out {out}: unknown suffix {out.suffix or '(none)'!r}; use .csv, .npy or .pt")
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: directory {out.parent} does not exist; create it first")
    refusal = f"--out {out} already exists; choose another file or pass --overwrite"
    checkpoint.check_output(out, overwrite=config.overwrite, refusal=refusal)
    if config.data not in DATASETS:
        raise UsageError(f"unknown data {config.data!r}; choose one of {', '.join(DATASETS)}")
    if config.split not in SPLITS:
        raise UsageError(f"--split {config.split!r}: use train or test")
    if config.nproc < 1 or config.batch_size < 1:
        raise UsageError("--nproc and --batch must be at least 1")
    source = Path(config.checkpoint)
    if not source.exists():
        raise UsageError(f"--checkpoint {source} does not exist")
    path = checkpoint.latest(source) if source.is_dir() else source
    if path is None:
        raise UsageError(f"--checkpoint {source}: no complete checkpoint in this directory")
    checkpoint.check_output(out, overwrite=config.overwrite, refusal=refusal, source=path)  # (a copy, renamed)
    payload = checkpoint.read(path)
    model, recipe = _model_from(payload, path)
    info = _dataset(config)
    given = (info.num_classes, info.in_channels, info.image_size)
    wanted = (recipe["num_classes"], recipe["in_channels"], recipe["image_size"])
    if given != wanted:
        raise DdpkitError(
            f"checkpoint {path} holds a {recipe['model']} for {wanted[1]}x{wanted[2]}x{wanted[2]} inputs and "
            f"{wanted[0]} classes, but --data {config.data} gives {given[1]}x{given[2]}x{given[2]} and {given[0]}"
        )
    checkpoint.check_model_state(model, payload["user"]["model"], f"checkpoint {path}")
    return path


def _model_from(payload: dict[str, Any], path: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    recipe = payload["user"].get("recipe")
    if not isinstance(recipe, dict) or "model" not in payload["user"]:
        raise DdpkitError(f"checkpoint {path} has no recipe: predict reads checkpoints written by ddpkit train")
    model = build_model(
        recipe["model"],
        num_classes=recipe["num_classes"],
        in_channels=recipe["in_channels"],
        image_size=recipe["image_size"],
    )
    return model, recipe


def _dataset(config: PredictConfig) -> Any:
    return load_dataset(config.data, config.split, config.data_dir)


def run_worker(config: PredictConfig, path: Path) -> None:
    """Predict in this process (one of the world); rank 0 writes ``config.out``."""
    payload = checkpoint.read(path)
    model, recipe = _model_from(payload, path)
    rt = ddpkit.init(precision=recipe.get("precision", "fp32"))  # the forward as it was trained
    model.load_state_dict(payload["user"]["model"])
    model = model.to(rt.device)
    logits = ddpkit.predict(
        model, _dataset(config).dataset, batch_size=config.batch_size, to="main", autocast=rt.autocast
    )
    if rt.is_main:
        write_predictions(Path(config.out), logits.float())
    rt.barrier()


def write_predictions(out: Path, logits: torch.Tensor) -> None:
    """Write one row per input, atomically, in the format the suffix names."""
    probabilities = torch.softmax(logits, dim=1)
    prediction = probabilities.argmax(dim=1)
    with atomic_path(out) as tmp:
        if out.suffix == ".csv":
            header = "index,prediction," + ",".join(f"prob_{c}" for c in range(probabilities.shape[1]))
            lines = [header] + [
                f"{i},{int(p)}," + ",".join(f"{v:.8g}" for v in row)
                for i, (p, row) in enumerate(zip(prediction.tolist(), probabilities.tolist()))
            ]
            tmp.write_text("\n".join(lines) + "\n")
        elif out.suffix == ".npy":
            import numpy as np

            with open(tmp, "wb") as handle:
                np.save(handle, probabilities.numpy())
        else:
            torch.save(
                {
                    "index": torch.arange(len(prediction)),
                    "prediction": prediction,
                    "probabilities": probabilities,
                    "logits": logits,
                },
                tmp,
            )


def main(argv: list[str] | None = None) -> int:
    """A worker of ``ddpkit predict`` (``--config-json J --checkpoint-file F``, as the command passes them)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 4 or argv[0] != "--config-json" or argv[2] != "--checkpoint-file":
        sys.stderr.write("usage: use 'ddpkit predict'\n")
        return 2
    try:
        run_worker(PredictConfig(**json.loads(argv[1])), Path(argv[3]))
    except DdpkitError as exc:
        sys.stderr.write(f"ddpkit predict: error: {exc}\n")
        return exc.exit_code
    return 0


def to_json(config: PredictConfig) -> str:
    """The settings as JSON, for the workers' ``--config-json``."""
    return json.dumps(asdict(config))


if __name__ == "__main__":
    sys.exit(main())
