"""Predictions larger than memory: each rank streams its shard into a part file, rank 0 merges them into one ``.npy`` in dataset order."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ddpkit._files import atomic_path
from ddpkit._torch import unwrap
from ddpkit.distributed import collectives
from ddpkit.errors import UsageError
from ddpkit.loop import same_data
from ddpkit.loop.evaluate import _empty_output, _run_shard, rows_refused, unloaded
from ddpkit.parallel import lazy_buffers


def predict_to_file(
    model: torch.nn.Module,
    dataset: Any,
    path: str | os.PathLike,
    *,
    batch_size: int | None = None,
    num_workers: int = 0,
    target_key: str | None = None,
) -> Path | None:
    """Stream predictions larger than memory into one ``.npy`` file, in dataset order.

    Each rank appends its shard's outputs to its own part file as it goes; rank 0 then
    copies the parts, in rank order, into ``path`` chunk by chunk. Only a model returning a
    single tensor (or an output whose one tensor is its ``logits``, as Hugging Face's) is supported here.
    Returns the path on rank 0, None elsewhere.

    Args:
        model: the model as ``rt.setup`` returned it, or a plain one; it must return one tensor, or an
            output whose one tensor is its ``logits``.
        dataset: a map-style dataset (a stream goes to :func:`predict`); its samples' inputs as
            :func:`ddpkit.predict` takes them (a tuple's first item, a dict's items but its targets); a
            loader is read for its dataset, as :func:`ddpkit.predict` reads it.
        path: the ``.npy`` file rank 0 writes; the part files ``.NAME.rankN.part`` lie beside it meanwhile.
        batch_size: samples per forward on each rank (None: a given loader's, else 256).
        num_workers: DataLoader workers per rank (0: the main process reads).
        target_key: in dict samples, the key of the targets, which the model is not given; None:
            ``"labels"``, else ``"label"``.
    """
    import numpy as np
    from torch.utils.data import IterableDataset

    dataset, batch_size, num_workers, collate_fn = unloaded(
        dataset, "ddpkit.predict_to_file", batch_size, num_workers, None
    )
    if isinstance(dataset, IterableDataset):
        raise UsageError(
            "predict_to_file needs a map-style dataset; for a stream use ddpkit.predict, "
            "which returns the outputs in stream order"
        )
    same_data.check(dataset, "ddpkit.predict_to_file")
    path = Path(path)
    rank, world = collectives.rank(), collectives.world_size()
    part = path.with_name(f".{path.name}.rank{rank}.part")
    lazy_buffers.sync_buffers(model)
    module = unwrap(model)
    rows, tail, dtype = 0, None, None
    try:
        with open(part, "wb") as handle:
            shard = _run_shard(
                module,
                dataset,
                batch_size,
                num_workers,
                collate_fn=collate_fn,
                what="ddpkit.predict_to_file",
                given=model,
                target_key=target_key,
            )
            for out in shard:
                array = _one_tensor(out).numpy()
                rows, tail, dtype = rows + array.shape[0], array.shape[1:], array.dtype
                handle.write(np.ascontiguousarray(array).tobytes())
        if tail is None and rank == 0:  # (only rank 0 merges: another with no batch needs no shape)
            probe = _one_tensor(_empty_output(module, dataset, collate_fn, target_key)).numpy()
            tail, dtype = probe.shape[1:], probe.dtype
    except BaseException:  # a refused model or output, a failed forward: no part file left beside the output
        part.unlink(missing_ok=True)
        raise
    counts = collectives.all_gather_object(rows)  # also: every part file is complete
    if sum(counts) != len(dataset):  # (every rank alike)
        part.unlink(missing_ok=True)
        raise rows_refused("predict_to_file", sum(counts), len(dataset))
    if rank == 0:
        assert tail is not None  # rank 0 read a batch, or probed one sample
        _merge_parts(path, [path.with_name(f".{path.name}.rank{r}.part") for r in range(world)], counts, tail, dtype)
    collectives.barrier()
    part.unlink(missing_ok=True)
    return path if rank == 0 else None


def _one_tensor(out: Any) -> torch.Tensor:
    """The one tensor a model returned: itself, or an output's (a dict, or a dataclass such as Hugging
    Face's, as :func:`ddpkit.predict` maps them) that holds its ``logits`` and no other tensor."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping) and list(out) == ["logits"] and isinstance(out["logits"], torch.Tensor):
        return out["logits"]
    held = f" (it returned {sorted(map(str, out))})" if isinstance(out, Mapping) else ""
    raise UsageError(
        f"predict_to_file needs a model that returns one tensor, or an output whose one tensor is its "
        f"logits{held}; ddpkit.predict returns several"
    )


def _merge_parts(path: Path, parts: list[Path], counts: list[int], tail: tuple, dtype: Any) -> None:
    import numpy as np

    with atomic_path(path) as tmp:
        _copy_parts(
            np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(sum(counts), *tail)),
            parts,
            counts,
            tail,
            dtype,
        )


def _copy_parts(merged: Any, parts: list[Path], counts: list[int], tail: tuple, dtype: Any) -> None:
    """Copy each rank's rows into ``merged`` (a memory-mapped ``.npy``) in rank order, 64 MiB at a time."""
    import numpy as np

    row_bytes = int(np.prod(tail, dtype=np.int64)) * np.dtype(dtype).itemsize
    start = 0
    for part, count in zip(parts, counts):
        chunk_rows = max(1, (64 << 20) // max(1, row_bytes))
        with open(part, "rb") as handle:
            done = 0
            while done < count:
                take = min(chunk_rows, count - done)
                data = np.frombuffer(handle.read(take * row_bytes), dtype=dtype).reshape(take, *tail)
                merged[start + done : start + done + take] = data
                done += take
        start += count
    merged.flush()
    del merged


__all__ = ["predict_to_file"]
