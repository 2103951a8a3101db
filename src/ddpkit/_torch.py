"""Every private torch API ddpkit uses, in one place, each with a test in tests/test_torch_private.py.

Private names can change in any torch release. Each function here either works or raises
:class:`PrivateApiChanged`, which names the API and the torch version; callers decide
whether a missing API is an error or a warned, recorded loss (never a silent one).
"""

from __future__ import annotations

from typing import Any

import torch


class PrivateApiChanged(Exception):
    """A private torch API that ddpkit relies on is missing or behaves differently."""

    def __init__(self, api: str, detail: str = ""):
        super().__init__(f"torch {torch.__version__} changed the private API {api}"
                         + (f" ({detail})" if detail else "") + "; ddpkit needs an update for this torch")
        self.api = api


def default_store() -> Any:
    """The c10d store of the default process group (the launcher's TCPStore).

    ddpkit uses it for small out-of-band messages that must not be collectives: who reached
    a save, which rank is stuck, who prepared a node's files.
    """
    import torch.distributed as dist

    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        raise PrivateApiChanged("torch.distributed.distributed_c10d._get_default_store")
    return getter()


def settle_ddp_buckets(model: Any) -> None:
    """Re-bucket a DDP model's gradients now, in parameter order, as DDP does after its first backward.

    A collective: every rank must call it. See :func:`ddpkit.replicate.settle_buckets` for why.
    """
    reducer = getattr(model, "reducer", None)
    push = getattr(reducer, "_push_all_rebuilt_params", None)
    rebuild = getattr(reducer, "_rebuild_buckets", None)
    if push is None or rebuild is None:
        raise PrivateApiChanged("DistributedDataParallel.reducer._push_all_rebuilt_params/_rebuild_buckets")
    push()
    rebuild()


def scaler_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the last ``scaler.step(optimizer)`` skipped the step (inf/nan gradients).

    ``GradScaler.step`` returns None both when it steps and when it skips; its per-optimizer
    record is the only place that knows, before ``update()`` forgets it.
    """
    found = getattr(scaler, "_found_inf_per_device", None)
    if found is None:
        raise PrivateApiChanged("torch.amp.GradScaler._found_inf_per_device")
    try:
        per_device = found(optimizer)
    except (AssertionError, KeyError) as exc:
        raise PrivateApiChanged("torch.amp.GradScaler._found_inf_per_device", repr(exc)) from None
    return bool(sum(float(value.item()) for value in per_device.values()))


class worker_info_hidden:
    """Inside a DataLoader worker, make ``get_worker_info()`` return None for the code run here.

    Streams split themselves between workers when they see worker info (torch's documented
    pattern, Hugging Face's ``IterableDataset``); ddpkit splits streams itself, so the user's
    stream must yield all of it. ``get_worker_info`` returns the module global ``_worker_info``.
    A class, not a generator: it wraps every sample read.
    """

    def __init__(self) -> None:
        from torch.utils.data._utils import worker

        if not hasattr(worker, "_worker_info"):
            raise PrivateApiChanged("torch.utils.data._utils.worker._worker_info")
        self._module = worker
        self._saved = None

    def __enter__(self) -> None:
        self._saved = self._module._worker_info
        self._module._worker_info = None

    def __exit__(self, *exc: object) -> None:
        self._module._worker_info = self._saved
