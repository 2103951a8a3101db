"""``strategy="fsdp"``: shard parameters, gradients and optimizer state with FSDP2 (``fully_shard``).

Each *unit* (the user's ``fsdp_units`` classes, else every child of the model, or of its
``Sequential``/``ModuleList`` children, holding at least ``min_unit_params`` parameters) is
sharded on its own, then the root: one all-gather per unit in forward and backward. FSDP2
replaces every parameter with a new ``DTensor`` parameter, so an optimizer made before
``setup`` would silently train nothing; ddpkit rebinds it to the sharded parameters by name (one
given to ``rt.setup`` there, another at its first step: :meth:`ddpkit.parallel.modes.Sharded.rebind`).

Gradients are reduce-scattered and averaged over the world, as DDP's all-reduce averages them,
so ddpkit's loss weighting keeps results independent of the world size.

Example:
    >>> model, opt = rt.setup(net, torch.optim.AdamW(net.parameters()), strategy="fsdp")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from ddpkit.errors import UsageError

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

MIN_UNIT_PARAMS = 100_000


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` was sharded with FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def check(
    *,
    grad_compression: str | None,
    compile: Any,
    sync_batchnorm: bool,
    model: torch.nn.Module,
    ddp_kwargs: dict[str, Any],
) -> None:
    """Refuse, in one line each, what is not built or tested with ``strategy="fsdp"``.

    Args:
        grad_compression: ``rt.setup``'s ``grad_compression``; any is refused (a DDP hook).
        compile: ``rt.setup``'s ``compile``; truthy, or a model compiled already, is refused.
        sync_batchnorm: ``rt.setup``'s ``sync_batchnorm``; True, or any BatchNorm layer, is refused.
        model: the user's model, before sharding.
        ddp_kwargs: further ``DistributedDataParallel`` arguments; any is refused.
    """
    if grad_compression is not None:
        raise UsageError(
            "grad_compression is a DDP communication hook; strategy='fsdp' reduce-scatters "
            "instead: drop grad_compression or use strategy='ddp'"
        )
    if compile or hasattr(model, "_orig_mod"):
        raise UsageError(
            "strategy='fsdp' with torch.compile is not tested; compile after training or use strategy='ddp'"
        )
    if sync_batchnorm or any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise UsageError(
            "strategy='fsdp' with BatchNorm layers: their running statistics would stay per "
            "rank; use strategy='ddp' (which averages them) or a norm without running statistics"
        )
    if ddp_kwargs:
        raise UsageError(
            f"{', '.join(sorted(ddp_kwargs))}: DistributedDataParallel options do not apply to strategy='fsdp'"
        )


def units(model: torch.nn.Module, classes: Sequence[type] | None, min_params: int) -> list[torch.nn.Module]:
    """The submodules sharded on their own, innermost first (FSDP2 wants children before parents)."""
    if classes:
        found = [m for m in model.modules() if m is not model and isinstance(m, tuple(classes))]
        if not found:
            raise UsageError(f"fsdp_units={[c.__name__ for c in classes]}: the model has no such module")
        return list(reversed(found))
    chosen: list[torch.nn.Module] = []
    for child in model.children():
        inner = list(child.children()) if isinstance(child, (torch.nn.Sequential, torch.nn.ModuleList)) else [child]
        chosen += [m for m in inner if sum(p.numel() for p in m.parameters()) >= min_params]
    return list(reversed(chosen))


def shard(
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    device: torch.device,
    precision: str,
    fsdp_units: Sequence[type] | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    min_unit_params: int = MIN_UNIT_PARAMS,
) -> torch.nn.Module:
    """Shard ``model`` in place, unit by unit onto ``device``, and rebind ``optimizers`` to its new parameters.

    Under bf16 and fp16 the units compute with parameters in that dtype and reduce gradients in
    fp32 into fp32 shards (the master weights).

    Args:
        model: the user's model; it becomes the FSDP root.
        optimizers: optimizers built on ``model.parameters()`` that have not stepped yet.
        device: this process's device; one group of one is made to shard over when there is no process group.
        precision: the run's precision; ``"bf16"`` and ``"fp16"`` compute in that dtype.
        fsdp_units: module classes sharded as units (None: children of at least ``min_unit_params`` parameters).
        reshard_after_forward: free the gathered parameters after each unit's forward (ZeRO-3), gathering
            them again for backward; False keeps them until backward (more memory, less traffic).
        cpu_offload: keep the sharded parameters, gradients and optimizer state in CPU memory (pinned
            on CUDA) and copy each unit to the device for its forward and backward; the optimizer
            steps on the CPU.
        min_unit_params: parameters a child needs to be a unit of its own when ``fsdp_units`` is None.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    check_optimizers(model, optimizers)
    # no model.to(device) first: each fully_shard moves only the parameters and buffers of its unit to the
    # mesh's device and shards them there, so the whole model is never on the GPU at once (cpu_offload's
    # models, larger than the GPU, included); the root's call moves what no unit holds
    names = {id(p): name for name, p in model.named_parameters()}
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute else None)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    mesh = _mesh(device)
    for unit in units(model, fsdp_units, min_unit_params) + [model]:
        fully_shard(
            unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy, offload_policy=offload
        )
    sharded = dict(model.named_parameters())
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    return model


def check_optimizers(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Refuse, in one line and before anything is sharded, an optimizer fsdp cannot rebind to the sharded
    parameters: one that stepped already (its state is the old parameters'), or one holding a parameter
    outside ``model``.

    Raises:
        UsageError: naming which.
    """
    mine = {id(p) for p in model.parameters()}
    for optimizer in optimizers:
        if optimizer.state:
            raise UsageError(
                "the optimizer has state already (it stepped); build it before training, "
                "then call rt.setup(model, optimizer, strategy='fsdp')"
            )
        if any(id(p) not in mine for group in optimizer.param_groups for p in group["params"]):
            raise UsageError(
                "the optimizer holds parameters that are not the model's; build it from "
                "model.parameters() of the model passed to rt.setup"
            )


def _mesh(device: torch.device) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():  # a world of one (python script.py): a group of one to shard over
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
    return init_device_mesh(device.type, (dist.get_world_size(),))


@contextlib.contextmanager
def no_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    """FSDP2's counterpart of DDP's ``no_sync``: keep unsharded gradients, reduce-scatter later."""
    sharded = cast("FSDPModule", model)  # sharded by fully_shard, which makes its class an FSDPModule
    sharded.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        sharded.set_requires_gradient_sync(True)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole model's state on rank 0, on the CPU, with plain names (None elsewhere); a collective."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # full and offloaded to the CPU, every value is a plain tensor (torch types them as any state value)
    state = cast(
        "dict[str, torch.Tensor]",
        get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
    )
    return state if not dist.is_initialized() or dist.get_rank() == 0 else None
