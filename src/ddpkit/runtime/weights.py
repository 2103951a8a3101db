"""``rt.save(path, model)`` and ``rt.load(path, model)``: a model's weights alone, as people read them.

The file is what ``torch.save(model.state_dict(), path)`` writes (plain names, rank 0, atomic, a
``.sha256`` beside it), so ``model.load_state_dict(torch.load(path))`` reads it; :func:`load` reads
such a file, or the ``"model"`` entry of a ddpkit checkpoint (a file or a sharded directory).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ddpkit import checkpoint
from ddpkit.checkpoint import pt
from ddpkit.checkpoint.safe import safe_load
from ddpkit.checkpoint.state import restore_user_state
from ddpkit.distributed import collectives
from ddpkit.errors import DdpkitError, UsageError
from ddpkit.parallel.fsdp import is_sharded


def save(path: Path, weights: dict[str, torch.Tensor] | None, *, is_main: bool) -> Path:
    """Write ``weights`` (the model's full state dict, on rank 0) to the file ``path``; every rank calls it.

    Raises:
        UsageError: ``path`` is a directory.
        DdpkitError: rank 0 could not write (on every rank).
    """
    if path.is_dir():
        raise UsageError(
            f"rt.save({str(path)!r}, model) writes one file of weights; give a file name "
            "(a checkpoint directory takes a mapping: rt.save(path, {'model': model, ...}))"
        )
    error = None
    if is_main and weights is not None:
        try:
            pt.write(path, weights)
        except OSError as exc:
            error = f"rt.save: could not write {path} ({exc.strerror or exc})"
    error = collectives.broadcast_object(error)
    if error:
        raise DdpkitError(error)
    return path


def load(path: Path, model: torch.nn.Module) -> Path:
    """Load weights into ``model``: from a file of them, or a checkpoint's ``"model"`` entry.

    Raises:
        UsageError: no complete checkpoint there, or one without a ``"model"`` entry.
        DdpkitError: the weights are for another model, or the file is damaged.
    """
    if path.is_dir():
        found = checkpoint.latest(path) if not checkpoint.dcp.is_dcp(path) else path
        if found is None:
            raise UsageError(f"rt.load: no complete checkpoint in {path}")
        path = found
    if path.is_dir():
        saved = checkpoint.read(path)["user"]
    else:
        checkpoint.verify(path)
        saved = safe_load(path, path)
        saved = saved["user"] if isinstance(saved, dict) and saved.get("format") == pt.FORMAT else {"model": saved}
    if "model" not in saved:
        raise UsageError(
            f"rt.load({str(path)!r}, model): the checkpoint has no 'model' entry (it has "
            f"{', '.join(sorted(saved))}); load it with a mapping naming its entries"
        )
    if is_sharded(model):
        checkpoint.dcp.load_plain_into_sharded({"model": model}, {"model": saved["model"]})
    else:
        restore_user_state({"model": model}, {"model": saved["model"]}, str(path))
    return path


__all__ = ["load", "save"]
