"""The units of the step in hand, where ``rt.backward(loss, count=n)`` weighs losses by them
(what :mod:`ddpkit.loop.counted` does with them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ddpkit.errors import UsageError


@dataclass
class Counted:
    """The counts of the step in hand."""

    scale: float | None = None
    """``c``: a power of two common to every rank, chosen at the run's first counted backward."""
    total: torch.Tensor | None = None
    """This rank's units in the step so far (float64; on the count's device)."""
    counting: bool | None = None
    """Whether this step's backwards pass ``count`` (None: no backward yet)."""
    factor: torch.Tensor | None = None
    """``c / N``, once the step's units over every rank are known (:func:`scale`)."""
    scaled: set[int] = field(default_factory=set)
    """Parameters (by id) whose gradients :func:`scale` has divided by the step's units."""

    def new_step(self) -> None:
        """The first backward of a step."""
        self.total, self.counting, self.factor, self.scaled = None, None, None, set()

    def check(self, counting: bool) -> None:
        """Refuse a step whose backwards pass ``count`` to some and not to others."""
        if self.counting is not None and self.counting != counting:
            raise UsageError(
                "rt.backward: this step's backwards pass count= to some and not to others; "
                "pass it to every rt.backward of a step (its units: tokens, say), or to none"
            )
        self.counting = counting


__all__ = ["Counted"]
