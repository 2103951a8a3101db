"""Every private torch API ddpkit uses, in one place, each with a test in tests/test_torch_private.py.

Private names can change in any torch release. Each function here either works or raises
:class:`PrivateApiChanged`, which names the API and the torch version; callers decide
whether a missing API is an error or a warned, recorded loss (never a silent one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class PrivateApiChanged(Exception):
    """A private torch API that ddpkit relies on is missing or behaves differently."""

    def __init__(self, api: str, detail: str = ""):
        super().__init__(
            f"torch {torch.__version__} changed the private API {api}"
            + (f" ({detail})" if detail else "")
            + "; ddpkit needs an update for this torch"
        )
        self.api = api


_WRAPPERS = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
"""The wrappers that hold the module they train in ``module``: a module of the user's own may name a
child ``module`` too (a backbone beside a head, ``AveragedModel``'s copy), which is not a wrapper."""


def _inner(obj: torch.nn.Module) -> torch.nn.Module | None:
    """The module a wrapper holds (``torch.compile``'s in the private ``_orig_mod``); None: not a wrapper."""
    inner = getattr(obj, "_orig_mod", None) if hasattr(obj, "_orig_mod") else None
    if inner is None and isinstance(obj, _WRAPPERS):
        inner = obj.module
    return inner if isinstance(inner, torch.nn.Module) else None


def wrapped_ddp(obj: Any) -> torch.nn.parallel.DistributedDataParallel | None:
    """The DDP model ``obj`` is or holds inside its wrappers (``torch.compile``'s), or None."""
    while isinstance(obj, torch.nn.Module):
        if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
            return obj
        obj = _inner(obj)
    return None


def unwrap(obj: Any) -> Any:
    """The module inside DDP / DataParallel / ``torch.compile``, so checkpoints hold plain names.

    ``torch.compile`` keeps the module it wraps in the private attribute ``_orig_mod``; DDP and
    DataParallel in ``module``. Anything else is returned as it is (a module of the user's own with
    a child named ``module`` included).
    """
    while isinstance(obj, torch.nn.Module):
        inner = _inner(obj)
        if inner is None:
            return obj
        obj = inner
    return obj


def wrapper_segments(module: torch.nn.Module) -> list[str]:
    """Where wrappers sit inside ``unwrap(module)``, as the name segments their own level adds
    (``"module.module"`` for ``AveragedModel(ddp_model)``), the deepest first.

    A module of the user's that holds a set-up model (``AveragedModel(model)`` around the DDP model
    ``rt.setup`` returned, an EMA of a compiled one) names its entries ``module.module.0.weight`` on
    2 processes and ``module.0.weight`` on one: a checkpoint of it would resume on its own world size
    only. Without the wrappers' own segments (``module.`` of DDP, ``_orig_mod.`` of ``torch.compile``,
    :func:`plain_name`) the names are the same on any.
    """
    segments = [
        f"{name}.{'_orig_mod' if hasattr(sub, '_orig_mod') else 'module'}"
        for name, sub in unwrap(module).named_modules()
        if name and _inner(sub) is not None
    ]
    return sorted(segments, key=len, reverse=True)


def plain_name(name: str, segments: list[str]) -> str:
    """``name`` (of a state entry, or a module's prefix) without the :func:`wrapper_segments` in it."""
    for segment in segments:
        if name == segment or name.startswith(segment + "."):
            name = segment.rpartition(".")[0] + name[len(segment) :]
    return name


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


def ready_order_ddp(module: torch.nn.Module, **kwargs: Any) -> torch.nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(module, **kwargs)`` whose reducer lists the parameters last first.

    Backward makes gradients ready roughly in reverse registration order (DDP's own assumption for
    its first buckets), so buckets settled in the reducer's order (:func:`settle_ddp_buckets`)
    then start with the last layers: the first bucket is reduced while backward still computes
    the earlier layers' gradients. DDP builds that list in ``_build_params_for_reducer``; the
    returned model is a subclass that reverses it (``isinstance(model, DistributedDataParallel)``
    holds). Where torch no longer builds the list there, :func:`settle_ddp_buckets` says so.
    """
    return _ReadyOrderDDP(module, **kwargs)


class _ReadyOrderDDP(torch.nn.parallel.DistributedDataParallel):
    """DDP with the reducer's parameters in reverse registration order; see :func:`ready_order_ddp`."""

    def _build_params_for_reducer(self):  # noqa: ANN202 (torch's private signature)
        parameters, expect_sparse = super()._build_params_for_reducer()
        self.__dict__["_ddpkit_reversed"] = True
        self.__dict__["_ddpkit_reducer_params"] = list(reversed(parameters))
        return list(reversed(parameters)), list(reversed(expect_sparse))


def reducer_parameter_names(model: Any) -> list[str] | None:
    """The names of a :func:`ready_order_ddp` model's parameters in its reducer's order: what the indices
    in DDP's "did not receive grad" error count (None: not such a model, or torch built the list elsewhere)."""
    params = model.__dict__.get("_ddpkit_reducer_params") if isinstance(model, _ReadyOrderDDP) else None
    if params is None:
        return None
    names = {id(p): name for name, p in model.module.named_parameters()}
    return [names.get(id(p), "?") for p in params]


def ddp_reduction_unfinished(model: Any) -> str | None:
    """torch's own error when a DDP model's last backward left some of its buckets unexchanged (a
    trainable parameter without a gradient), asked of the reducer before the next forward would raise
    it; None when that backward finished its exchange (or none ran).

    Raises:
        PrivateApiChanged: the reducer's ``_check_reducer_finalized`` is gone.
    """
    check = getattr(getattr(model, "reducer", None), "_check_reducer_finalized", None)
    if check is None:
        raise PrivateApiChanged("DistributedDataParallel.reducer._check_reducer_finalized")
    try:
        check()
    except RuntimeError as exc:
        return str(exc)
    return None


def settle_ddp_buckets(model: Any) -> None:
    """Re-bucket a DDP model's gradients now, in the reducer's parameter order, as DDP does in
    ready order after its first backward; with :func:`ready_order_ddp` that order is last layer first.

    A collective: every rank must call it. See :func:`ddpkit.parallel.ddp.settle_buckets` for why.

    Raises:
        PrivateApiChanged: the reducer's re-bucketing calls are gone, or a :func:`ready_order_ddp`
            model did not get its reversed parameter list (settling would put the first layers
            in the first bucket and lose the overlap).
    """
    if isinstance(model, _ReadyOrderDDP) and not model.__dict__.get("_ddpkit_reversed"):
        raise PrivateApiChanged("DistributedDataParallel._build_params_for_reducer", "not called at construction")
    reducer = getattr(model, "reducer", None)
    push = getattr(reducer, "_push_all_rebuilt_params", None)
    rebuild = getattr(reducer, "_rebuild_buckets", None)
    if push is None or rebuild is None:
        raise PrivateApiChanged("DistributedDataParallel.reducer._push_all_rebuilt_params/_rebuild_buckets")
    push()
    rebuild()


def ddp_bucket_count(model: Any) -> int:
    """How many buckets a DDP model's reducer allreduces per backward: one collective call each.

    The reducer lists its current buckets (after any re-bucketing, ddpkit's settling included)
    through the private ``_get_zeros_like_grad_buckets()``, one zero-filled bucket each.

    Raises:
        PrivateApiChanged: the method is gone or lists no bucket.
    """
    lister = getattr(getattr(model, "reducer", None), "_get_zeros_like_grad_buckets", None)
    if lister is None:
        raise PrivateApiChanged("DistributedDataParallel.reducer._get_zeros_like_grad_buckets")
    count = len(lister())
    if count < 1:
        raise PrivateApiChanged("DistributedDataParallel.reducer._get_zeros_like_grad_buckets", "no bucket listed")
    return count


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


def scaler_unscaled(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` ran since the scaler's last ``update()``.

    A script may unscale its optimizer's fp16 gradients itself (``rt.precision.scaler.unscale_``)
    before it clips them; only the scaler's per-optimizer record (``_per_optimizer_states``, its
    ``stage``) knows. Read without adding a record for an optimizer it never saw.
    """
    states = getattr(scaler, "_per_optimizer_states", None)
    stages = getattr(getattr(torch.amp, "grad_scaler", None), "OptState", None)
    if not isinstance(states, dict) or stages is None or not hasattr(stages, "UNSCALED"):
        raise PrivateApiChanged("torch.amp.GradScaler._per_optimizer_states / torch.amp.grad_scaler.OptState")
    state = states.get(id(optimizer))
    if state is None:
        return False
    if not isinstance(state, dict) or "stage" not in state:
        raise PrivateApiChanged("torch.amp.GradScaler._per_optimizer_states", f"an entry holds {state!r}")
    return bool(state["stage"] is stages.UNSCALED)


def dcp_metadata_path(reader: Any, rank: int | None = None) -> Any:
    """The ``.metadata`` file (``__RANK.metadata`` for ``rank``) a DCP ``FileSystemReader`` reads.

    ``FileSystemReader._get_metadata_path`` knows the name (``filesystem._metadata_fn``); ddpkit's
    reader reads that file itself, with an allowlist unpickler.
    """
    getter = getattr(reader, "_get_metadata_path", None)
    if getter is None:
        raise PrivateApiChanged("torch.distributed.checkpoint.FileSystemReader._get_metadata_path")
    return getter(rank)


def dcp_item_file(reader: Any, storage_index: Any) -> str:
    """The file (relative to the checkpoint) that holds DCP item ``storage_index``.

    The reader's ``storage_data`` maps each item to a private ``filesystem._StorageInfo``
    (``relative_path``, ``offset``, ``length``). For messages: which file wanted what.
    """
    info = getattr(reader, "storage_data", {}).get(storage_index)
    path = getattr(info, "relative_path", None)
    if not isinstance(path, str):
        raise PrivateApiChanged(
            "torch.distributed.checkpoint.filesystem._StorageInfo.relative_path",
            f"storage_data[{storage_index!r}] is {info!r}",
        )
    return path


def dcp_rebuilding_planner() -> type:
    """DCP's load planner that rebuilds the whole state dict from the metadata (no template needed).

    ``format_utils._EmptyStateDictLoadPlanner``, what ``dcp_to_torch_save`` uses to consolidate a
    checkpoint in one process; ddpkit subclasses it to read its non-tensor values safely.
    """
    from torch.distributed.checkpoint import format_utils

    planner = getattr(format_utils, "_EmptyStateDictLoadPlanner", None)
    if not isinstance(planner, type):
        raise PrivateApiChanged("torch.distributed.checkpoint.format_utils._EmptyStateDictLoadPlanner")
    return planner


def dcp_load_in_one_process(state_dict: dict[str, Any], reader: Any, planner: Any) -> None:
    """Load a DCP checkpoint into ``state_dict`` in this process alone, as ``dcp_to_torch_save`` does.

    ``state_dict_loader._load_state_dict(..., no_dist=True)``: the public ``dcp.load`` passes a
    copy of the state dict to the planner, so the state rebuilt by :func:`dcp_rebuilding_planner`
    would be lost.
    """
    from torch.distributed.checkpoint import state_dict_loader

    load = getattr(state_dict_loader, "_load_state_dict", None)
    if load is None:
        raise PrivateApiChanged("torch.distributed.checkpoint.state_dict_loader._load_state_dict")
    load(state_dict, storage_reader=reader, planner=planner, no_dist=True)


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


def use_env_rendezvous(handler: Any) -> None:
    """Make ``init_process_group()`` (``env://``, its default) rendezvous through ``handler``.

    torch offers ``register_rendezvous_handler`` for new schemes only; ``env://`` is registered at
    import, so its entry in ``torch.distributed.rendezvous._rendezvous_handlers`` is replaced. ddpkit
    does this in the workers of a one-machine job only, so that scripts calling
    ``init_process_group`` themselves use the job's private store instead of a ``TCPStore`` that
    rank 0 would host on every interface.
    """
    import importlib

    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the module: dist.rendezvous is a function
    handlers = getattr(rendezvous, "_rendezvous_handlers", None)
    if not isinstance(handlers, dict) or "env" not in handlers:
        raise PrivateApiChanged("torch.distributed.rendezvous._rendezvous_handlers['env']")
    handlers["env"] = handler


def elastic_signal_exception() -> type:
    """torch's ``SignalException``: what the elastic agent raises (and what ``torch.distributed.run``
    lets out) after it stopped its workers because it got SIGTERM, SIGUSR1 and the like; it carries
    ``sigval``. Used by ``ddpkit run`` to tell a preempted job from a failed one."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return SignalException


# -- torchft ------------------------------------------------------------------------------------

TORCHFT_SEAMS: dict[str, tuple[str, str, str]] = {
    "ManagerServer": ("torchft.manager", "ManagerServer", "self._manager = ManagerServer("),
    "ManagerClient": ("torchft.manager", "ManagerClient", "ManagerClient("),
    "TCPStore": ("torchft.manager", "TCPStore", "self._store = TCPStore("),
    "create_store_client": (
        "torchft.process_group",
        "create_store_client",
        "store = create_store_client(store_addr, timeout=self._timeout)",
    ),
}
"""The module globals of torchft that ddpkit replaces, each ``(module, name, how the code calls it)``.

torchft 0.2's ``Manager`` builds its gRPC server with ``bind=f"[::]:{port}"`` (every interface, no
option), its client, and its replica group's ``TCPStore`` from these names, and its process groups
open the store through ``create_store_client``; each is looked up in its module when it is
called, so replacing the global changes what torchft builds without copying any of its code.
:func:`patch_torchft` checks that the name is still there and still called that way."""


def torchft_group_error(manager: Any) -> Any:
    """The error torchft's reconfigurable process group holds and its ``Manager`` does not know yet.

    On NCCL a collective that times out is aborted in the background: the group records the error,
    and torchft's ``Manager`` copies it into its own ``errored()`` only in ``should_commit`` (torchft
    0.2: ``if err := self._pg.errored(): self.report_error(err)``). Until then a result read on the
    host may be undefined while ``errored()`` says nothing. torchft's NCCL group synchronizes the
    device here.

    Raises:
        PrivateApiChanged: the manager has no ``_pg`` with ``errored()``.
    """
    group = getattr(manager, "_pg", None)
    if group is None or not callable(getattr(group, "errored", None)):
        raise PrivateApiChanged("torchft.Manager._pg.errored", "torchft changed; ddpkit holds torchft<0.3")
    return group.errored()


def patch_torchft(**replacements: Any) -> dict[str, Any]:
    """Replace the torchft globals named in :data:`TORCHFT_SEAMS`; returns what they were.

    Example: ``patch_torchft(ManagerServer=bound_server)`` makes every torchft ``Manager`` built
    afterwards in this process call ``bound_server(...)`` with ``ManagerServer``'s keywords.

    Raises:
        PrivateApiChanged: torchft no longer has the name, or no longer calls it where ddpkit expects.
        KeyError: a name that is not a seam.
    """
    import importlib
    import inspect

    previous: dict[str, Any] = {}
    for key, replacement in replacements.items():
        module_name, name, call = TORCHFT_SEAMS[key]
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            raise PrivateApiChanged(f"{module_name}.{name}", "torchft changed; ddpkit holds torchft<0.3")
        if call not in inspect.getsource(module):
            raise PrivateApiChanged(f"{module_name}.{name}", f"torchft no longer calls {call.strip()!r}")
        previous[key] = getattr(module, name)
        setattr(module, name, replacement)
    return previous


def distributed_functions(op: str) -> list[tuple[Any, Any]]:
    """``(module, function)`` for each of ``torch.distributed`` and its ``distributed_c10d`` that defines ``op``.

    The collective functions are public; they live in the private module ``distributed_c10d``, whose
    own functions call each other there (``all_gather_object`` calls ``all_gather``), so a wrapper
    that must see every call replaces the name in both modules.
    """
    import torch.distributed as dist

    c10d = getattr(dist, "distributed_c10d", None)
    if c10d is None or not callable(getattr(c10d, op, None)):
        raise PrivateApiChanged(f"torch.distributed.distributed_c10d.{op}")
    return [(module, getattr(module, op)) for module in (dist, c10d) if callable(getattr(module, op, None))]


def collective_parameters(fn: Any) -> tuple[int | None, tuple[int, str] | None]:
    """Where a collective takes its ``group`` and its tensor: (position of ``group``, (position, name) of the tensor).

    The tensor is the one every rank passes with the same shape: ``tensor``, ``input_tensor`` or
    ``input``; None where there is none.
    """
    import inspect

    names = list(inspect.signature(inspect.unwrap(fn)).parameters)
    group = names.index("group") if "group" in names else None
    tensor = next(((i, n) for i, n in enumerate(names) if n in ("tensor", "input_tensor", "input")), None)
    return group, tensor


def is_default_group(group: Any) -> bool:
    """True for None or the default group (``torch.distributed.group.WORLD``)."""
    if group is None:
        return True
    import torch.distributed as dist

    return group is dist.group.WORLD


def flight_recorder_dump() -> dict[str, Any]:
    """torch's flight recorders of this process's collectives, unpickled: ``entries`` and ``pg_status``.

    Each entry has ``collective_seq_id``, ``profiling_name`` (``"nccl:all_reduce"``), ``input_sizes``,
    ``input_dtypes``, ``state`` and ``retired`` (its work is done). The recorders run where
    ``TORCH_FR_BUFFER_SIZE`` (or ``TORCH_NCCL_TRACE_BUFFER_SIZE``) is above 0. There are two: NCCL's,
    dumped by ``_dump_nccl_trace`` on a CUDA build, and on recent torch a general one (gloo),
    dumped by ``_dump_fr_trace``; both are private. This reads each that exists, NCCL's entries first.
    """
    merged: dict[str, Any] = {"entries": [], "pg_status": {}}
    for _, found in _recorder_dumps(collectives=True):
        merged["entries"] += list(found.get("entries", []))
        merged["pg_status"].update(found.get("pg_status", {}))
    return merged


def flight_recorder_status() -> dict[str, dict[str, Any]]:
    """Each recorded group's counters, without its entries: ``{"<dump>/<pg>": {"last_enqueued_collective":
    n, "last_completed_collective": m, ...}}`` from every recorder that exists (NCCL's first).

    A dump without the collectives (``includeCollectives=False``) costs microseconds where one with
    them copies and pickles the whole ring (25 to 45 ms at 2000 entries): the watchdog reads this
    each second and the entries only when it changed. The counters change with every collective
    enqueued, started or completed, so equal counters mean the same entries' states.
    """
    status: dict[str, dict[str, Any]] = {}
    for name, found in _recorder_dumps(collectives=False):
        groups = found.get("pg_status")
        if not isinstance(groups, dict):
            raise PrivateApiChanged(f"torch._C._distributed_c10d.{name}", "its dump has no pg_status dict")
        for group, counters in groups.items():
            status[f"{name}/{group}"] = dict(counters)
    return status


def _recorder_dumps(*, collectives: bool) -> list[tuple[str, dict[str, Any]]]:
    """Each flight recorder's dump as ``(function name, unpickled dict)``, its entries where ``collectives``."""
    import pickle

    c10d = torch._C._distributed_c10d
    dumps = [getattr(c10d, name) for name in ("_dump_nccl_trace", "_dump_fr_trace") if hasattr(c10d, name)]
    if not dumps:
        raise PrivateApiChanged("torch._C._distributed_c10d._dump_fr_trace")
    found = []
    for dump in dumps:
        try:
            raw = dump(includeCollectives=collectives, includeStackTraces=False, onlyActive=False)
        except RuntimeError:  # NCCL's recorder in a process that never made an NCCL group
            continue
        one = pickle.loads(raw)  # noqa: S301 - bytes torch made in this process, not read from anywhere
        if not isinstance(one, dict):
            raise PrivateApiChanged(f"torch._C._distributed_c10d.{dump.__name__}", "its dump is not a dict")
        found.append((dump.__name__, one))
    return found


FLIGHT_RECORDER_SIZE = "2000"
"""Collectives torch's flight recorder keeps per process where ddpkit turns it on."""


def flight_recorder_buffer_variable() -> str:
    """The variable that sizes torch's flight recorder: ``TORCH_FR_BUFFER_SIZE`` where torch has the
    renamed recorder (``_dump_fr_trace``), else ``TORCH_NCCL_TRACE_BUFFER_SIZE``."""
    c10d = torch._C._distributed_c10d
    if hasattr(c10d, "_dump_fr_trace"):
        return "TORCH_FR_BUFFER_SIZE"
    if hasattr(c10d, "_dump_nccl_trace"):
        return "TORCH_NCCL_TRACE_BUFFER_SIZE"
    raise PrivateApiChanged("torch._C._distributed_c10d._dump_fr_trace")


ELASTIC_WORKER_ENV = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMP_NUM_THREADS",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }
)
"""What torch's ``LocalElasticAgent._start_workers`` sets for each worker, besides ``TORCHELASTIC_*``."""


def set_by_elastic_agent(name: str) -> bool:
    """Whether torch's elastic agent sets the variable ``name`` for each worker it starts.

    The agent hands its workers their variables as a dict that torch's private ``_wrap`` copies
    into ``os.environ`` in the child; no public API names them.
    """
    return name in ELASTIC_WORKER_ENV or name.startswith("TORCHELASTIC_")


def version_of(tensor: torch.Tensor) -> int:
    """How many times ``tensor``'s memory was changed in place through torch's ops (its version
    counter, shared with its views and ``detach()``; ``.data`` gets a counter of its own).

    A background save compares it before and after copying a tensor behind the loop, so a change
    made meanwhile fails the save loudly instead of writing a torn copy.
    """
    version = getattr(tensor, "_version", None)
    if not isinstance(version, int):
        raise PrivateApiChanged("torch.Tensor._version")
    return version


def collective_sequence() -> int | None:
    """How many collectives and point-to-point calls this process ran on the default process group:
    its backend's sequence number, which gloo counts for every call and nccl for every collective.

    None where no default group of more than one process is up, or its backend keeps no such count
    (only gloo's and nccl's do); a group of one gathers nothing from another rank.

    Raises:
        PrivateApiChanged: the group has no ``_get_sequence_number_for_group``.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    group = dist.group.WORLD
    if dist.get_backend(group) not in ("gloo", "nccl"):
        return None
    counted = getattr(group, "_get_sequence_number_for_group", None)
    if counted is None:
        raise PrivateApiChanged("torch.distributed.ProcessGroup._get_sequence_number_for_group")
    return int(counted())


def load_pre_hook(module: torch.nn.Module, hook: Callable[..., None]) -> Any:
    """Register ``hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors)``
    to run before ``module`` loads a state dict; its handle.

    ``Module.register_load_state_dict_pre_hook`` is public from torch 2.5; torch 2.4 has the private
    ``_register_load_state_dict_pre_hook(hook, with_module=True)`` that the public one calls.
    """
    public = getattr(module, "register_load_state_dict_pre_hook", None)
    if public is not None:
        return public(hook)
    private = getattr(module, "_register_load_state_dict_pre_hook", None)
    if private is None:
        raise PrivateApiChanged("torch.nn.Module._register_load_state_dict_pre_hook")
    return private(hook, with_module=True)


def module_buffers(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s own buffers by name, the dict itself (``Module._buffers``): a buffer put there is the
    one the module's forward reads, without ``Module.__setattr__``'s checks (micro-shards swap BatchNorm's
    statistics around each shard's forward, 20 layers a shard: a millisecond a step through ``__setattr__``)."""
    buffers = module.__dict__.get("_buffers")
    if not isinstance(buffers, dict):
        raise PrivateApiChanged("torch.nn.Module._buffers")
    return buffers


def scale_add_(targets: list[torch.Tensor], sources: list[torch.Tensor], keep: float, alpha: float) -> None:
    """``t.mul_(keep).add_(s, alpha=alpha)`` for each pair, in two calls for the lists (``torch._foreach_mul_``
    and ``torch._foreach_add_``) rather than two a pair: BatchNorm's running statistics, 20 layers a shard."""
    mul, add = getattr(torch, "_foreach_mul_", None), getattr(torch, "_foreach_add_", None)
    if mul is None or add is None:
        raise PrivateApiChanged("torch._foreach_mul_ / torch._foreach_add_")
    if targets:
        mul(targets, keep)
        add(targets, sources, alpha=alpha)


_TERMINATE_SYMBOL = "_ZSt13set_terminatePFvvE"  # std::set_terminate(void (*)()), as the Itanium C++ ABI names it
_CXX_RUNTIMES = (None, "libstdc++.so.6", "libc++abi.dylib", "libc++abi.so.1")
"""Where ``std::set_terminate`` is looked up: the process's own symbols, then libstdc++ (torch's on Linux),
then libc++ (macOS's); a runtime already loaded is the one returned."""


def on_cpp_terminate(handler: Callable[[], None]) -> Callable[[], None]:
    """Run ``handler`` when torch's C++ ends the process by ``std::terminate``, before the handler that
    was there (which prints the exception and aborts); returns the undo.

    ``std::terminate`` is what a C++ exception that no frame catches ends in: gloo's size check
    ("Received data size doesn't match expected size") throws in its transport thread, which only
    the C++ runtime sees. ``handler`` runs in that thread, with the GIL (ctypes takes it); a handler
    that ends the process itself (``os._exit``) never comes back. Not torch's API but the C++
    runtime's (``std::set_terminate``, through ctypes), kept here beside torch's: as private to Python
    as they are.

    Raises:
        PrivateApiChanged: no C++ runtime of this process has ``std::set_terminate``.
    """
    import ctypes

    setter = None
    for library in _CXX_RUNTIMES:
        try:
            setter = getattr(ctypes.CDLL(library), _TERMINATE_SYMBOL)
            break
        except (OSError, AttributeError):
            continue
    if setter is None:
        raise PrivateApiChanged("std::set_terminate", "no C++ runtime of this process has it")
    setter.restype, setter.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    kind = ctypes.CFUNCTYPE(None)

    def terminating() -> None:
        try:
            handler()
        finally:  # the handler that was there prints the exception and aborts; without one, abort
            if previous:
                kind(previous)()
            ctypes.CDLL(None).abort()

    callback = kind(terminating)
    ours = ctypes.cast(callback, ctypes.c_void_p).value
    previous = setter(ours)

    def undo() -> None:
        now = setter(previous)
        if now != ours:  # a handler set after ours stays
            setter(now)
        undo.__dict__.pop("callback", None)  # (ctypes calls through it until here)

    undo.__dict__["callback"] = callback
    return undo


def dataloader_worker_pids(iterator: Any) -> list[int]:
    """The pids of the live worker processes of ``iterator``, a DataLoader's pass read by workers (torch's
    private ``_workers``).

    Raises:
        PrivateApiChanged: ``iterator`` does not list them where it did.
    """
    workers = getattr(iterator, "_workers", None)
    if not isinstance(workers, list) or not all(
        hasattr(worker, "pid") and hasattr(worker, "is_alive") for worker in workers
    ):
        raise PrivateApiChanged("DataLoader iterator._workers", "a list of the worker processes")
    return [worker.pid for worker in workers if worker.is_alive()]
