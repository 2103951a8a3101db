"""``grad_compression="auto"``: measure the link and the step, then send the fewest bytes that pay.

At ``rt.setup`` the ranks time the link they share (:func:`ddpkit.distributed.probe.link`: a one-element
allreduce and one of the gradients' bytes, at most :data:`PROBE_BYTES`, every rank released
together); the first :data:`MEASURE_STEPS` steps then run uncompressed and are timed. At the step
after them every rank takes the same decision from the same numbers (the slowest rank's step):

- each choice's step is predicted as the compute (the step less its exchange) plus the choice's
  exchange: the bytes it sends over the measured link speed, and its calls' latency;
- ``bf16`` halves the bytes; ``powersgd`` sends its factors (:func:`ddpkit.parallel.powersgd.payload_elements`)
  in twice the calls;
- a compression is chosen only where it predicts :data:`MIN_GAIN` times the samples/s of none.

The choice and the numbers behind it are printed once (rank 0), kept as :attr:`AutoCompressor.decision`
(``ddpkit train`` writes it to ``summary.json``, ``ddpkit bench`` to its rows) and saved in every
checkpoint with the chosen compressor's own state, so a resumed run decides nothing again.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ddpkit._torch import PrivateApiChanged, ddp_bucket_count
from ddpkit.distributed.probe import bus_bytes, link, slowest_step
from ddpkit.errors import warn
from ddpkit.parallel.compression import Compressor
from ddpkit.parallel.powersgd import payload_elements

MEASURE_STEPS = 5
"""Uncompressed steps timed before the choice (the first is set-up and not counted)."""
PROBE_BYTES = 4 << 20
"""The link is timed on the gradients' bytes, at most 4 MiB (at 10 Mbit/s that is 3.4 s a call)."""
MIN_GAIN = 1.10
"""A compression is chosen only where it predicts this many times the samples/s of none."""


class AutoCompressor(Compressor):
    """The hook of ``grad_compression="auto"``: plain until it decides, then the chosen compressor's.

    Args:
        model: the DDP model, whose gradients and buckets the prediction counts.
        device: this rank's device.
        rank: ``powersgd_rank``, if PowerSGD is chosen.
        start: ``powersgd_start``, if PowerSGD is chosen (its plain steps count from the choice).
        make: builds the chosen compressor: ``make(choice) -> Compressor`` (PowerSGD's own group
            is made then, a collective at the same step on every rank).
    """

    name = "auto"

    def __init__(self, model: Any, device: torch.device, *, rank: int, start: int | None, make: Any) -> None:

        super().__init__()
        params = [p for p in model.parameters() if p.requires_grad]
        self.grad_bytes = sum(p.numel() * p.element_size() for p in params)
        self.powersgd_bytes = 4 * payload_elements([p.shape for p in params], rank)
        self.latency_s, self.link_bytes_per_s = link(min(self.grad_bytes, PROBE_BYTES), device)
        self.model, self.make = model, make
        self.device = device
        self.chosen: Compressor | None = None
        self.decision: dict[str, Any] | None = None
        self.step_ends: list[float] = []

    # DDP checks a hook's annotations against its own types: this one has none on purpose.
    def hook(self, state, bucket):  # noqa: ANN001, ANN201
        """Until the choice, a plain allreduce of the mean; then the chosen compressor's hook."""
        if self.chosen is not None:
            return self.chosen.hook(state, bucket)
        buffer = bucket.buffer()
        self.payload_elements += buffer.numel()
        buffer.div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda done: done.value()[0])

    @property
    def payload_bytes(self) -> int:
        """Bytes handed to allreduce so far, before and after the choice."""
        return self.payload_elements * 4 + (self.chosen.payload_bytes if self.chosen is not None else 0)

    def after_step(self) -> None:
        """Time the step; after :data:`MEASURE_STEPS` of them, choose (every rank, the same step)."""
        if self.decision is not None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's kernels, not only their launch (link() waits too)
        self.step_ends.append(time.perf_counter())
        if len(self.step_ends) > MEASURE_STEPS:
            self._decide()

    def _decide(self) -> None:

        step = slowest_step(self.step_ends)
        world = dist.get_world_size()
        buckets = _buckets(self.model)
        link = self.link_bytes_per_s or float("inf")

        def exchange(nbytes: float, calls: int) -> float:
            return bus_bytes(nbytes, world) / link + calls * self.latency_s

        plain = exchange(self.grad_bytes, buckets)
        compute = max(step - plain, 0.01 * step)  # the link timing can exceed a noisy step
        predicted = {
            "none": step,
            "bf16": compute + exchange(self.grad_bytes / 2, buckets),
            "powersgd": compute + exchange(self.powersgd_bytes, 2 * buckets),
        }
        best = min(("bf16", "powersgd"), key=lambda c: predicted[c])
        choice = best if step / predicted[best] >= MIN_GAIN else "none"
        self.decision = {
            "choice": choice,
            "link_bytes_per_s": self.link_bytes_per_s,
            "latency_s": self.latency_s,
            "step_s": step,
            "compute_s": compute,
            "grad_bytes": self.grad_bytes,
            "powersgd_bytes": self.powersgd_bytes,
            "predicted_step_s": predicted,  # as compared (a check that re-applies the rule gets its answer)
        }
        self._adopt(choice)
        if dist.get_rank() == 0:
            speed = "unmeasured" if self.link_bytes_per_s is None else f"{self.link_bytes_per_s / 1e6:.1f} MB/s"
            warn(
                f"grad_compression='auto' chose {choice!r}: link {speed}, latency {self.latency_s * 1e3:.2f} ms, "
                f"step {step * 1e3:.1f} ms of which {plain * 1e3:.1f} ms exchanging {self.grad_bytes / 1e6:.2f} MB; "
                + ", ".join(f"{k} predicts {v * 1e3:.1f} ms" for k, v in predicted.items())
            )

    def _adopt(self, choice: str) -> None:
        self.chosen = None if choice == "none" else self.make(choice)

    def state_dict(self) -> dict[str, Any]:
        """The decision (or that none was taken yet) and the chosen compressor's own state."""
        return {
            "name": self.name,
            "decision": self.decision,
            "chosen": None if self.chosen is None else self.chosen.state_dict(),
        }

    def load_state_dict(self, saved: dict[str, Any], *, same_world: bool, source: str) -> None:
        """Resume the saved decision (and its compressor's state); none saved: measure again."""
        if saved.get("name") != self.name:
            super().load_state_dict(saved, same_world=same_world, source=source)  # warns
            return
        self.decision = saved.get("decision")
        if self.decision is None:
            return
        self._adopt(self.decision["choice"])
        if self.chosen is not None and saved.get("chosen") is not None:
            self.chosen.load_state_dict(saved["chosen"], same_world=same_world, source=source)


def _buckets(model: Any) -> int:
    try:
        return ddp_bucket_count(model)
    except PrivateApiChanged:
        return 1
