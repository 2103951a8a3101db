"""Checkpoints of sharded models: ``torch.distributed.checkpoint`` (DCP) in step directories.

Under ``strategy="fsdp"`` each rank writes its own shards; nothing is gathered on one rank. A
checkpoint is a directory ``ckpt-stepNNNNNNNN`` holding DCP's files, ``ddpkit.pt`` (loop state,
RNGs, scaler, the state entries that are not sharded) and ``manifest.json`` (every file's size
and SHA-256, the torch version, the world size). It is written under a temporary name and
renamed into place last, with the parent directory fsynced, so a save cut short leaves no
directory that looks complete. DCP reshards on load: a checkpoint of 2 processes loads on 3,
into an FSDP model or a DDP one.

Loading unpickles nothing beyond plain data: ``ddpkit.pt`` holds tensors and plain containers
and is read with ``weights_only=True``; DCP's ``.metadata`` and the non-tensor values in its
``.distcp`` files go through :mod:`ddpkit.checkpoint.dcp_reader`. A file that wants more is
refused in one line (:class:`ddpkit.errors.UnsafeCheckpoint`): checksums that match the manifest
say nothing about who wrote the checkpoint.

The step directory's name and the pruning of old steps are :mod:`ddpkit.checkpoint.steps`; the
single-file format (:mod:`ddpkit.checkpoint.pt`) is not imported here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch

from ddpkit._files import digest, fsync_dir, fsync_file, temp_path
from ddpkit._torch import unwrap
from ddpkit.checkpoint import background, steps
from ddpkit.checkpoint.safe import reason, safe_load
from ddpkit.distributed import collectives
from ddpkit.errors import DamagedCheckpoint, DdpkitError, UnsafeCheckpoint
from ddpkit.parallel.fsdp import is_sharded

MANIFEST = "manifest.json"
OWN = "ddpkit.pt"
FORMAT = "ddpkit-dcp"


def is_dcp(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded checkpoint: a directory with a manifest, or named as a step directory."""
    return (Path(path) / MANIFEST).is_file() or Path(path).is_dir() and bool(steps.STEP_DIR.match(Path(path).name))


def _entries(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """Split ``state`` into models and their optimizers (to DCP) and everything else."""
    models = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    optimizers: dict[str, tuple[Any, Any]] = {}
    for key, value in state.items():
        if isinstance(value, torch.optim.Optimizer):
            params = {id(p) for group in value.param_groups for p in group["params"]}
            owner = next((m for m in models.values() if params & {id(p) for p in m.parameters()}), None)
            if owner is not None:
                optimizers[key] = (owner, value)
    return models, optimizers


def sharded_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The DCP state dict of ``state``'s models and optimizers (sharded where the model is)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    models, optimizers = _entries(state)
    out: dict[str, Any] = {key: get_model_state_dict(unwrap(model)) for key, model in models.items()}
    for key, (model, optimizer) in optimizers.items():
        out[key] = get_optimizer_state_dict(unwrap(model), optimizer)
    return out


def plain_entries(state: Mapping[str, Any]) -> list[str]:
    """The keys of ``state`` that are neither models nor their optimizers: saved in ``ddpkit.pt``."""
    models, optimizers = _entries(state)
    return [key for key in state if key not in models and key not in optimizers]


def save(target: Path, state: Mapping[str, Any], own: Mapping[str, Any] | None, token: str) -> None:
    """Write a DCP checkpoint into ``target`` atomically (every rank calls it; ``own`` on rank 0).

    Args:
        target: the step directory to write; one already there is replaced.
        state: the user's objects by name; models and their optimizers go to DCP, sharded.
        own: what ``ddpkit.pt`` holds (loop state, RNGs, scaler, the plain entries), on rank 0; None elsewhere.
        token: the same on every rank: names the temporary directory ``.NAME.tmp-TOKEN`` written first.
    """
    import torch.distributed.checkpoint as dcp

    tmp = _begin(target, token)
    dcp.save(sharded_state(state), checkpoint_id=str(tmp))
    collectives.barrier()
    if collectives.rank() == 0:
        _seal(tmp, target, own)


def save_in_background(
    target: Path, state: Mapping[str, Any], own: Mapping[str, Any] | None, token: str
) -> tuple[Callable[[], None], int]:
    """:func:`save` with DCP's own ``async_save``: every rank returns once DCP has staged its
    shards in host memory; the writing is done by the returned function, which rank 0's ends by
    sealing the step directory (``ddpkit.pt``, the manifest, the rename).

    DCP's collectives in the background run on a gloo group of their own (:func:`_group`), never
    on the default group the training loop uses. Rank 0's future ends only once every rank's
    shards are written and DCP's metadata with them, so the seal needs no further meeting.

    Args:
        target: the step directory to write; one already there is replaced at the seal.
        state: the user's objects by name; models and their optimizers go to DCP, sharded.
        own: what ``ddpkit.pt`` holds, on rank 0 (a copy the loop no longer changes); None elsewhere.
        token: the same on every rank: names the temporary directory ``.NAME.tmp-TOKEN``.

    Returns:
        The function that finishes the write (for a background thread), and the bytes of the
        staged copy it holds until then.
    """
    import torch.distributed.checkpoint as dcp

    tmp = _begin(target, token)
    sharded = sharded_state(state)
    held = sum(_local(t).numel() * _local(t).element_size() for t in background.tensors(sharded))
    saving = dcp.async_save(sharded, checkpoint_id=str(tmp), process_group=_group())
    future: Any = getattr(saving, "upload_completion", saving)  # an AsyncSaveResponse where staging is async
    main = collectives.rank() == 0

    def finish() -> None:
        future.result()
        if main:
            _seal(tmp, target, own)

    return finish, held


_GROUP: list[Any] = []
"""The default group and the gloo group made for it."""


def _group() -> Any:
    """The gloo group DCP's background collectives run on (one per default group, made on first use:
    every rank makes it at the same save)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    if not _GROUP or _GROUP[0] is not world:  # a new default group (destroyed and made again)
        _GROUP[:] = [world, dist.new_group(backend="gloo")]
    return _GROUP[1]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor's local shard)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _begin(target: Path, token: str) -> Path:
    """The temporary step directory, made by rank 0 before any rank writes into it."""
    tmp = temp_path(target, token)
    if collectives.rank() == 0:
        tmp.mkdir(parents=True, exist_ok=True)
    collectives.barrier()
    return tmp


def _seal(tmp: Path, target: Path, own: Mapping[str, Any] | None) -> None:
    """Rank 0, once every rank's shards are in ``tmp``: ``ddpkit.pt``, the manifest of every file's
    size and SHA-256, fsyncs, and the rename of ``tmp`` to ``target`` (the checkpoint exists from here)."""
    with open(tmp / OWN, "wb") as handle:
        torch.save(dict(own or {}), handle)
    files = {}
    for path in sorted(tmp.iterdir()):
        fsync_file(path)
        sha, size = digest(path)
        files[path.name] = {"size": size, "sha256": sha}
    manifest = {
        "format": FORMAT,
        "torch": torch.__version__,
        "world_size": collectives.world_size(),
        "files": files,
    }
    with open(tmp / MANIFEST, "w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    fsync_dir(tmp)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    fsync_dir(target.parent)


def prune(directory: Path, keep: int, token: str) -> None:
    """Keep the newest ``keep`` checkpoints; remove what saves killed midway left (not ``token``'s)."""
    steps.prune(directory, keep)
    for path in directory.iterdir():
        if (
            path.is_dir()
            and path.name.startswith(".ckpt-step")
            and ".tmp-" in path.name
            and not path.name.endswith(token)
        ):
            shutil.rmtree(path, ignore_errors=True)


def verify(path: Path) -> dict[str, Any]:
    """The manifest of a complete, undamaged DCP checkpoint, or one clear :class:`DdpkitError`."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise DamagedCheckpoint(f"checkpoint {path} has no {MANIFEST}: it is not a complete ddpkit checkpoint")
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError:
        raise DamagedCheckpoint(f"checkpoint {path}: its {MANIFEST} is damaged") from None
    if manifest.get("format") != FORMAT:
        raise DamagedCheckpoint(f"checkpoint {path}: {MANIFEST} is not a ddpkit DCP manifest")
    if _major_minor(manifest.get("torch", "")) > _major_minor(torch.__version__):
        raise DdpkitError(
            f"checkpoint {path} was written by torch {manifest.get('torch')}, newer than this "
            f"torch {torch.__version__}; load it with torch {manifest.get('torch')} or newer"
        )
    for name, record in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise DamagedCheckpoint(f"checkpoint {path} is incomplete: {name} (in its manifest) is missing")
        sha, size = digest(file)
        if size != record["size"] or sha != record["sha256"]:
            raise DamagedCheckpoint(
                f"checkpoint {path} is damaged: {name} has {size} bytes and another checksum "
                f"than its manifest records ({record['size']} bytes)"
            )
    return manifest


def _major_minor(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def read_consolidated(path: Path, *, verified: bool = False) -> dict[str, Any]:
    """The whole checkpoint in one process, as :func:`ddpkit.checkpoint.read` returns a ``.pt``
    (``{"user": {...}, "ddpkit": {...}}``): for ``ddpkit predict`` and ``ddpkit export``, on request.

    Nothing in it is unpickled beyond plain data (:mod:`ddpkit.checkpoint.dcp_reader`).

    Raises:
        UnsafeCheckpoint: a file of the checkpoint wants something that could run code.
        DdpkitError: incomplete or damaged.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    from ddpkit.checkpoint import dcp_reader  # torch.distributed.checkpoint: a second to import

    if not verified:
        verify(path)
    own = load_own(path)
    try:
        full = dcp_reader.load_whole(path)
    except DdpkitError:
        raise
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise DamagedCheckpoint(f"checkpoint {path} cannot be read: {_cause(exc)}") from None
    user = dict(own.pop("user", {}))
    user.update(full)
    return {"format": FORMAT, "user": user, "ddpkit": own, "ddpkit_version": own.get("ddpkit_version")}


def load_own(path: Path) -> dict[str, Any]:
    """ddpkit's part of the checkpoint ``path`` (``ddpkit.pt``): tensors and plain containers only.

    Raises:
        UnsafeCheckpoint: the file wants something beyond plain data (it could run code).
        DdpkitError: the file is damaged.
    """
    file = path / OWN
    try:
        own = safe_load(file, file)
    except UnsafeCheckpoint:
        raise
    except Exception as exc:
        raise DamagedCheckpoint(f"checkpoint {file} cannot be read ({reason(exc)}); it is damaged") from None
    if not isinstance(own, dict):
        raise DamagedCheckpoint(f"checkpoint {file} does not hold ddpkit's state (it holds a {type(own).__name__})")
    return own


def load(path: Path, state: MutableMapping[str, Any]) -> None:
    """Load the models and optimizers of ``state`` from the DCP checkpoint ``path``, resharding.

    Nothing in it is unpickled beyond plain data (:mod:`ddpkit.checkpoint.dcp_reader`).
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from ddpkit.checkpoint import dcp_reader  # torch.distributed.checkpoint: a second to import

    template = sharded_state(state)
    try:
        dcp_reader.load(path, template)
    except DdpkitError:  # a refusal, or no readable .metadata
        raise
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise DdpkitError(f"checkpoint {path} does not fit this model: {_cause(exc)}") from None
    models, optimizers = _entries(state)
    for key, model in models.items():
        set_model_state_dict(unwrap(model), template[key])
    for key, (model, optimizer) in optimizers.items():
        set_optimizer_state_dict(unwrap(model), optimizer, template[key])


def _cause(exc: BaseException) -> str:
    """The innermost ``SomeError: message`` line of DCP's per-rank tracebacks."""
    found = [line.strip() for line in str(exc).splitlines() if re.match(r"^\s*\w+(Error|Exception): ", line)]
    return (
        found[-1] if found else f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    )


def load_plain_into_sharded(state: MutableMapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    """A ``.pt`` checkpoint of a replicated (DDP) run into sharded models; returns the keys it took."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    models, optimizers = _entries(state)
    full = StateDictOptions(full_state_dict=True)
    taken = []
    for key, model in models.items():
        if is_sharded(model) and key in saved:
            set_model_state_dict(model, saved[key], options=full)
            taken.append(key)
    for key, (model, optimizer) in optimizers.items():
        if is_sharded(model) and key in saved:
            set_optimizer_state_dict(model, optimizer, _by_name(model, optimizer, saved[key]), options=full)
            taken.append(key)
    return taken


def _by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()`` (parameters by position) keyed by parameter name, as DCP wants it."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved_ids = [i for group in saved["param_groups"] for i in group["params"]]
    if len(saved_ids) != len(order):
        raise DdpkitError(
            f"the checkpoint's optimizer holds {len(saved_ids)} parameters, this one "
            f"{len(order)}: build the optimizer over the same parameters"
        )
    name_of = dict(zip(saved_ids, order))
    state = {name_of[i]: value for i, value in saved["state"].items()}
    groups = [{**group, "params": [name_of[i] for i in group["params"]]} for group in saved["param_groups"]]
    return {"state": state, "param_groups": groups}
