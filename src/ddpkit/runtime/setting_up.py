"""What ``rt.setup`` does with a model: check its options, choose its mode, wrap it, adopt it into the run."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ddpkit.checkpoint.state import load_any_wrapping
from ddpkit.parallel import exact, modes
from ddpkit.parallel.options import SetupOptions
from ddpkit.parallel.wrap import wrap
from ddpkit.state.run import RunState


def adopt(
    run: RunState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    options: SetupOptions,
    *,
    others: Sequence[torch.optim.Optimizer] = (),
    device: torch.device,
    rank: int,
    world_size: int,
    is_main: bool,
    timeout_s: float,
) -> tuple[torch.nn.Module, int]:
    """Check ``options`` (one line for what cannot work), make the model's mode, wrap it, adopt it.

    Args:
        run: the run that takes the model.
        model: the user's model (maybe compiled already).
        optimizer: its optimizer, if built.
        options: ``rt.setup``'s options.
        others: more of its optimizers (``rt.setup(model, head, body)``), which its mode takes too.
        device: this process's device.
        rank: this process's rank.
        world_size: processes of the job.
        is_main: the process that warns.
        timeout_s: the collective timeout (PowerSGD's own group).

    Returns:
        The model to train and its index in the run.
    """
    if not options.sync_batchnorm and any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules()):
        # the script converted its BatchNorm itself (a habit of plain DDP): it asked for synced statistics,
        # which ddpkit's own SyncBatchNorm gives on every device (torch's refuses CPU modules)
        options = dataclasses.replace(options, sync_batchnorm=True)
    micro_shards = options.micro_shards
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    options.check(model, device=device, backend=backend, precision=run.precision.name)
    options.check_more_optimizers(model, others)
    # a teacher, a frozen encoder: nothing of it trains (modes.Frozen); sharded, it saves memory as fsdp does
    frozen = modes.frozen(model) and options.strategy != "fsdp"
    if frozen:
        options.check_frozen()
    else:
        modes.check_combination(
            micro_shards=micro_shards,
            options=options,
            world_size=world_size,
            model=model,
            models_set_up=sum(not isinstance(entry.mode, modes.Frozen) for entry in run.entries),
            micro_shards_set_up=run.micro_shards,
        )
    if micro_shards is not None:
        mode: modes.Mode = modes.MicroShards(
            exact.setup(
                model,
                optimizer,
                micro_shards,
                device=device,
                world_size=world_size,
                rank=rank,
                seed=run.seed,
                quorum=run.world.quorum,
            )
        )
        run.world.take_micro_shards()
        model = options.compiled(model)  # after the shards' hooks are on its BatchNorm layers, which it traces
        index = run.adopt(model, optimizer, mode=mode)
    else:
        # fsdp moves a unit at a time as it shards (fsdp.shard): the whole model need not fit on the GPU
        if not frozen:
            model = run.world.prepare(model if options.strategy == "fsdp" else model.to(device), options)
        wrapped = wrap(
            model,
            optimizer,
            run.world.left_to_wrap(options),
            device=device,
            world_size=world_size,
            is_main=is_main,
            precision=run.precision.name,
            timeout_s=timeout_s,
        )
        run.world.takes(wrapped.mode)
        if wrapped.sharded:
            run.precision.shard()
        model = wrapped.model
        index = run.adopt(model, optimizer, mode=wrapped.mode, buffers=wrapped.buffers, not_bitwise=wrapped.not_bitwise)
    mode = run.entries[index].mode
    for other in others:
        mode.also_steps(other)
        run.adopt_optimizer(other)
    load_any_wrapping(model)  # a state dict saved by hand on another number of processes loads too
    if not frozen:  # a teacher's forward runs where the script likes: nothing of it trains
        run.precision.watch_forward(model, warns=is_main)
    return model, index


__all__ = ["adopt"]
