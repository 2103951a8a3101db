"""While a fault-tolerant job runs: watch its replicas, its lighthouse and node 0; stop the replicas so that none trains apart from the others."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ddpkit.distributed import ft, ft_calls
from ddpkit.errors import EXIT_MISMATCH

if TYPE_CHECKING:
    from ddpkit.distributed.ft_launch import FaultTolerantSpec


FINISH_GRACE_S = 120.0
"""How long the other replicas get to finish once one has (they end at the same step; this is their
last evaluation and saving) before they are stopped."""
MISMATCH_GRACE_S = 1.0
"""How long the replicas get to say their line after one reported a collective mismatch, before they
are stopped (their agents would restart them, to call the same collectives again)."""
STOP_GRACE_S = 10.0
"""How long replicas get to end after SIGTERM before they are killed."""
NODE_SILENT_S = 15.0
"""Node 0 takes another node for gone when its last beat into the job's store is this old."""
NODE_JOIN_S = 120.0
"""How long node 0 waits for another node's first beat, and another node for node 0's store."""


def watch(
    spec: FaultTolerantSpec, replicas: Sequence[subprocess.Popen], lighthouse: subprocess.Popen | None, store: Any
) -> int | None:
    """Wait for this node's replicas; an exit code when the job must stop (its lighthouse or node 0 is gone).

    Args:
        spec: the job (its nodes, replicas and timeouts).
        replicas: this node's replica processes.
        lighthouse: the lighthouse this node started (node 0), or None.
        store: the job's store: where a finished job is marked, and where the other nodes beat for node 0.

    Returns:
        None once every replica has exited or the job has finished; 1 when the lighthouse or node 0
        is gone, :data:`~ddpkit.errors.EXIT_MISMATCH` when a replica found a collective mismatch (the
        caller stops the replicas: a restarted one would only call the same collectives again).
    """
    finished_at: float | None = None
    mismatch_at: float | None = None
    beat = 0.0
    while any(child.poll() is None for child in replicas):
        now = time.monotonic()
        if lighthouse is not None and lighthouse.poll() is not None:
            sys.stderr.write(
                f"ddpkit run: the fault-tolerant lighthouse exited (code {lighthouse.returncode}); "
                "stopping every replica so that none trains apart from the others\n"
            )
            return 1
        if mismatch_at is not None:  # the store no more: node 0's launcher may be gone with it already
            if now - mismatch_at > MISMATCH_GRACE_S:
                break
            time.sleep(0.2)
            continue
        try:
            if ft_calls.marked(store):
                mismatch_at = now
                continue
            if finished_at is None and (any(child.poll() == 0 for child in replicas) or ft.is_done(store)):
                ft.mark_done(store)  # a replica restarted from now on ends at once
                finished_at = now
            if lighthouse is None and spec.nnodes > 1 and now - beat >= 1.0:
                store.set(f"ddpkit/ft/beat/{spec.node_rank}", str(time.time()))
                beat = now
        except (RuntimeError, OSError) as exc:  # only another node's client can lose the store
            sys.stderr.write(
                f"ddpkit run: lost node 0 of the fault-tolerant job, and its lighthouse, at "
                f"{spec.master} ({ft._first_line(exc)}); stopping this node's replicas so "
                "that none trains apart from the others\n"
            )
            return 1
        if finished_at is not None and now - finished_at > FINISH_GRACE_S:
            return None  # the rest are stopped by the caller
        time.sleep(0.2)
    if mismatch_at is not None or _marked(store):
        sys.stderr.write(
            f"ddpkit run: replicas called different collectives (the report above); stopping every replica, "
            f"exit code {EXIT_MISMATCH}\n"
        )
        return EXIT_MISMATCH
    return None


def _marked(store: Any) -> bool:
    """Whether a replica reported a collective mismatch (False where node 0's store is gone already)."""
    try:
        return ft_calls.marked(store)
    except (RuntimeError, OSError):
        return False


def wait_for_nodes(spec: FaultTolerantSpec, store: Any, lighthouse: subprocess.Popen | None) -> None:
    """Node 0: keep the lighthouse up until every other node has ended or gone silent."""
    started = time.monotonic()
    waiting = set(range(1, spec.nnodes))
    while waiting and (lighthouse is None or lighthouse.poll() is None):
        for node in sorted(waiting):
            if store.check([f"ddpkit/ft/exit/{node}"]):
                waiting.discard(node)
            elif store.check([f"ddpkit/ft/beat/{node}"]):
                if time.time() - float(store.get(f"ddpkit/ft/beat/{node}").decode()) > NODE_SILENT_S:
                    sys.stderr.write(f"ddpkit run: node {node} went silent; not waiting for it\n")
                    waiting.discard(node)
            elif time.monotonic() - started > NODE_JOIN_S:
                sys.stderr.write(f"ddpkit run: node {node} never joined; not waiting for it\n")
                waiting.discard(node)
        time.sleep(0.5)


def end_lighthouse(lighthouse: subprocess.Popen) -> None:
    """Stop the job's lighthouse: SIGTERM, then SIGKILL after 5 seconds."""
    if lighthouse.poll() is None:
        lighthouse.terminate()
        try:
            lighthouse.wait(5)
        except subprocess.TimeoutExpired:
            lighthouse.kill()


def stop_replicas(children: Sequence[subprocess.Popen], *, at_once: bool = False) -> None:
    """SIGTERM each live replica (its agent stops its worker), SIGKILL what is left after the grace:
    the agent and its worker, which torch starts in a session of its own. ``at_once``: SIGKILL them
    all now (after a collective mismatch there is nothing to save, and a SIGTERM's lines would say so)."""
    import psutil

    live = [child for child in children if child.poll() is None]
    family: list[Any] = []
    for child in live:
        try:
            mine = psutil.Process(child.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            mine = []
        family += mine
        if at_once:
            for process in mine:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            child.kill()
        else:
            child.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for child in live:
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    for process in family:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except psutil.TimeoutExpired:
            process.kill()
        except psutil.NoSuchProcess:
            pass


__all__ = [
    "FINISH_GRACE_S",
    "MISMATCH_GRACE_S",
    "NODE_JOIN_S",
    "NODE_SILENT_S",
    "STOP_GRACE_S",
    "end_lighthouse",
    "stop_replicas",
    "wait_for_nodes",
    "watch",
]
