"""BatchNorm statistics synced lazily: nothing but gradients on the wire per training step.

DDP broadcasts every buffer from rank 0 before each forward. A BatchNorm layer in training
mode never reads its running statistics (it normalises by the batch's), so for a model whose
only buffers are BatchNorm statistics that broadcast is pure cost. :func:`install` turns it off
and keeps each rank's statistics its own (rank 0's evolve exactly as under DDP's broadcast, so
parameters and rank 0's buffers stay bitwise equal to the hand-written loop's). They are
averaged across ranks, which uses every rank's batches rather than rank 0's alone, where they
are read or kept:

- a forward through the DDP model with any BatchNorm layer in eval mode (evaluation written
  by hand, a layer frozen during fine-tuning), as DDP's own first eval forward syncs buffers;
- ``ddpkit.evaluate``, ``ddpkit.predict`` and ``predict_to_file`` (every rank calls them);
- ``rt.save``: the checkpoint's model holds the averages, computed out of place so saving does
  not change the run, and each rank's own statistics go into ddpkit's part of the checkpoint
  so a resumed run continues bitwise.

Only layers trained since the last average are averaged, so equal statistics are never
touched. Models with any other buffer keep DDP's broadcast (their forward may read it).

A copy of the model (``copy.deepcopy`` of the best epoch's, ``AveragedModel``'s for SWA, an EMA
of ``model.module`` with its buffers) holds each rank's own statistics too, and gets a syncer of
its own layers: ``ddpkit.evaluate``/``predict``, an eval-mode forward through a copied DDP model
and ``rt.checkpoint`` average all of its statistics (an EMA writes them with no forward to mark),
in place, so every rank reads and saves the same copy.
"""

from __future__ import annotations

import contextlib
import copy
import math
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import SyncBatchNorm as _TorchSyncBatchNorm
from torch.nn.modules.batchnorm import _BatchNorm

from ddpkit._torch import unwrap, wrapped_ddp
from ddpkit.distributed import collectives
from ddpkit.observe.collectives import EVAL_FORWARD, counted_wait
from ddpkit.parallel.sync_batchnorm import SyncBatchNorm

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

_SYNCERS: weakref.WeakKeyDictionary[torch.nn.Module, LazyBuffers] = weakref.WeakKeyDictionary()
_BY_LAYER: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[LazyBuffers]] = weakref.WeakKeyDictionary()
"""Every tracked layer's syncer, a copy's layers included (how :func:`of` finds a copy's); held weakly,
as the syncer holds the layer: a copy thrown away (the best epoch's, replaced) is freed."""

_STATS = ("running_mean", "running_var")  # num_batches_tracked counts forwards: equal on every rank


def _key(name: str, stat: str) -> str:
    """A statistic's key in its model's state dict, from its layer's name."""
    return f"{name}.{stat}" if name else stat


def candidates(module: torch.nn.Module) -> list[tuple[str, _BatchNorm]] | None:
    """The BatchNorm layers (name, layer) when every buffer of ``module`` is one's statistics, else None.

    Synchronised BatchNorm (torch's or ddpkit's) keeps equal statistics already: its buffers
    count as others, so such a model keeps DDP's behaviour.
    """
    layers = [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, _BatchNorm)
        and m.track_running_stats
        and not isinstance(m, (SyncBatchNorm, _TorchSyncBatchNorm))
    ]
    owned = {id(b) for _, m in layers for b in m.buffers(recurse=False)}
    if not layers or any(id(b) not in owned for b in module.buffers()):
        return None
    return layers


class LazyBuffers:
    """Which BatchNorm layers of one model trained since their statistics were last averaged."""

    def __init__(self, layers: list[tuple[str, _BatchNorm]], *, copied: bool = False) -> None:
        self.layers = layers
        self.dirty: set[int] = set()
        self.copied = copied
        """A copy's (:meth:`__deepcopy__`): written where no forward marks it (an EMA of the buffers),
        so every layer counts as trained apart."""
        for _, layer in layers:
            _BY_LAYER[layer] = weakref.ref(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> LazyBuffers:
        """The syncer of a copy of the model: the copy's layers (``copy.deepcopy`` reaches this
        through their hooks, which :func:`install` makes objects rather than closures)."""
        copied = LazyBuffers.__new__(LazyBuffers)
        memo[id(self)] = copied  # the layers' hooks lead back here
        LazyBuffers.__init__(copied, [(name, copy.deepcopy(layer, memo)) for name, layer in self.layers], copied=True)
        return copied

    def mark(self, index: int, layer: _BatchNorm) -> None:
        """Record that layer ``index`` is about to train (a forward pre-hook; no collective)."""
        if layer.training:
            self.dirty.add(index)

    paused = False
    """Inside :func:`quiet`: the forwards average nothing (an evaluation, averaged once before)."""

    def before_forward(self) -> None:
        """Average first when a layer in eval mode may read statistics that ranks trained apart.

        Every rank sets the same modes, so every rank decides alike; whether a layer is dirty
        may differ (a forward through ``model.module`` on one rank), so :meth:`average` agrees
        on that first.
        """
        if self.paused:
            return
        if any(not layer.training for _, layer in self.layers):
            with counted_wait(EVAL_FORWARD):  # one call of every rank's, as the mismatch report names it
                self.average()

    def _dirty_stats(self) -> list[tuple[str, torch.Tensor]]:
        return [
            (_key(name, stat), getattr(layer, stat))
            for i, (name, layer) in enumerate(self.layers)
            if i in self.dirty
            for stat in _STATS
            if getattr(layer, stat) is not None
        ]

    def _mask(self) -> torch.Tensor:
        """1 for each layer dirty on this rank, else 0 (int32, on the host)."""
        mask = torch.zeros(len(self.layers), dtype=torch.int32)
        mask[sorted(self.dirty)] = 1
        return mask

    def agree(self) -> None:
        """Make the dirty set the union over ranks (a small collective), so all average alike."""
        mask = collectives.all_reduce(self._mask(), "max")  # on the backend's device (a copy may be on the CPU)
        self.dirty = {i for i, flag in enumerate(mask.tolist()) if flag}

    def averaged(self) -> dict[str, torch.Tensor]:
        """The cross-rank average of every dirty statistic, as new tensors (a collective per dtype).

        Call :meth:`agree` first: every rank must hold the same dirty set.
        """
        stats = self._dirty_stats()
        if not stats:
            return {}

        def summed(dtype: torch.dtype, flat: torch.Tensor) -> torch.Tensor:
            return collectives.all_reduce(flat)  # one allreduce per dtype, on the backend's device

        return _mean_by_dtype(stats, summed, dist.get_world_size())

    def average(self) -> None:
        """Replace every statistic dirty on any rank by its cross-rank average, in place (collectives)."""
        if self.copied:
            self.dirty = set(range(len(self.layers)))
        self.agree()
        values = self.averaged()
        with torch.no_grad():
            for key, tensor in self._dirty_stats():
                tensor.copy_(values[key])
        self.dirty.clear()

    def state_dict(self) -> dict[str, Any]:
        """This rank's own dirty statistics and which layers are dirty (for an exact resume)."""
        return {"dirty": sorted(self.dirty), "values": {k: t.detach().cpu().clone() for k, t in self._dirty_stats()}}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore this rank's own statistics and dirty layers from :meth:`state_dict`'s result."""
        self.dirty = set(saved["dirty"])
        with torch.no_grad():
            for key, tensor in self._dirty_stats():
                tensor.copy_(saved["values"][key])

    def captured(self) -> dict[str, Any]:
        """This rank's dirty layers and every statistic, copied to host memory; no collective.

        What :func:`saved` needs to make a checkpoint's part of this model later, on another
        thread, while training changes the statistics in place. The statistics travel as one flat
        tensor a dtype (forty small tensors take four times as long to serialise).
        """
        keys: list[list[tuple[str, str, list[int]]]] = []
        chunks: dict[str, list[torch.Tensor]] = {}
        for name, layer in self.layers:
            entry = []
            for stat in _STATS:
                tensor = getattr(layer, stat)
                if tensor is not None:
                    dtype = str(tensor.dtype).removeprefix("torch.")
                    entry.append((_key(name, stat), dtype, list(tensor.shape)))
                    chunks.setdefault(dtype, []).append(tensor.detach().reshape(-1))
            keys.append(entry)
        flat = {dtype: torch.cat(parts).to("cpu", copy=True) for dtype, parts in chunks.items()}
        return {"mask": self._mask(), "keys": keys, "flat": flat}


def _layers_of(capture: dict[str, Any]) -> list[list[tuple[str, torch.Tensor]]]:
    """A :meth:`LazyBuffers.captured` copy as (key, statistic) pairs, layer by layer (views of it)."""
    at = dict.fromkeys(capture["flat"], 0)
    layers = []
    for entry in capture["keys"]:
        pairs = []
        for key, dtype, shape in entry:
            numel = math.prod(shape)
            pairs.append((key, capture["flat"][dtype][at[dtype] : at[dtype] + numel].view(shape)))
            at[dtype] += numel
        layers.append(pairs)
    return layers


def saved(ranks: list[list[Any]]) -> tuple[list[list[Any]], list[dict[str, torch.Tensor]]]:
    """A checkpoint's part of each model from every rank's :meth:`LazyBuffers.captured` copies
    (``ranks[r][i]``: rank ``r``'s of model ``i``; None for a model without lazily averaged
    statistics), with no collective: each rank's own statistics of every layer dirty on any rank
    (for an exact resume: what :meth:`LazyBuffers.state_dict` holds after :meth:`LazyBuffers.agree`)
    and their cross-rank averages (the checkpoint's model), summed in rank order. Two ranks' sum
    is the allreduce's to the bit; more ranks' may differ from it in the last place.
    """
    world = len(ranks)
    models = len(ranks[0])
    own: list[list[Any]] = [[None] * models for _ in range(world)]
    averages: list[dict[str, torch.Tensor]] = [{} for _ in range(models)]
    for i in range(models):
        if ranks[0][i] is None:
            continue
        mask = torch.stack([r[i]["mask"] for r in ranks]).amax(dim=0)
        dirty = [j for j, flag in enumerate(mask.tolist()) if flag]
        stats = [[pair for j in dirty for pair in layers[j]] for layers in (_layers_of(r[i]) for r in ranks)]
        for rank, pairs in enumerate(stats):
            own[rank][i] = {"dirty": dirty, "values": {k: t.clone() for k, t in pairs}}

        def summed(dtype: torch.dtype, flat: torch.Tensor, stats: list[Any] = stats) -> torch.Tensor:
            for pairs in stats[1:]:  # rank 0's flat, plus each other rank's in rank order
                flat.add_(torch.cat([t.reshape(-1) for _, t in pairs if t.dtype == dtype]))
            return flat

        averages[i] = _mean_by_dtype(stats[0], summed, world)
    return own, averages


def _mean_by_dtype(
    stats: list[tuple[str, torch.Tensor]], summed: Callable[[torch.dtype, torch.Tensor], torch.Tensor], world: int
) -> dict[str, torch.Tensor]:
    """The cross-rank mean of each of this rank's ``(key, statistic)`` pairs, as new tensors: one flat
    tensor a dtype, which ``summed(dtype, flat)`` makes the sum over ranks of (in place or new)."""
    found: dict[str, torch.Tensor] = {}
    for dtype in dict.fromkeys(t.dtype for _, t in stats):
        group = [(k, t) for k, t in stats if t.dtype == dtype]
        flat = summed(dtype, torch.cat([t.detach().reshape(-1) for _, t in group]))
        flat.div_(world)
        offset = 0
        for key, tensor in group:
            found[key] = flat[offset : offset + tensor.numel()].view_as(tensor).clone()
            offset += tensor.numel()
    return found


def broadcast_from_rank0(module: torch.nn.Module) -> None:
    """Copy every buffer from rank 0 (what DDP's construction does when buffer syncing is on)."""
    for buffer in module.buffers():
        dist.broadcast(buffer, 0)


class _Mark:
    """A tracked layer's forward pre-hook: it notes that the layer trains (never a collective)."""

    def __init__(self, syncer: LazyBuffers, index: int) -> None:
        self.syncer, self.index = syncer, index

    def __call__(self, module: _BatchNorm, args: Any) -> None:
        self.syncer.mark(self.index, module)


class _BeforeForward:
    """The DDP model's forward pre-hook: :meth:`LazyBuffers.before_forward`."""

    def __init__(self, syncer: LazyBuffers) -> None:
        self.syncer = syncer

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        self.syncer.before_forward()


_BROADCASTING: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[DistributedDataParallel]] = (
    weakref.WeakKeyDictionary()
)
"""The DDP model around each module whose buffers DDP broadcasts (:func:`broadcasts`), by that module
(held weakly: the DDP model holds the module)."""


def broadcasts(ddp_model: DistributedDataParallel) -> None:
    """Note that ``ddp_model`` keeps DDP's broadcast of its buffers, so that :func:`sync_buffers` of
    its ``module`` (an evaluation of ``model.module``) takes rank 0's too."""
    _BROADCASTING[ddp_model.module] = weakref.ref(ddp_model)


def install(ddp_model: DistributedDataParallel, layers: list[tuple[str, _BatchNorm]]) -> LazyBuffers:
    """Track ``layers`` of the DDP model (built with buffer broadcasting off).

    The hooks are objects that hold the syncer, so a copy of the model copies them with a syncer
    of the copy's layers (:meth:`LazyBuffers.__deepcopy__`); closures would tie the copy to these.
    """
    syncer = LazyBuffers(layers)
    for index, (_, layer) in enumerate(layers):
        # marks every forward, also one through model.module; never a collective here
        layer.register_forward_pre_hook(_Mark(syncer, index))
    ddp_model.register_forward_pre_hook(_BeforeForward(syncer))
    _SYNCERS[ddp_model.module] = syncer
    return syncer


def of(model: Any, *, copies: bool = True) -> LazyBuffers | None:
    """The syncer of ``model`` (DDP, compiled or plain), or None; ``copies``: also of the copy it is or
    holds, or of the set-up model it is part of (found through its layers)."""
    inner = unwrap(model)
    if not isinstance(inner, torch.nn.Module):
        return None
    found = _SYNCERS.get(inner)
    if found is not None or not copies:
        return found
    return next((found for m in inner.modules() if (found := _layer_syncer(m)) is not None), None)


def _layer_syncer(module: torch.nn.Module) -> LazyBuffers | None:
    held = _BY_LAYER.get(module)
    return None if held is None else held()


def average_copies(state: Any) -> None:
    """Average the statistics of each copy of a model among ``state``'s values (``rt.checkpoint``'s
    state, on every rank): in place, so every rank saves, and a resumed run loads, the same."""
    for value in state.values():
        syncer = of(value) if isinstance(value, torch.nn.Module) else None
        if syncer is not None and syncer.copied:
            syncer.average()


@contextlib.contextmanager
def quiet(model: Any) -> Iterator[None]:
    """The block's forwards of ``model`` (or of a copy of it) average no statistics, so none runs a
    collective: an evaluation, whose eval mode trains nothing, after :func:`sync_buffers` averaged
    them once. Its ranks may then forward different numbers of batches."""
    syncer = of(model)
    if syncer is None:
        yield
        return
    was, syncer.paused = syncer.paused, True
    try:
        yield
    finally:
        syncer.paused = was


def sync_buffers(model: Any) -> None:
    """Average ``model``'s BatchNorm statistics across ranks where they were trained apart.

    ``ddpkit.sync_buffers(model)``: call it on every rank before an evaluation of your own that
    runs ``model.module`` (``ddpkit.evaluate``/``predict`` and an eval-mode forward through
    the DDP model do it already). A DDP model that keeps torch's broadcast of its buffers (other
    buffers than BatchNorm's, a compiled model) takes rank 0's, as its next forward would. A
    no-op for models whose statistics are not synced lazily.
    """
    if not dist.is_initialized():
        return
    syncer = of(model)
    if syncer is not None:
        syncer.average()
        return
    held = _BROADCASTING.get(unwrap(model))
    ddp = wrapped_ddp(model) or (held() if held is not None else None)  # the DDP model, or the module it holds
    if ddp is not None and ddp.broadcast_buffers:  # what its next forward does first: take rank 0's buffers
        for buffer in ddp.module.buffers():
            dist.broadcast(buffer, dist.get_global_rank(ddp.process_group, 0), group=ddp.process_group)
