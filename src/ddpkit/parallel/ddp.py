"""How the model is replicated: device, SyncBatchNorm, DDP with a settled bucket layout, compile.

:func:`replicate` is what ``rt.setup`` does to a model under ``strategy="ddp"``; it returns a
:class:`~ddpkit.parallel.options.Wrapped`: the model and what the loop must know about it (why a
resume would not be bitwise, if it would not; the compressor; lazily averaged statistics).
"""

from __future__ import annotations

import inspect
import re
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ddpkit import _torch
from ddpkit._torch import ready_order_ddp
from ddpkit.distributed import collectives
from ddpkit.errors import UsageError, translate_uncaught, warn
from ddpkit.parallel import lazy_buffers
from ddpkit.parallel.auto import AutoCompressor
from ddpkit.parallel.compression import attach
from ddpkit.parallel.exact_tree import broadcast_from_rank0
from ddpkit.parallel.modes import Frozen, Replicated, frozen, sparse_gradient_modules
from ddpkit.parallel.options import SetupOptions, Wrapped
from ddpkit.parallel.sync_batchnorm import convert_sync_batchnorm


def _buffer_sync_arg() -> str:
    """DDP's name for per-forward buffer broadcasting (renamed in recent torch)."""
    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"


_BUFFER_SYNC_ARG = _buffer_sync_arg()


def replicate(
    model: torch.nn.Module,
    options: SetupOptions,
    *,
    device: torch.device,
    world_size: int,
    is_main: bool,
    timeout_s: float | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Wrapped:
    """Move ``model`` to ``device``, convert BatchNorm if asked, wrap it in DDP when world > 1, compile.

    A model with no parameter that requires a gradient is not wrapped: every rank takes rank 0's weights
    and buffers, as DDP's set-up would give (:class:`~ddpkit.parallel.modes.Frozen`).

    ``options.grad_compression`` (checked by :meth:`SetupOptions.check`) registers its hook on the
    DDP model; with one process nothing is sent, and it is left out with a warning.

    Args:
        model: the user's model (maybe compiled already).
        options: ``rt.setup``'s options; the DDP ones and ``sync_batchnorm``, ``compile`` and the
            compression are read here.
        device: where the parameters go.
        world_size: processes of the job (one: no DDP wrapper).
        is_main: global rank 0, the one that warns.
        timeout_s: the collective timeout, for PowerSGD's own group.
        optimizer: its optimizer, if built: parameters of it outside the model are averaged as DDP's are.
    """
    model = model.to(device)
    wrapped = Wrapped(model)
    if options.sync_batchnorm and world_size > 1:
        model = convert_sync_batchnorm(model, device, _statistics_group(device, timeout_s))
    elif device.type != "cuda" and any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules()):
        model = convert_sync_batchnorm(model, device)  # torch's of the script's own, which refuses a CPU module
    if frozen(model):  # nothing to average, and DDP refuses such a model: every rank takes rank 0's weights
        wrapped.mode = Frozen(model)
        if world_size > 1:
            broadcast_from_rank0(model)
    elif world_size > 1:
        model = _distributed(
            model, options, wrapped, device=device, is_main=is_main, timeout_s=timeout_s, optimizer=optimizer
        )
    elif options.grad_compression is not None and is_main:
        warn(f"grad_compression={options.grad_compression!r} has no effect with one process: no gradients are sent")
    wrapped.model = options.compiled(model)
    return wrapped


def _statistics_group(device: torch.device, timeout_s: float | None) -> Any:
    """A process group of its own for SyncBatchNorm's collectives on CPU (gloo runs a group's
    collectives one after another, so on the default group a layer's backward would wait for
    DDP's gradient buckets queued before it); None (the default group) on CUDA. A collective."""
    if device.type == "cuda":
        return None
    import datetime

    import torch.distributed as dist

    return dist.new_group(timeout=None if timeout_s is None else datetime.timedelta(seconds=timeout_s))


def _buffer_policy(model: torch.nn.Module, options: SetupOptions, ddp_kwargs: dict[str, Any]) -> Any:
    """Decide how BatchNorm statistics stay equal across ranks; returns the lazily averaged ones, if any.

    Synced statistics (SyncBatchNorm) are equal already, so nothing is broadcast; otherwise the
    BatchNorm statistics are averaged lazily (when read or saved) instead of broadcast from rank 0
    every forward. A compiled model, or the user's own buffer setting, keeps DDP's broadcast.
    """
    if ddp_kwargs.keys() & {"broadcast_buffers", "forward_sync_buffers"}:
        return None
    if options.sync_batchnorm:
        ddp_kwargs[_BUFFER_SYNC_ARG] = False
        return None
    if options.compile or hasattr(model, "_orig_mod"):  # compiled before setup counts too
        return None
    lazy = lazy_buffers.candidates(model)  # only BatchNorm statistics: average them lazily
    if lazy is not None:
        ddp_kwargs[_BUFFER_SYNC_ARG] = False
    return lazy


def _distributed(
    model: torch.nn.Module,
    options: SetupOptions,
    wrapped: Wrapped,
    *,
    device: torch.device,
    is_main: bool,
    timeout_s: float | None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Any:
    """Wrap ``model`` in DDP (buckets settled, buffers policy, compression); fills ``wrapped``'s extras."""
    from torch.nn.parallel import DistributedDataParallel

    ddp_kwargs = dict(options.ddp_kwargs)
    # Gradients as views into DDP's buckets save a gradient-sized copy of memory, which a GPU
    # wants; on a CPU they cost backward time (ResNet-18: 8 ms a step, BENCHMARKS.md), and
    # memory is rarely what runs out there. Bitwise the same either way.
    ddp_kwargs.setdefault("gradient_as_bucket_view", device.type == "cuda")
    lazy = _buffer_policy(model, options, ddp_kwargs)
    device_ids = [device.index] if device.type == "cuda" else None
    # DDP re-buckets after the first backward unless it looks for unused parameters (then its
    # first layout, last layers first, stays); ddpkit settles that layout at once instead.
    settle = not ddp_kwargs.get("find_unused_parameters") or ddp_kwargs.get("static_graph")
    if settle:
        model = ready_order_ddp(model, device_ids=device_ids, **ddp_kwargs)
    else:
        model = DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)
    if ddp_kwargs.get(_BUFFER_SYNC_ARG) is False and _BUFFER_SYNC_ARG == "broadcast_buffers":
        # there, broadcast_buffers=False also skips the buffers' copy from rank 0 at construction
        lazy_buffers.broadcast_from_rank0(model.module)
    if lazy is not None:
        wrapped.buffers = lazy_buffers.install(model, lazy)
    else:
        lazy_buffers.broadcasts(model)
    if settle:
        wrapped.not_bitwise = settle_buckets(model, is_main=is_main)
    compressor = None
    if options.grad_compression is None and sparse_gradient_modules(model.module):
        model.register_comm_hook(None, sparse_safe_average)  # (compression with them is refused at set-up)
    if options.grad_compression is not None:
        compressor = attach(
            model,
            options.grad_compression,
            rank=options.powersgd_rank,
            start=options.powersgd_start,
            device=device,
            choose=AutoCompressor,
            buckets_settled=wrapped.not_bitwise is None,
            timeout_s=timeout_s,
        )
    wrapped.mode = AcrossProcesses(model, compressor, warns=is_main, optimizer=optimizer)
    translate_uncaught(unfinished_reduction)
    return model


# DDP checks a hook's annotations against its own types: this one has none on purpose.
def sparse_safe_average(process_group, bucket):  # noqa: ANN001, ANN201
    """DDP's own average of a bucket (divide by the world size, all-reduce), on a copy of a sparse gradient.

    Without a hook torch's reducer divides a sparse gradient in place, and its values can be the very
    tensor another branch of the backward still reads: autograd hands an embedding the gradient of its
    output as it is, so ``linear(x) + embedding(i)`` had the linear layer's gradients divided once more
    (halved on 2 processes, in float64 and on torch's own DDP alike). A model with a sparse gradient gets
    this hook: the dense buckets are the reducer's own copies, the sparse one is copied first.
    """
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    if tensor.is_sparse:
        tensor = tensor.clone()
    tensor.div_(dist.get_world_size(group))
    work = dist.all_reduce(tensor, group=group, async_op=True)
    assert work is not None  # async_op=True
    return work.get_future().then(lambda future: future.value()[0])


def settle_buckets(model: Any, *, is_main: bool) -> str | None:
    """Settle DDP's gradient buckets now, so every step of every attempt uses the same layout.

    DDP starts with one bucket and, after the first backward, re-buckets in the order gradients
    became ready. A run resumed from a checkpoint would take its first step with the starting
    layout where the uninterrupted run used the re-bucketed one; with three or more processes a
    ring allreduce sums each element in an order that depends on where it sits in the bucket, so
    the two runs part by a rounding error. ddpkit re-buckets at once, with DDP's own size caps
    (a small first bucket), in reverse registration order (:func:`ddpkit._torch.ready_order_ddp`):
    the order backward makes gradients ready, so the first bucket (the last layers) is reduced
    while backward computes the rest, as DDP's ready order would. Same layout on every step of
    every attempt: resume is bitwise exact and communication still overlaps. CPU and GPU alike.

    Returns:
        None, or why resume is not bitwise: without the private APIs (another torch) DDP's
        default stays, with a warning (rank 0, once), and checkpoints record it.
    """
    try:
        _torch.settle_ddp_buckets(model)  # a collective: every rank calls setup
    except _torch.PrivateApiChanged as exc:
        if is_main:
            warn(f"{exc}: with 3 or more processes a resumed run may differ from an uninterrupted one by rounding")
        return f"DDP buckets could not be settled at setup ({exc})"
    return None


class AcrossProcesses(Replicated):
    """DDP over several processes: a step whose backward left a trainable parameter without a
    gradient is refused before the optimizer takes it (:func:`refuse_unused`); parameters that train
    outside DDP's buckets have their gradients averaged after DDP's (:func:`average_unbucketed`)."""

    def __init__(
        self, ddp: Any, compressor: Any = None, *, warns: bool = True, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        super().__init__(compressor)
        self.ddp = ddp
        """The :class:`~torch.nn.parallel.DistributedDataParallel` model."""
        self.warns = warns
        """This process warns (global rank 0)."""
        self.can_check = True
        """False once the reducer's check turned out missing (another torch): warned once."""
        self.optimizers = [optimizer] if optimizer is not None else []
        """The optimizers given with the model: a parameter of one outside the model (a learned loss weight)."""
        ignored = set(getattr(ddp, "parameters_to_ignore", None) or ())
        named = list(ddp.module.named_parameters())
        _IN_BUCKETS.update({id(p): p for n, p in named if p.requires_grad and n not in ignored})
        self._module = {id(p) for _, p in named}
        self.frozen = [(n, p) for n, p in named if not p.requires_grad and n not in ignored]
        """The parameters frozen when DDP was built, which its buckets leave out (by name): a layer
        unfrozen later (fine-tuning's gradual unfreezing) would step on each rank's own gradients."""
        self._outside: list[torch.Tensor] = []  # the optimizer's parameters outside the model
        self._groups: tuple[int, ...] | None = None  # the optimizers' group sizes when they were listed
        self._syncs = True  # this backward's gradients are exchanged (not a micro-step inside no_sync)
        self._told = False

    def accumulating(self, group: tuple[int, bool] | None) -> None:
        """Inside ``rt.accumulate``, only the group's last micro-step exchanges (DDP's ``no_sync``)."""
        self._syncs = group is None or group[1]

    def also_steps(self, optimizer: torch.optim.Optimizer) -> None:
        """Its parameters outside the model are averaged after each backward too."""
        self.optimizers.append(optimizer)

    def _outside_model(self) -> list[torch.Tensor]:
        """The optimizers' parameters that are neither the model's nor in another DDP's buckets (listed
        again where an optimizer has gained a group or a parameter)."""
        if not self.optimizers:
            return []
        groups = tuple(len(group["params"]) for optimizer in self.optimizers for group in optimizer.param_groups)
        if groups != self._groups:
            self._groups = groups
            found = {id(p): p for o in self.optimizers for group in o.param_groups for p in group["params"]}
            self._outside = [p for i, p in found.items() if i not in self._module and _IN_BUCKETS.get(i) is not p]
        return self._outside

    def after_backward(self) -> None:
        """Average the gradients of what trains outside DDP's buckets, as DDP averages its own: a
        parameter frozen at set-up and trained since, one of the optimizer's outside the model."""
        if not self._syncs:
            return
        unfrozen = [(name, p) for name, p in self.frozen if p.requires_grad]
        outside = [p for p in self._outside_model() if p.requires_grad]
        if not unfrozen and not outside:
            return
        if self.warns and not self._told:
            self._told = True
            warn(_unbucketed_message([name for name, _ in unfrozen], outside))
        average_unbucketed([p for _, p in unfrozen] + outside)

    def complete(self, params: Sequence[torch.Tensor], *, stepping: bool = False) -> None:
        """Refuse a step whose backward left a trainable parameter out (DDP's exchange never finished)."""
        if not self.can_check:
            return
        try:
            refuse_unused(self.ddp)
        except _torch.PrivateApiChanged as exc:
            self.can_check = False
            if self.warns:
                warn(f"{exc}: a parameter the loss does not use is named at the next forward, not before the step")


_IN_BUCKETS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
"""The parameters in the buckets of a live DDP model of this process, by ``id``: an optimizer shared by
two set-up models holds the other's, which its own DDP averages."""


def _unbucketed_message(unfrozen: list[str], outside: list[torch.Tensor]) -> str:
    parts = []
    if unfrozen:
        shown = ", ".join(unfrozen[:3]) + (f" and {len(unfrozen) - 3} more" if len(unfrozen) > 3 else "")
        parts.append(f"what was frozen at rt.setup ({shown})")
    if outside:
        shapes = ", ".join(str(tuple(p.shape)) for p in outside[:3]) + (" ..." if len(outside) > 3 else "")
        parts.append(f"the optimizer's parameters outside the model (of shapes {shapes})")
    return (
        f"DDP's buckets leave out {' and '.join(parts)}, which train: ddpkit averages their gradients after "
        "each backward, outside the backward's overlap"
    )


def average_unbucketed(params: Sequence[torch.Tensor]) -> None:
    """Average the gradients of ``params`` over the processes in place, as DDP averages the ones in
    its buckets: one all-reduce of flags (a parameter with a gradient on some rank only counts zero
    elsewhere; one with none on any stays without), then one of the gradients a device and dtype.

    Raises:
        UsageError: a sparse gradient among them (``nn.Embedding(sparse=True)`` unfrozen after set-up).
    """
    import torch.distributed as dist

    flags = collectives.all_reduce(torch.tensor([p.grad is not None for p in params], dtype=torch.int32), op="max")
    present = [p for p, flag in zip(params, flags.tolist()) if flag]
    if any(p.grad is not None and p.grad.is_sparse for p in present):
        raise UsageError(
            "DDP: a sparse gradient of a parameter frozen at rt.setup and trained since cannot be averaged; "
            "unfreeze it before rt.setup"
        )
    world = dist.get_world_size()
    # by device too: a learned loss weight the optimizer holds may stay on the host beside a GPU model,
    # and NCCL takes CUDA tensors only (collectives.all_reduce sends each where the backend reduces)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in present:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        p.grad = grad
        by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for grads in by_kind.values():
        flat = collectives.all_reduce(torch.cat([grad.reshape(-1) for grad in grads]))
        flat.div_(world)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def refuse_unused(ddp: Any) -> None:
    """Raise a one-line :class:`UsageError` when ``ddp``'s last backward left some of its trainable
    parameters without a gradient, before the optimizer steps.

    DDP's reducer waits for every trainable parameter's gradient before it exchanges the bucket that
    holds it. A parameter the loss did not use (a head kept for later, a branch not taken) leaves
    its bucket unexchanged: the optimizer would step on this rank's own gradients, and torch stops
    the next forward with "Expected to have finished reduction in the prior iteration". One
    process never sees it, so a script that ran under ``python`` stops at its second step under
    ``ddpkit run -n 2``; this names the parameters at the first. The condition is the reducer's own
    (:func:`ddpkit._torch.ddp_reduction_unfinished`), so a step with no backward, or a second
    optimizer stepped after the same backward, is never refused.

    Raises:
        UsageError: the parameters, and the two fixes.
        PrivateApiChanged: torch's reducer no longer answers.
    """
    text = _torch.ddp_reduction_unfinished(ddp)
    if text is not None:
        raise UsageError(_unused_message(_parameters_named(text, ddp), "in this step"))


def _unused_message(names: list[str], when: str) -> str:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (
        f"DDP: {len(names)} trainable parameter{'s' if len(names) != 1 else ''} of the model got no gradient "
        f"{when} ({shown}), and DDP exchanges gradients only once every trainable parameter has one: "
        "freeze what the loss does not use (p.requires_grad_(False) before rt.setup), or pass "
        "rt.setup(..., find_unused_parameters=True) if it is used on some steps only (layers run through "
        "torch.utils.checkpoint(..., use_reentrant=True) on inputs that need no gradient get none: pass "
        "use_reentrant=False)"
    )


_UNFINISHED = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")


def _parameters_named(text: str, ddp: Any) -> list[str]:
    """The parameters torch's unfinished-reduction error counts by the reducer's indices, by name, in
    registration order (the reducer of a :func:`~ddpkit._torch.ready_order_ddp` model lists them last first)."""
    found = _UNFINISHED.search(text)
    indices = [int(i) for i in found.group(1).split()] if found else []
    order = _torch.reducer_parameter_names(ddp)
    if order is not None and indices and max(indices) < len(order):
        return [order[i] for i in sorted(indices, reverse=True)]
    return [f"the reducer's parameter {i}" for i in indices] or ["some"]


def unfinished_reduction(exc: BaseException) -> UsageError | None:
    """torch's error at the forward after a backward that left parameters out (a step :func:`refuse_unused`
    did not see: ``loss.backward()`` and the optimizer called directly), as the same line, with the
    parameters' names rather than the reducer's indices."""
    text = str(exc) if isinstance(exc, RuntimeError) else ""
    if "Expected to have finished reduction in the prior iteration" not in text:
        return None
    ddp = None
    traceback = exc.__traceback__
    while traceback is not None and ddp is None:  # the DDP model whose forward raised it
        candidate = traceback.tb_frame.f_locals.get("self")
        ddp = candidate if _torch.reducer_parameter_names(candidate) is not None else None
        traceback = traceback.tb_next
    return UsageError(_unused_message(_parameters_named(text, ddp), "in the previous step"))
