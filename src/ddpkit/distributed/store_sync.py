"""Meeting points through the launcher's store: who arrived, and how rank 0's work went.

A collective called on one rank only waits for the others until the collective timeout (ten
minutes by default), then fails with a message that names neither the call nor the ranks.
``rt.save`` and ``rt.load`` gather every rank's random state, so ``if rt.is_main: rt.save(...)``
would do exactly that. :func:`all_arrive` checks first, through the store, with a short
timeout, and names the call and the ranks that did not come. :func:`share_outcome` lets rank 0
tell every rank at once that its write failed, instead of leaving them in a barrier.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

from ddpkit._torch import default_store
from ddpkit.distributed import collectives
from ddpkit.errors import DdpkitError, UsageError

_count: dict[str, int] = {}
_scope = "none"


def begin(scope: str) -> None:
    """Start counting meetings anew under ``scope``, a token every rank of this group agrees on.

    ``ddpkit.init`` broadcasts one from rank 0. Keys from an earlier attempt of a restarted job
    (the agent's store may outlive it) then never count, and nodes need not agree on anything
    else: torchrun's restart count, for one, differs between nodes after one node's worker failed.
    """
    global _scope
    _scope = scope
    _count.clear()


def _prefix(what: str) -> str:
    number = _count[what] = _count.get(what, 0) + 1
    return f"ddpkit/meet/{_scope}/{what}/{number}"


def all_arrive(what: str, timeout_s: float, part: bytes = b"1") -> str:
    """Wait until every rank calls ``what`` (its n-th call), or raise naming the ranks that did not.

    ``part``: what this rank brings to the meeting (a few kilobytes), for rank 0 to take with
    :func:`take_parts`; it stays in the launcher's store when the rank dies right after.

    Returns the key prefix of this meeting, for :func:`share_outcome`.

    Raises:
        UsageError: some rank did not reach ``what`` within ``timeout_s`` seconds.
    """
    prefix = _prefix(what)
    world, me = collectives.world_size(), collectives.rank()
    if world == 1:
        return prefix

    store = default_store()
    store.set(f"{prefix}/rank{me}", part)
    if store.add(f"{prefix}/count", 1) == world:
        store.set(f"{prefix}/all", "1")
    try:
        store.wait([f"{prefix}/all"], timedelta(seconds=timeout_s))
    except RuntimeError:  # DistStoreError: the others did not come
        missing = [r for r in range(world) if not store.check([f"{prefix}/rank{r}"])]
        shown = ", ".join(map(str, missing)) or "?"
        raise UsageError(
            f"rt.{what} must be called on every rank, but rank(s) {shown} did not reach it within "
            f"{timeout_s:.0f} s (it gathers each rank's random state): call rt.{what} outside "
            "`if rt.is_main:`; ddpkit writes on rank 0 only"
        ) from None
    return prefix


def take_parts(prefix: str) -> list[bytes]:
    """Rank 0, after :func:`all_arrive`: every other rank's ``part`` of the meeting ``prefix``, in
    rank order, removed from the store as they are read (a long run's meetings would pile up)."""
    if collectives.world_size() == 1:
        return []
    store = default_store()
    found = []
    for rank in range(1, collectives.world_size()):
        key = f"{prefix}/rank{rank}"
        found.append(store.get(key))
        store.delete_key(key)
    return found


_USAGE = "\x1fusage\x1f"  # an outcome that is the script's mistake: every rank says it as rank 0 does


def share_outcome(prefix: str, error: str | None, timeout_s: float, *, usage: bool = False) -> None:
    """Rank 0 posts ``error`` (None: it went well); every other rank waits for it and raises on failure.

    Args:
        prefix: the meeting's key in the store (its outcome goes under ``prefix/outcome``).
        error: rank 0's outcome, None where it went well (ignored on the other ranks).
        timeout_s: how long the other ranks wait for it.
        usage: the error is the script's (a :class:`UsageError`, exit 2), raised the same on every rank.

    Raises:
        DdpkitError: on ranks other than 0, when rank 0 reported ``error``.
        UsageError: the same, where rank 0 reported it as ``usage``.
    """
    if collectives.world_size() == 1:
        return

    store = default_store()
    key = f"{prefix}/outcome"
    if collectives.rank() == 0:
        store.set(key, "" if error is None else (_USAGE if usage else "") + error)
        return
    store.wait([key], timedelta(seconds=timeout_s))
    text = store.get(key).decode()
    if text.startswith(_USAGE):
        raise UsageError(text[len(_USAGE) :])
    if text:
        raise DdpkitError(f"rank 0 failed: {text}")


@contextlib.contextmanager
def local_main_first(node_rank: int, is_local_main: bool, count: int) -> Iterator[None]:
    """Local rank 0 of node ``node_rank`` runs the block first; the node's other ranks wait, then run it.

    ``count`` numbers this block among the script's calls (the same on every rank of the node).
    Local rank 0 marks the block done also when it fails, so the others go on to fail on their own.
    """
    key = f"ddpkit/local_main_first/node{node_rank}/{count}"
    store = default_store()
    if is_local_main:
        try:
            yield
        finally:
            store.set(key, "done")
    else:
        store.wait([key])
        yield
