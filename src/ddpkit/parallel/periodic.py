"""Infrequent synchronisation: each rank trains on its own, and every H steps the ranks meet.

For links too slow to exchange gradients every step (10 Mbit/s between hosts, cross-region links),
``rt.setup(model, optimizer, sync=..., sync_every=H)`` trains without DDP's per-step allreduce:

- ``sync="local-sgd"``: every ``H`` optimizer steps the ranks average their weights (what
  Accelerate's ``LocalSGD`` and torch's ``PeriodicModelAverager`` do).
- ``sync="diloco"`` (Douillard et al., 2023, "DiLoCo"): each rank's optimizer is the inner one;
  every ``H`` steps the ranks average the change since the last sync, ``synced - local``, and an
  outer Nesterov SGD step (``outer_lr``, ``outer_momentum``) applies it to the synced weights, from
  which every rank continues. With ``outer_lr=1`` and no momentum it is local SGD.

BatchNorm statistics are averaged at each sync. :func:`synced_weights` puts the synced weights in
place for evaluation and prediction (``ddpkit.evaluate``/``predict`` use it), and a checkpoint's
model entry holds them (:func:`exported`), so what is evaluated, exported or predicted is never
one rank's local weights. Each rank's local weights, its inner optimizer's state and where the
period stands are per-rank state (:meth:`PeriodicSync.state_dict`), so a run stopped mid-period
resumes bitwise on the same world size; on another one it continues from the synced weights.

The exchange is one allreduce of each rank's change since the last sync, every parameter and
floating buffer flattened: in bfloat16 by default (half the bytes; the changes, not the weights,
are rounded to 8 bits of mantissa), or ``sync_dtype="fp32"``.

Results depend on the world size under infrequent sync (each rank's inner steps see only its own
share of each global batch); the run says so once.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ddpkit.errors import UsageError, warn

SYNCS = ("every-step", "local-sgd", "diloco")
"""``rt.setup``'s ``sync`` values: DDP's allreduce every step, or one of the two infrequent ones."""
_DTYPES = {None: torch.bfloat16, "fp32": torch.float32, "bf16": torch.bfloat16}
"""The exchange's dtype; the default (None) is bfloat16: half the bytes, and on tiny-lm DiLoCo's
validation loss moved by 0.1% (BENCHMARKS.md)."""


def check(sync: str, *, every: int | None, sync_dtype: str | None, strategy: str, grad_compression: str | None,
          sync_batchnorm: bool, precision: str) -> None:
    """Refuse, in one line, an infrequent sync that cannot work as asked.

    Args:
        sync: ``"every-step"``, ``"local-sgd"`` or ``"diloco"``.
        every: ``sync_every``, the optimizer steps between syncs.
        sync_dtype: the exchange's dtype (None or ``"fp32"``; ``"bf16"``).
        strategy: ``rt.setup``'s strategy: fsdp shards what each rank would train alone.
        grad_compression: per-step gradient compression: there is no per-step exchange to compress.
        sync_batchnorm: statistics synchronised every forward defeat training apart.
        precision: fp16's loss scaler would differ per rank between syncs.

    Raises:
        UsageError: an unknown value, a missing or bad ``sync_every``, or a refused combination.
    """
    if sync not in SYNCS:
        raise UsageError(f"unknown sync {sync!r}; choose {', '.join(repr(s) for s in SYNCS)}")
    if sync == "every-step":
        if every is not None or sync_dtype is not None:
            raise UsageError("sync_every and sync_dtype set how often and in what an infrequent sync exchanges; "
                             "give sync='diloco' or 'local-sgd'")
        return
    if every is None or isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise UsageError(f"sync={sync!r} needs sync_every=H, a whole number of optimizer steps of at least 1 "
                         f"between syncs, got {every!r}")
    if sync_dtype not in _DTYPES:
        raise UsageError(f"sync_dtype={sync_dtype!r}: choose 'fp32' or 'bf16'")
    refused = {
        "fsdp": strategy == "fsdp" and "strategy='fsdp' shards the model each rank would train on its own",
        "compression": grad_compression is not None and f"grad_compression={grad_compression!r} compresses a "
                       "per-step gradient exchange, which infrequent sync does not make",
        "syncbn": sync_batchnorm and "sync_batchnorm=True synchronises every forward; BatchNorm statistics "
                  "are averaged at each sync instead",
        "fp16": precision == "fp16" and "precision='fp16' scales each rank's loss on its own between syncs; "
                "use bf16 or fp32",
    }
    for reason in refused.values():
        if reason:
            raise UsageError(f"sync={sync!r}: {reason}")


class PeriodicSync:
    """One model's infrequent sync: the synced weights, the outer optimizer, the period's position.

    Kept in the run's per-model communication slot (beside gradient compressors), so checkpoints
    gather its per-rank :meth:`state_dict` and hand it back with :meth:`load_state_dict`.

    Args:
        model: the model as each rank trains it (on its device, not DDP-wrapped).
        optimizer: its inner optimizer, whose per-rank state a checkpoint keeps.
        kind: ``"local-sgd"`` or ``"diloco"``.
        every: optimizer steps between syncs.
        outer_lr: DiLoCo's outer learning rate.
        outer_momentum: DiLoCo's outer Nesterov momentum (0: plain SGD).
        sync_dtype: the exchange's dtype, ``"bf16"`` (None: the default) or ``"fp32"``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any, *, kind: str, every: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, sync_dtype: str | None = None) -> None:
        self.name = kind
        self.model = model
        self.optimizer = optimizer
        self.every = every
        self.dtype = _DTYPES[sync_dtype]
        self.steps = 0                       # optimizer steps since the last sync
        self.syncs = 0                       # syncs made
        self.sent_bytes = 0                  # bytes handed to allreduce by syncs, in all
        self.sync_seconds = 0.0              # seconds spent in syncs, in all
        self.params = [p for p in model.parameters()]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.synced = [p.detach().clone() for p in self.params]
        self.synced_buffers = [b.detach().clone() for b in self.buffers]
        self.outer = None
        if kind == "diloco":
            self.outer = torch.optim.SGD(self.synced, lr=outer_lr, momentum=outer_momentum,
                                         nesterov=outer_momentum > 0)
        model.__dict__["_ddpkit_periodic"] = self

    # -- training --------------------------------------------------------------------------
    def after_step(self) -> None:
        """Count an optimizer step; sync when ``every`` of them have passed since the last."""
        self.steps += 1
        if self.steps >= self.every:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Meet the other ranks: average (local SGD) or take an outer step (DiLoCo); every rank continues from it."""
        started = time.perf_counter()
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        # What travels is each rank's change since the last sync, synced - local: small numbers, so
        # bfloat16 rounds them, never the weights themselves.
        moved = self._average([s - p for s, p in zip(self.synced, self.params)]
                              + [s - b for s, b in zip(self.synced_buffers, self.buffers)], world)
        deltas, stats = moved[:len(self.params)], moved[len(self.params):]
        if self.outer is not None:        # DiLoCo: the average change is the outer step's gradient
            for synced, gradient in zip(self.synced, deltas):
                synced.grad = gradient
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
        else:                             # local SGD: the weights' average, synced - average change
            for synced, delta in zip(self.synced, deltas):
                synced.sub_(delta)
        for synced, delta in zip(self.synced_buffers, stats):     # BatchNorm statistics: their average
            synced.sub_(delta)
        _copy(self.params, self.synced)
        _copy(self.buffers, self.synced_buffers)
        self.steps = 0
        self.syncs += 1
        self.sync_seconds += time.perf_counter() - started

    def _average(self, tensors: list[torch.Tensor], world: int) -> list[torch.Tensor]:
        """The mean over ranks of each tensor: one allreduce of all of them, in ``self.dtype``."""
        flat = torch.cat([t.reshape(-1).to(self.dtype) for t in tensors])
        self.sent_bytes += flat.numel() * flat.element_size()
        if world > 1:
            dist.all_reduce(flat)
        flat = flat.to(tensors[0].dtype if tensors else torch.float32) / world
        out, at = [], 0
        for t in tensors:
            out.append(flat[at:at + t.numel()].view_as(t).to(t.dtype))
            at += t.numel()
        return out

    # -- the synced weights --------------------------------------------------------------------
    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The synced weights and statistics in the model for the block; the local ones after."""
        with torch.no_grad():
            local = [p.detach().clone() for p in self.params]
            local_buffers = [b.detach().clone() for b in self.buffers]
            _copy(self.params, self.synced)
            _copy(self.buffers, self.synced_buffers)
        try:
            yield
        finally:
            with torch.no_grad():
                _copy(self.params, local)
                _copy(self.buffers, local_buffers)

    def exported(self, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``saved`` (the model's state dict) with the synced weights and statistics in it."""
        names = {id(t): n for n, t in self.model.state_dict(keep_vars=True).items()}
        synced = {names[id(p)]: s for p, s in zip(self.params, self.synced) if id(p) in names}
        synced.update({names[id(b)]: s for b, s in zip(self.buffers, self.synced_buffers) if id(b) in names})
        out = type(saved)({k: synced[k].detach().cpu().clone() if k in synced else v for k, v in saved.items()})
        if hasattr(saved, "_metadata"):
            out._metadata = saved._metadata
        return out

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state, plain tensors: local weights, inner optimizer, synced weights, outer optimizer."""
        return {"name": self.name, "every": self.every, "steps": self.steps, "syncs": self.syncs,
                "sent_bytes": self.sent_bytes,
                "local": [p.detach().cpu().clone() for p in self.params],
                "local_buffers": [b.detach().cpu().clone() for b in self.buffers],
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                "synced": [s.detach().cpu().clone() for s in self.synced],
                "synced_buffers": [s.detach().cpu().clone() for s in self.synced_buffers],
                "outer": None if self.outer is None else self.outer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, saved: dict[str, Any], *, same_world: bool, source: str) -> None:
        """Resume: this rank's own state on the same world size; else the synced weights, with a warning."""
        if saved.get("name") != self.name:
            warn(f"checkpoint {source} was trained with "
                 f"{'sync=' + repr(saved['name']) if saved.get('name') else 'a sync every step'} and resumes "
                 f"with sync={self.name!r}: the period starts at the loaded weights")
            self.synced = [p.detach().clone() for p in self.params]
            self.synced_buffers = [b.detach().clone() for b in self.buffers]
            if self.outer is not None:
                self.outer.param_groups[0]["params"] = self.synced
                self.outer.state.clear()
            return
        if len(saved["synced"]) != len(self.params):
            raise UsageError(f"checkpoint {source} holds the synced weights of {len(saved['synced'])} tensors; "
                             f"this model has {len(self.params)}")
        _copy(self.synced, saved["synced"])
        _copy(self.synced_buffers, saved["synced_buffers"])
        if self.outer is not None and saved.get("outer") is not None:
            self.outer.load_state_dict(saved["outer"])
        self.syncs, self.sent_bytes = int(saved["syncs"]), int(saved.get("sent_bytes", 0))
        if same_world:
            _copy(self.params, saved["local"])
            _copy(self.buffers, saved["local_buffers"])
            if self.optimizer is not None and saved.get("optimizer") is not None:
                self.optimizer.load_state_dict(saved["optimizer"])
            self.steps = int(saved["steps"])
            return
        warn(f"checkpoint {source} was saved {saved['steps']} step(s) into a sync period on another world size: "
             "every rank continues from the synced weights, and the period starts over")
        _copy(self.params, self.synced)
        _copy(self.buffers, self.synced_buffers)
        self.steps = 0


def _copy(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """``target.copy_(value)`` for each pair: the tensors keep their identity (optimizers hold them)."""
    for target, value in zip(targets, values):
        target.copy_(value)


def of(model: Any) -> PeriodicSync | None:
    """The :class:`PeriodicSync` of a set-up model (wrapped or compiled), or None."""
    from ddpkit._torch import unwrap

    for candidate in (model, unwrap(model)):
        found = getattr(candidate, "__dict__", {}).get("_ddpkit_periodic")
        if found is not None:
            return found
    return None


@contextlib.contextmanager
def synced_weights(model: Any) -> Iterator[None]:
    """The synced weights in ``model`` for the block where it syncs infrequently; else nothing changes."""
    found = of(model)
    if found is None:
        yield
        return
    with found.swapped_in():
        yield


def exported(model: Any, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of ``model``: its synced weights where it syncs infrequently, else ``saved``."""
    found = of(model)
    return saved if found is None else found.exported(saved)


def announce(kind: str, every: int, is_main: bool) -> None:
    """Say once that the run's result now depends on the world size."""
    if is_main:
        warn(f"sync={kind!r} (every {every} steps): each rank takes its inner steps on its own share of the "
             "global batch, so the result depends on the number of processes; evaluate, predict and "
             "checkpoints use the synced weights")
