"""The options of ``rt.setup`` and what a wrap returns, checked in one place.

:class:`SetupOptions` is every argument of ``rt.setup`` but the model and the optimizer;
:meth:`SetupOptions.check` refuses what cannot work before any collective runs, and
:func:`check_strategy` is the part ``ddpkit train`` runs on its flags before any process starts.
:class:`Wrapped` is what :func:`ddpkit.parallel.wrap.wrap` (and :func:`ddpkit.parallel.ddp.replicate`)
return: the model and what the loop and the checkpoints must keep of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ddpkit.errors import UsageError
from ddpkit.parallel import compression, fsdp, periodic_parts
from ddpkit.parallel.modes import Mode, Replicated, sparse_gradient_modules

STRATEGIES = ("ddp", "fsdp")


def check_strategy(strategy: str, cpu_offload: bool, *, cli: bool = False) -> None:
    """Refuse an unknown ``strategy``, or ``cpu_offload`` without ``"fsdp"``, in one line.

    ``rt.setup`` and ``ddpkit train`` (``cli=True``: the message names the flags) both check here.
    """
    if strategy not in STRATEGIES:
        raise UsageError(
            f"--strategy {strategy!r}: choose ddp or fsdp"
            if cli
            else f"unknown strategy {strategy!r}; choose 'ddp' (replicated) or 'fsdp' (sharded)"
        )
    if cpu_offload and strategy != "fsdp":
        raise UsageError(
            "--cpu-offload keeps fsdp's shards in CPU memory: add --strategy fsdp"
            if cli
            else "cpu_offload=True shards parameters to CPU memory: it needs strategy='fsdp'"
        )


def _check_ddp_keywords(keywords: list[str], options: list[str]) -> None:
    """Refuse, in one line, a keyword of ``rt.setup`` that is neither ddpkit's nor ``DistributedDataParallel``'s
    (a typo would otherwise be ignored with one process and be torch's TypeError with several)."""
    import difflib
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    accepted = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"}
    for keyword in keywords:
        if keyword in ("device_ids", "output_device"):
            raise UsageError(
                f"rt.setup: {keyword} is ddpkit's to set: it places the model on this rank's own device "
                "(ddpkit.init(device=...) chooses another)"
            )
        if keyword in accepted:
            continue
        if keyword == "ddp_kwargs":
            raise UsageError(
                "rt.setup takes DistributedDataParallel's arguments as its own keywords: "
                "rt.setup(model, optimizer, find_unused_parameters=True), not ddp_kwargs={...}"
            )
        close = difflib.get_close_matches(keyword, [*options, *sorted(accepted)], n=1)
        raise UsageError(
            f"rt.setup: unknown keyword {keyword!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + "; it takes ddpkit's options (sync_batchnorm, compile, micro_shards, strategy, sync, ...) "
            "and DistributedDataParallel's arguments"
        )


_TRAINING = (  # the options about how a model trains and is averaged (SetupOptions.check_frozen)
    "micro_shards",
    "grad_compression",
    "sync",
    "sync_every",
    "outer_lr",
    "outer_momentum",
    "sync_dtype",
    "sync_fragments",
    "sync_delay",
    "ddp_kwargs",
)


@dataclass(frozen=True)
class SetupOptions:
    """How ``rt.setup`` wraps a model (its arguments besides the model and the optimizer)."""

    sync_batchnorm: bool = False
    """Convert BatchNorm layers to SyncBatchNorm (with more than one process): statistics over the
    global batch, whatever the number of processes."""
    compile: bool | dict[str, Any] = False
    """``torch.compile`` the wrapped model; a dict gives compile's arguments."""
    grad_compression: str | None = None
    """``"fp16"``, ``"bf16"``, ``"powersgd"`` or ``"auto"`` (measures the link, then chooses): fewer bytes
    per step on slow links (:mod:`ddpkit.parallel.compression`); its state is in every checkpoint."""
    powersgd_rank: int = 2
    """Rank of PowerSGD's low-rank factors."""
    powersgd_start: int | None = None
    """Plain steps before PowerSGD compresses (None: ddpkit's default, 10)."""
    strategy: str = "ddp"
    """``"ddp"`` (replicated) or ``"fsdp"`` (FSDP2, :mod:`ddpkit.parallel.fsdp`: parameters, gradients and
    optimizer state sharded; the optimizer is rebound to the shards)."""
    fsdp_units: Any = None
    """Module classes that become FSDP units (a class or a list of them); None: children above a size."""
    reshard_after_forward: bool = True
    """FSDP: free the gathered parameters after each unit's forward (ZeRO-3); False: ZeRO-2."""
    cpu_offload: bool = False
    """FSDP: keep shards and optimizer state in CPU memory."""
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    """Further ``DistributedDataParallel`` arguments (``find_unused_parameters``, ...)."""
    sync: str = "every-step"
    """``"every-step"`` (DDP), or ``"local-sgd"``/``"diloco"``: ranks train apart and meet every
    ``sync_every`` optimizer steps (:mod:`ddpkit.parallel.periodic`; the result then depends on the
    world size)."""
    sync_every: int | None = None
    """Optimizer steps between syncs of ``"local-sgd"`` and ``"diloco"`` (None: chosen from the link and the step)."""
    outer_lr: float | None = None
    """DiLoCo's outer learning rate (None: 0.7, DiLoCo's, with ``sync_every``; where the period is chosen
    from the link, the ranks' average change, times ``sqrt(world)`` for an adaptive inner optimizer such as
    AdamW, whose steps on a rank's share of the batch are shorter than on the whole: at the short periods a
    link allows, DiLoCo's outer Nesterov step multiplies each period's progress and diverges)."""
    outer_momentum: float | None = None
    """DiLoCo's outer Nesterov momentum (None: 0.9 with ``sync_every``; 0 where the period is chosen from the link)."""
    sync_dtype: str | None = None
    """The infrequent sync's exchange of each rank's change: ``"bf16"`` (the default: half the bytes), ``"fp32"``,
    ``"int8"`` (a quarter of fp32's bytes, with error feedback: what rounding keeps back is sent the next time), or
    ``"sparse"`` (the largest share of the change, a 16-bit word an element: a 12-bit offset in its block and a
    4-bit value, 2 bytes an element sent, with error feedback: 1/32 with
    ``sync_every``; where the period is chosen, the densest of 1/32, 1/64 and 1/128 that gives the shortest)."""
    sync_fragments: int = 1
    """Streaming DiLoCo: fragments of the model, each exchanged at its own step of the period."""
    sync_delay: int = 0
    """Streaming DiLoCo: inner steps each exchange runs in the background before it is applied; the
    rank keeps what it trained meanwhile."""
    micro_shards: int | None = None
    """Bitwise the same run on any power-of-two number of processes dividing it
    (:mod:`ddpkit.parallel.exact`): each global batch in this many shards, handed out by
    ``rt.shards``, each with its own BatchNorm statistics, summed along one fixed tree."""

    @classmethod
    def from_keywords(cls, keywords: dict[str, Any]) -> SetupOptions:
        """The options of ``rt.setup(model, optimizer, **keywords)``: a keyword that is not a field
        goes to ``DistributedDataParallel`` (:attr:`ddp_kwargs`)."""
        names = {f.name for f in fields(cls)} - {"ddp_kwargs"}
        _check_ddp_keywords([k for k in keywords if k not in names], sorted(names))
        return cls(
            **{k: v for k, v in keywords.items() if k in names},
            ddp_kwargs={k: v for k, v in keywords.items() if k not in names},
        )

    def compiled(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` through ``torch.compile`` when :attr:`compile` asks for it (a dict: its arguments), else itself."""
        if not self.compile:
            return model
        kwargs = self.compile if isinstance(self.compile, dict) else {}
        # torch.compile of a Module returns an OptimizedModule (a Module); torch's stubs say a plain callable
        return torch.compile(model, **kwargs)  # type: ignore[return-value]

    def check_more_optimizers(self, model: torch.nn.Module, others: Sequence[Any]) -> None:
        """Refuse, in one line and before anything is set up, optimizers after the first that cannot train
        under these options (``rt.setup(model, head, body)``).

        Raises:
            UsageError: one is not an optimizer; an infrequent sync (it keeps one inner optimizer's state
                per rank); under fsdp, one that stepped already or holds a parameter outside the model.
        """
        for other in others:
            if not isinstance(other, torch.optim.Optimizer):
                raise UsageError(f"rt.setup: {type(other).__name__} after the model's optimizer is not an optimizer")
        if others and self.sync != "every-step":
            raise UsageError(
                f"rt.setup(model, optimizer, ..., sync={self.sync!r}) takes one optimizer, the inner one whose "
                "state each rank keeps between syncs; put the others' parameters in its groups"
            )
        if self.strategy == "fsdp":
            fsdp.check_optimizers(model, others)

    def check_frozen(self) -> None:
        """Refuse, in one line, options about training a model that has no parameter that requires a gradient.

        Raises:
            UsageError: naming the options given (``micro_shards=``, ``sync=``, a DDP keyword, ...).
        """
        default = SetupOptions()
        given = [name for name in _TRAINING if getattr(self, name) != getattr(default, name)]
        if not given:
            return
        named = [f"{k}=" for k in self.ddp_kwargs] if given == ["ddp_kwargs"] else [f"{g}=" for g in given]
        raise UsageError(
            f"rt.setup: this model has no parameter that requires a gradient, so nothing of it trains or is "
            f"averaged and {', '.join(named)} would do nothing; set it up without them (a teacher or a frozen "
            "encoder runs as it is on every rank), or unfreeze what trains before rt.setup"
        )

    def check(self, model: torch.nn.Module, *, device: torch.device, backend: str | None, precision: str) -> None:
        """Refuse, in one line, options that cannot work for ``model`` here (before any collective).

        Args:
            model: the user's model, before it is wrapped (maybe compiled already).
            device: this process's device.
            backend: the process group's backend (None: no group).
            precision: the run's precision (``"fp32"``, ``"bf16"``, ``"fp16"``).

        Raises:
            UsageError: an unknown strategy, compression or sync, a combination that is refused
                (fsdp with compression, compile or BatchNorm; cpu_offload without fsdp; an infrequent
                sync with fsdp, compression, SyncBatchNorm or fp16), or a compression this backend or
                device cannot run.
        """
        check_strategy(self.strategy, self.cpu_offload)
        if backend == "nccl" and (sparse := sparse_gradient_modules(model)):
            raise UsageError(
                f"the model's {sparse[0]!r} makes sparse gradients (sparse=True), which NCCL cannot all-reduce: "
                "build it with sparse=False, or train on gloo"
            )
        periodic_parts.check(
            self.sync,
            every=self.sync_every,
            sync_dtype=self.sync_dtype,
            strategy=self.strategy,
            grad_compression=self.grad_compression,
            sync_batchnorm=self.sync_batchnorm,
            precision=precision,
            fragments=self.sync_fragments,
            delay=self.sync_delay,
        )
        if self.strategy == "fsdp":
            fsdp.check(
                grad_compression=self.grad_compression,
                compile=self.compile,
                sync_batchnorm=self.sync_batchnorm,
                model=model,
                ddp_kwargs=self.ddp_kwargs,
            )
            return

        compression.check(
            self.grad_compression,
            rank=self.powersgd_rank,
            start=self.powersgd_start,
            backend=backend,
            device=device,
            precision=precision,
            compile=self.compile or hasattr(model, "_orig_mod"),
        )  # compiled before setup too


@dataclass
class Wrapped:
    """A set-up model and what the loop and the checkpoints keep of it."""

    model: Any
    """The model to train: DDP-wrapped, sharded, compiled, or the model itself (one process)."""
    sharded: bool = False
    """``strategy="fsdp"``: parameters are shards (checkpoints are DCP directories)."""
    not_bitwise: str | None = None
    """Why a resumed run would not be bitwise equal to an uninterrupted one, if it would not."""
    mode: Mode = field(default_factory=Replicated)
    """How the model trains (:mod:`ddpkit.parallel.modes`): replicated (with its compression hook), sharded or periodic."""
    buffers: Any = None
    """Lazily averaged BatchNorm statistics (:mod:`ddpkit.parallel.lazy_buffers`), or None."""
