"""Gradient compression for slow links: 16-bit casts and PowerSGD, as DDP communication hooks.

``rt.setup(model, opt, grad_compression="fp16" | "bf16" | "powersgd" | "auto")`` registers one of
these on the DDP model, on every backend (gloo on CPUs included):

- ``fp16`` / ``bf16``: each gradient bucket is cast to 16 bits, divided by the world size,
  summed, and cast back: half the bytes, rounding of the averaged gradient only.
- ``powersgd``: after ``powersgd_start`` plain steps, each weight matrix's gradient is sent as
  two rank-``powersgd_rank`` factors (:mod:`ddpkit.parallel.powersgd`: torch's ``powerSGD_hook``'s
  algorithm, with error feedback and warm start, laid out and ordered for speed); vectors
  (biases, norms) are sent whole. The state (iteration, each rank's error
  feedback, the warm-start factors, the random stream that starts them) is in every checkpoint,
  so a resumed run is bitwise equal to an uninterrupted one.
- ``auto`` (:mod:`ddpkit.parallel.auto`): times the link at setup and the first steps, then takes
  none, bf16 or PowerSGD, whichever predicts the shortest step, the same on every rank.

Each compressor counts the elements it hands to ``allreduce``, so ``ddpkit bench`` reports the
bytes each rank puts on the wire per step.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.errors import UsageError, warn
from ddpkit.parallel.powersgd import FORMAT, PowerSGD
from ddpkit.rng import numpy_state, numpy_state_tuple

CHOICES = ("fp16", "bf16", "powersgd", "auto")
POWERSGD_START = 10
"""Plain steps before PowerSGD starts by default: error feedback needs more than one, and the
first steps of training move fastest, where a low-rank sketch of the gradient is least apt."""


def check(
    choice: str | None,
    *,
    rank: int,
    start: int | None,
    backend: str | None,
    device: torch.device,
    precision: str,
    compile: Any,
) -> None:
    """Refuse a choice that cannot work here, in one line, before any process group work.

    Args:
        choice: ``"fp16"``, ``"bf16"``, ``"powersgd"``, ``"auto"``, or None (no compression: nothing to check).
        rank: ``powersgd_rank``, the rank of PowerSGD's low-rank factors (not a process rank).
        start: ``powersgd_start``, plain steps before PowerSGD compresses (None: :data:`POWERSGD_START`).
        backend: the process group's backend (None: no group).
        device: this process's device.
        precision: the run's precision (``"fp32"``, ``"bf16"`` or ``"fp16"``).
        compile: truthy when the model is or will be compiled.

    Raises:
        UsageError: unknown name, bad PowerSGD numbers, bf16 that NCCL/the GPU cannot reduce,
            PowerSGD under fp16 loss scaling, or ``compile`` (untested with hooks).
    """
    if choice is None:
        return
    if choice not in CHOICES:
        raise UsageError(f"unknown grad_compression {choice!r}; choose none, {', '.join(CHOICES)}")
    if choice in ("powersgd", "auto"):
        if not isinstance(rank, int) or rank < 1:
            raise UsageError(f"powersgd_rank must be a whole number of at least 1, got {rank!r}")
        if start is not None and (not isinstance(start, int) or start < 2):
            raise UsageError(
                f"powersgd_start must be at least 2 (PowerSGD's error feedback needs "
                f"plain steps before it), got {start!r}"
            )
        if precision == "fp16":
            raise UsageError(
                f"grad_compression={choice!r} with precision='fp16': a step whose loss scale "
                "overflows would put inf into PowerSGD's error feedback for good; use "
                "precision='bf16', or grad_compression='fp16'"
            )
    if choice == "bf16" and backend == "nccl" and device.type == "cuda":
        nccl = torch.cuda.nccl.version()
        if nccl < (2, 10) or not torch.cuda.is_bf16_supported():
            raise UsageError(
                f"grad_compression='bf16' needs NCCL 2.10+ and a GPU with bfloat16 (NCCL "
                f"{'.'.join(map(str, nccl))} here); use grad_compression='fp16'"
            )
    if compile:
        raise UsageError(
            "grad_compression with compile=True is not supported yet (compiled DDP "
            "and communication hooks are untested together); drop one of them"
        )


class Compressor:
    """A DDP communication hook's state: what it sent, and what a checkpoint must hold."""

    name = "none"

    def __init__(self) -> None:
        self.payload_elements = 0  # elements handed to allreduce since the start (or reset)
        self.element_size = 4

    @property
    def payload_bytes(self) -> int:
        """Bytes this rank handed to ``allreduce`` so far (a ring sends about twice that)."""
        return self.payload_elements * self.element_size

    def hook(self, state: Any, bucket: Any) -> Any:
        """DDP's communication hook: reduce ``bucket``, return a future of its averaged gradients."""
        raise NotImplementedError

    def after_step(self) -> None:
        """An optimizer step was taken (``"auto"`` counts its timed steps, then chooses)."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, as tensors and plain values (checkpoints load with ``weights_only``)."""
        return {"name": self.name}

    def load_state_dict(self, saved: dict[str, Any], *, same_world: bool, source: str) -> None:
        """Take ``saved`` (this rank's, from a checkpoint); casts have no state."""
        _check_name(self.name, saved, source)


def _check_name(name: str, saved: dict[str, Any], source: str) -> None:
    if saved.get("name") != name:
        warn(
            f"checkpoint {source} was trained with grad_compression={saved.get('name')!r} and "
            f"resumes with {name!r}: the run continues, not bitwise as an uninterrupted one"
        )


class CastCompressor(Compressor):
    """Allreduce each bucket in 16 bits (fp16 or bf16), divided by the world size first."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"
        self.element_size = torch.empty((), dtype=dtype).element_size()

    # DDP checks a hook's annotations against its own types: this one has none on purpose.
    def hook(self, state, bucket):  # noqa: ANN001, ANN201
        """Cast ``bucket`` to 16 bits, divide by the world, all-reduce, copy the result back."""
        buffer = bucket.buffer()
        sent = buffer.to(self.dtype).div_(dist.get_world_size())  # divide first: fp16 overflows later
        self.payload_elements += sent.numel()
        future = dist.all_reduce(sent, async_op=True).get_future()

        def back(done):  # noqa: ANN001, ANN202
            buffer.copy_(done.value()[0])
            return buffer

        return future.then(back)


class PowerSGDCompressor(Compressor):
    """PowerSGD (:mod:`ddpkit.parallel.powersgd`) with its state where checkpoints can reach it."""

    name = "powersgd"

    def __init__(self, rank: int, start: int, device: torch.device) -> None:
        super().__init__()
        self.buckets_settled = True  # per-bucket state can be restored into the same buckets
        self.state = PowerSGD(rank, start, device)

    @property
    def payload_elements(self) -> int:
        """Elements PowerSGD handed to ``allreduce`` so far (kept by :class:`PowerSGD` itself)."""
        return self.state.payload_elements

    @payload_elements.setter
    def payload_elements(self, value: int) -> None:
        """Reset the count (the base class sets it before ``state`` exists)."""
        if hasattr(self, "state"):
            self.state.payload_elements = value

    def hook(self, state, bucket):  # noqa: ANN001, ANN201
        """DDP's communication hook: hand ``bucket`` to :meth:`PowerSGD.hook`."""
        return self.state.hook(bucket)

    def state_dict(self) -> dict[str, Any]:
        """Iteration, this rank's error feedback, the warm-start factors and the RNG, as plain data."""

        s = self.state
        # legacy=True, the default: MT19937's state as a tuple (numpy's stubs pick the dict overload)
        rng_state = s.rng.get_state(legacy=True)
        assert isinstance(rng_state, tuple)
        held = {**{k: (v.error, v.q) for k, v in s.buckets.items()}, **s.saved}
        return {
            "name": self.name,
            "format": FORMAT,
            "rank": s.rank,
            "start": s.start,
            "iter": s.iter,
            "error": {k: e.detach().cpu().clone() for k, (e, _) in held.items()},
            "q": {k: q.detach().cpu().clone() for k, (_, q) in held.items()},
            "rng": numpy_state(rng_state),
        }

    def load_state_dict(self, saved: dict[str, Any], *, same_world: bool, source: str) -> None:
        """Restore the saved state; on another world size or rank, keep only the iteration count.

        Error feedback is each rank's own leftover and the warm-start factors are shaped by the
        rank: neither carries over to another world size or ``powersgd_rank``, so they start
        afresh there (with a warning) while the plain warm-up is not repeated.
        """

        _check_name(self.name, saved, source)
        if saved.get("name") != self.name:
            return
        s = self.state
        s.iter = int(saved["iter"])
        s.rng.set_state(numpy_state_tuple(saved["rng"]))
        s.buckets.clear()
        s.saved.clear()
        if not same_world or saved["rank"] != s.rank or not self.buckets_settled or saved.get("format") != FORMAT:
            why = (
                "another world size"
                if not same_world
                else f"powersgd_rank {saved['rank']}"
                if saved["rank"] != s.rank
                else "DDP buckets that could not be settled"
                if not self.buckets_settled
                else "an earlier ddpkit's layout"
            )
            warn(
                f"checkpoint {source} holds PowerSGD error feedback of {why}: it starts afresh "
                "(the run continues, not bitwise as an uninterrupted one)"
            )
            return
        s.saved.update({int(k): (saved["error"][k], saved["q"][k]) for k in saved["error"]})


def attach(
    model: Any,
    choice: str,
    *,
    rank: int,
    start: int | None,
    device: torch.device,
    buckets_settled: bool = True,
    timeout_s: float | None = None,
    choose: Any = None,
) -> Compressor:
    """Register ``choice``'s hook on the DDP ``model``; returns its compressor (bytes, state).

    Args:
        model: the DDP-wrapped model.
        choice: ``"fp16"``, ``"bf16"``, ``"powersgd"`` or ``"auto"``, already :func:`check`-ed.
        rank: the rank of PowerSGD's low-rank factors (``powersgd_rank``; casts ignore it).
        start: plain steps before PowerSGD compresses (None: :data:`POWERSGD_START`).
        device: this process's device, kept in PowerSGD's state.
        buckets_settled: whether DDP's buckets were settled at setup. PowerSGD keys its state by
            bucket, so without settled buckets a resume keeps only its iteration and random stream.
        timeout_s: seconds before a collective of PowerSGD's own process group times out (None: torch's default).
        choose: for ``"auto"``, the class of its compressor (:class:`ddpkit.parallel.auto.AutoCompressor`,
            given here so this module does not import it), called ``choose(model, device, rank=,
            start=, make=)``; it builds its choice with ``make``.
    """

    def make(name: str) -> Compressor:
        if name != "powersgd":
            return CastCompressor(torch.float16 if name == "fp16" else torch.bfloat16)
        made = PowerSGDCompressor(rank, POWERSGD_START if start is None else start, device)
        made.buckets_settled = buckets_settled
        # Q's own group (see ddpkit.parallel.powersgd), with the default group's timeout; a collective call
        made.state.group = dist.new_group(timeout=None if timeout_s is None else datetime.timedelta(seconds=timeout_s))
        return made

    compressor = choose(model, device, rank=rank, start=start, make=make) if choice == "auto" else make(choice)
    model.register_comm_hook(None, compressor.hook)
    return compressor
