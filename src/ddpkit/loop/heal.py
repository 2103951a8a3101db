"""What a replica of a fault-tolerant job sends a healing peer, and how that peer takes it.

The state is the one a checkpoint holds, kept in memory: the user's objects (the mapping given to
``rt.resume``/``rt.checkpoint``, else the set-up models and optimizers), the loop state (epoch,
step, loader positions), the RNG states, the precision's scaler and each mode's state (an infrequent
sync's synced weights, outer optimizer and error feedback: the peer's own, where the period stands). Every value is a tensor or
plain data, so the receiving side loads it with ``weights_only=True``
(:class:`ddpkit.distributed.ft_heal.SafeTransport`).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from ddpkit import rng
from ddpkit._torch import unwrap
from ddpkit.checkpoint.state import restore_user_state, user_state
from ddpkit.state.run import RunState


def _objects(run: RunState, state: Mapping[str, Any] | None) -> dict[str, Any]:
    if state is not None:
        return dict(state)
    found: dict[str, Any] = {f"model{i}": model for i, model in enumerate(run.models)}
    found.update({f"optimizer{i}": opt for i, opt in enumerate(run.optimizers)})
    return found


def heal_state(run: RunState, state: Mapping[str, Any] | None, replica: int = 0) -> dict[str, Any]:
    """This replica's state for a peer that is behind (called by torchft, between steps).

    Args:
        run: the replica's run.
        state: the mapping given to ``rt.resume`` or a save (None: the set-up models and optimizers).
        replica: this replica's index, which the peer names as its source.
    """
    return {
        "user": user_state(_objects(run, state)),
        "loop": run.loop.state_dict(),
        "rng": rng.rng_state(),
        "precision": run.precision.state_dict(),
        "modes": [mode.state_dict() for mode in run.modes],  # an infrequent sync's synced weights, ...
        "replica": replica,
    }


def apply_heal(run: RunState, state: MutableMapping[str, Any] | None, saved: Mapping[str, Any]) -> None:
    """Take a peer's :func:`heal_state`: this replica continues exactly where the peer stands."""
    source = f"peer of replica {int(saved.get('replica', -1))}"
    objects = _objects(run, state)
    restore_user_state(objects, saved["user"], source)
    if state is not None:
        for key in state:
            if not hasattr(state[key], "load_state_dict"):
                state[key] = objects[key]  # plain values
    run.loop.restore(saved["loop"], source=source, strict=True)
    rng.set_rng_state(saved["rng"])
    run.precision.load_state_dict(saved["precision"])
    modes = saved.get("modes") or []
    for mode, kept in zip(run.modes, modes):
        if kept is not None:
            mode.take_peer_state(kept, source)
    for model in run.models:
        unwrap(model).zero_grad(set_to_none=True)


__all__ = ["apply_heal", "heal_state"]
