"""Mixed precision as one object: autocast, loss scaling, the optimizer step and its state.

A training loop written against :class:`Precision` is the same for fp32, bf16 and fp16;
only the name changes::

    precision = Precision("fp16", rt.device)
    with precision.autocast():
        loss = loss_fn(model(x), y)
    precision.backward(loss)
    stepped = precision.step(optimizer)      # False when fp16 skipped an overflowing step

Notes for torch 2.13 on CPU (checked, not assumed):
    * ``torch.autocast("cpu", dtype=torch.float16)`` and ``torch.amp.GradScaler("cpu")``
      both work, so fp16 needs no special code on CPU.
    * ``GradScaler.step`` returns ``None`` both when it steps (for optimizers whose
      ``step`` returns ``None``) and when it skips, so :meth:`Precision.step` asks the
      scaler's per-optimizer record (:func:`ddpkit._torch.scaler_found_inf`).
    * Several optimizers in one step share one ``GradScaler.update()``: it is deferred to the
      next backward (or to :meth:`state_dict`), so ``step(a); step(b)`` counts as one step.
    * The default initial scale, 2**16, is above the largest fp16 value (65504), so the
      first fp16 step or few are usually skipped while the scale backs off. That is normal.
    * CPU autocast keeps fewer ops in fp32 than CUDA autocast (``softmax`` for instance
      returns bf16/fp16 on CPU); losses such as ``cross_entropy`` still run in fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch

from ddpkit._torch import scaler_found_inf, scaler_unscaled
from ddpkit.errors import DdpkitError, UsageError, warn

__all__ = ["PRECISIONS", "Precision"]


def _autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` here (torch < 2.4 has a function per device)."""
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except TypeError:  # torch < 2.4: no device argument
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


PRECISIONS = ("fp32", "bf16", "fp16")
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Owns autocast, the fp16 GradScaler and the optimizer step for one training run.

    Args:
        name: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        device: where the model runs; picks the autocast and GradScaler device type.

    Raises:
        UsageError: ``name`` is not one of :data:`PRECISIONS`.
    """

    def __init__(self, name: str, device: torch.device | str) -> None:
        if name not in PRECISIONS:
            raise UsageError(f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}")
        self.name = name
        self.device = torch.device(device)
        self.scaler: torch.amp.GradScaler | None = torch.amp.GradScaler(self.device.type) if name == "fp16" else None
        self._update_due = False  # an optimizer stepped since the scaler last updated
        self.sharded = False
        """Whether the loss scaler is torch's ``ShardedGradScaler`` (:meth:`shard`)."""

    @property
    def dtype(self) -> torch.dtype:
        """The dtype autocast computes in (``float32`` for fp32)."""
        return _AUTOCAST_DTYPES.get(self.name, torch.float32)

    def autocast(self) -> ContextManager[Any]:
        """A context for the forward pass and loss; does nothing for fp32."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def watch_forward(self, model: torch.nn.Module, *, warns: bool) -> None:
        """Say once (``warns``: rank 0) when ``model``'s first training forward runs outside :meth:`autocast`.

        ``ddpkit.init(precision="bf16")`` casts what runs inside ``with rt.autocast():``; a loop without
        it trained in fp32, silently. A sharded model computes in the precision's dtype by itself (its
        mixed-precision policy), and fp32 has nothing to cast: neither is watched.
        """
        if self.name == "fp32" or self.sharded:
            return
        handles: list[Any] = []

        def first_forward(module: torch.nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled():  # an evaluation: not the training forward
                return
            for handle in handles:
                handle.remove()
            if warns and not _autocast_enabled(self.device.type):
                warn(
                    f"precision={self.name!r} casts what runs inside `with rt.autocast():`, and this training "
                    f"forward ran outside it, in fp32; put the forward and the loss inside it",
                    past_torch=True,
                )

        handles.append(model.register_forward_pre_hook(first_forward))

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss``, scaled for fp16 so small gradients do not flush to zero."""
        if self.scaler is None:
            loss.backward()
        else:
            self.flush()
            self.scaler.scale(loss).backward()

    def flush(self) -> None:
        """Apply the scaler update owed by the last step (once, however many optimizers stepped)."""
        if self.scaler is not None and self._update_due:
            self.scaler.update()
            self._update_due = False

    def shard(self) -> None:
        """Use a loss scaler for sharded gradients (``strategy="fsdp"``), keeping the scale so far.

        Each rank then holds only a shard of every gradient, so an inf/nan found on one rank must
        skip the step on all of them: torch's ``ShardedGradScaler`` all-reduces what it found.
        Without it one rank would step while another skipped, and their shards would part.
        """
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        if self.scaler is None or isinstance(self.scaler, ShardedGradScaler):
            return
        sharded = ShardedGradScaler(self.device.type)
        sharded.load_state_dict(self.scaler.state_dict())
        self.scaler, self.sharded = sharded, True

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale now, e.g. before clipping them.

        A no-op without a scaler; calling it before :meth:`step` is optional.
        """
        if self.scaler is not None:
            with _quiet_sharded_found_inf():
                self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step ``optimizer`` (unless fp16 found inf/nan gradients) and clear the gradients.

        Gradients are set to None (PyTorch's default). Zeroing them in place would keep DDP's
        ``gradient_as_bucket_view`` gradients as bucket views through the step and save DDP one
        copy per gradient, but measured slower on CPU (BENCHMARKS.md, parity).

        Returns:
            True when the parameters were updated, False when the step was skipped.
        """
        if self.scaler is None:
            optimizer.step()
            stepped = True
        else:
            with _quiet_sharded_found_inf():
                if self.sharded and not scaler_unscaled(self.scaler, optimizer):
                    # a fused optimizer (AdamW(fused=True)) makes scaler.step look for inf/nan in this
                    # rank's shards alone (_check_inf_per_device); unscale_ asks every rank
                    self.scaler.unscale_(optimizer)
                self.scaler.step(optimizer)
            stepped = not scaler_found_inf(self.scaler, optimizer)
            self._update_due = True
        optimizer.zero_grad(set_to_none=True)
        return stepped

    def state_dict(self) -> dict[str, Any]:
        """The precision name and the loss-scaler state; plain data for ``weights_only`` loads."""
        self.flush()
        scaler_state = self.scaler.state_dict() if self.scaler is not None else None
        return {"precision": self.name, "scaler": scaler_state or None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, refusing one written under another precision.

        Raises:
            DdpkitError: ``state`` is not a precision state or has a different precision.
        """
        if not isinstance(state, dict) or "precision" not in state:
            raise DdpkitError("checkpoint has no precision state (expected a dict with a 'precision' key)")
        if state["precision"] != self.name:
            raise DdpkitError(
                f"checkpoint was written with precision {state['precision']!r} and this run uses "
                f"{self.name!r}; run with precision {state['precision']!r} or start without its state"
            )
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def __repr__(self) -> str:
        return f"Precision({self.name!r}, device={str(self.device)!r})"


@contextlib.contextmanager
def _quiet_sharded_found_inf() -> Iterator[None]:
    """Hide DTensor's note that ShardedGradScaler's one-element ``found_inf`` is taken as replicated.

    That is what the scaler means (each rank counts its own shards, then all-reduces the count),
    so the warning, printed once per process, says nothing a user can act on.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
        yield
