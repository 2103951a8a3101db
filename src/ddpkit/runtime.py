"""The object a user script holds: its place in the world, its device, and the group's life.

Example:
    >>> import ddpkit
    >>> rt = ddpkit.init()          # a world of one under plain python
    >>> rt.world_size, rt.is_main
    (1, True)
    >>> rt.close()
"""

from __future__ import annotations

import atexit
import builtins
from typing import Any

import torch

from ddpkit import collectives, process_group
from ddpkit.env import Environment, detect

DEFAULT_TIMEOUT_S = 600.0

_current: "Runtime | None" = None


class Runtime:
    """Rank, device and backend of this process, and the collectives it may call.

    Create it with :func:`ddpkit.init`, not directly.
    """

    def __init__(self, env: Environment, device: torch.device, backend: str, timeout_s: float):
        self.env = env
        self.device = device
        self.backend = backend
        self.timeout_s = timeout_s
        self._closed = False

    # -- place in the world -------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def node_rank(self) -> int:
        return self.env.node_rank

    @property
    def launcher(self) -> str:
        return self.env.launcher

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the one process that prints, logs and saves."""
        return self.env.rank == 0

    @property
    def is_local_main(self) -> bool:
        """True on local rank 0 of each node: the one that prepares node-local files."""
        return self.env.local_rank == 0

    # -- talking ------------------------------------------------------------------------
    def print(self, *args: Any, all_ranks: bool = False, **kwargs: Any) -> None:
        """``print`` on rank 0 only (every rank, prefixed, with ``all_ranks=True``)."""
        kwargs.setdefault("flush", True)
        if all_ranks and self.world_size > 1:
            builtins.print(f"[rank {self.rank}]", *args, **kwargs)
        elif self.is_main or all_ranks:
            builtins.print(*args, **kwargs)

    def barrier(self) -> None:
        """Wait until every rank reaches this point."""
        process_group.barrier()

    def all_reduce(self, value: Any, op: str = "sum") -> Any:
        """Sum, mean, max or min of ``value`` across ranks (see :func:`ddpkit.all_reduce`)."""
        return collectives.all_reduce(value, op)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's rows concatenated in rank order; first dimensions may differ."""
        return collectives.all_gather(tensor)

    # -- life ---------------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the process group. Runs at exit too, also when the script raised."""
        global _current
        if self._closed:
            return
        self._closed = True
        process_group.destroy()
        if _current is self:
            _current = None

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Runtime(launcher={self.launcher!r}, rank={self.rank}, local_rank={self.local_rank}, "
            f"world_size={self.world_size}, device={str(self.device)!r}, backend={self.backend!r})"
        )


def init(
    *,
    backend: str | None = None,
    device: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Runtime:
    """Learn our place from the launcher, pick device and backend, and join the process group.

    Args:
        backend: ``"nccl"``, ``"gloo"`` or ``"mpi"``; chosen from the device when omitted.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; the local rank's GPU when CUDA is usable.
        timeout: seconds to wait for the master and for any collective.

    Returns:
        The :class:`Runtime`; calling ``init`` again returns the same one until it is closed.
    """
    global _current
    if _current is not None and not _current._closed:
        return _current
    env = detect()
    chosen_device = process_group.choose_device(env, device)
    chosen_backend = process_group.choose_backend(chosen_device, backend)
    if env.distributed:
        process_group.init(env, chosen_backend, chosen_device, timeout)
    runtime = Runtime(env, chosen_device, chosen_backend, timeout)
    _current = runtime
    atexit.register(runtime.close)
    return runtime


def current() -> Runtime | None:
    """The runtime made by the last :func:`init`, if it is still open."""
    return _current
