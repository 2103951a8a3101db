"""What ``rt.setup`` does to a model: replicate it (:mod:`ddpkit.parallel.ddp`) or shard it
(:mod:`ddpkit.parallel.fsdp`), as its :class:`~ddpkit.parallel.options.SetupOptions` say.

Example:
    >>> import torch
    >>> from ddpkit.parallel.options import SetupOptions
    >>> from ddpkit.parallel.wrap import wrap
    >>> options = SetupOptions()
    >>> options.check(torch.nn.Linear(2, 2), device=torch.device("cpu"), backend=None, precision="fp32")
    >>> wrapped = wrap(torch.nn.Linear(2, 2), None, options, device=torch.device("cpu"), world_size=1,
    ...                is_main=True, precision="fp32", timeout_s=60)
    >>> wrapped.sharded, wrapped.mode.name
    (False, 'replicated')
"""

from __future__ import annotations

import weakref

import torch

from ddpkit._torch import unwrap
from ddpkit.parallel import fsdp, periodic, periodic_parts
from ddpkit.parallel.ddp import replicate
from ddpkit.parallel.modes import Periodic, Sharded
from ddpkit.parallel.options import SetupOptions, Wrapped


def wrap(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    options: SetupOptions,
    *,
    device: torch.device,
    world_size: int,
    is_main: bool,
    precision: str,
    timeout_s: float,
) -> Wrapped:
    """Replicate or shard ``model`` as ``options`` say (checked already with :meth:`SetupOptions.check`).

    Args:
        model: the user's model (maybe compiled already).
        optimizer: its optimizer, if built; under fsdp it is rebound to the sharded parameters.
        options: the checked options.
        device: where the model's parameters go.
        world_size: processes of the job (one process: no DDP wrapper).
        is_main: global rank 0, the one that warns.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: fsdp's compute dtype.
        timeout_s: the collective timeout, for PowerSGD's own group.

    Returns:
        The :class:`Wrapped` model.
    """
    if options.strategy == "fsdp":
        units = [options.fsdp_units] if isinstance(options.fsdp_units, type) else options.fsdp_units
        # weak references only: a parameter no optimizer holds any more is freed as fsdp shards it
        before = {name: weakref.ref(p) for name, p in model.named_parameters()}
        sharded = fsdp.shard(
            model,
            [optimizer] if optimizer is not None else [],
            device=device,
            precision=precision,
            fsdp_units=units,
            reshard_after_forward=options.reshard_after_forward,
            cpu_offload=options.cpu_offload,
        )
        after = dict(sharded.named_parameters())
        # another optimizer built on the old ones steps the sharded ones (Sharded.rebind)
        replaced = {}
        for name, ref in before.items():
            old = ref()
            if old is not None and after.get(name) is not None and after[name] is not old:
                replaced[id(old)] = (ref, after[name])
        return Wrapped(sharded, sharded=True, mode=Sharded(replaced))
    if options.sync != "every-step":
        return _train_apart(model, optimizer, options, device=device, is_main=is_main)

    return replicate(
        model, options, device=device, world_size=world_size, is_main=is_main, timeout_s=timeout_s, optimizer=optimizer
    )


def _train_apart(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    options: SetupOptions,
    *,
    device: torch.device,
    is_main: bool,
) -> Wrapped:
    """Infrequent sync: the model on its device, no DDP, a :class:`~ddpkit.parallel.periodic.PeriodicSync`."""
    model = model.to(device)
    syncer = periodic.PeriodicSync(
        model,
        optimizer,
        kind=options.sync,
        every=options.sync_every,
        outer_lr=options.outer_lr,
        outer_momentum=options.outer_momentum,
        sync_dtype=options.sync_dtype,
        fragments=options.sync_fragments,
        delay=options.sync_delay,
    )
    syncer.probe_link(device)  # sync_every left out: the link, timed now, chooses the period
    periodic_parts.announce(options.sync, options.sync_every, is_main)
    return Wrapped(options.compiled(model), mode=Periodic(syncer))


def full_state_dict(model: torch.nn.Module, *, is_main: bool) -> dict[str, torch.Tensor] | None:
    """The whole model's state with plain names, on the CPU, on rank 0 (None elsewhere).

    Every rank must call it: a sharded model gathers its shards; a replicated one is rank 0's copy;
    one that syncs infrequently gives its synced weights.
    """

    if fsdp.is_sharded(model):
        return fsdp.full_state_dict(model)
    if not is_main:
        return None
    return periodic.exported(model, {k: v.detach().cpu().clone() for k, v in unwrap(model).state_dict().items()})
