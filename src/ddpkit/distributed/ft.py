"""Per-step fault tolerance on torchft: replicas that drop out and heal while the others go on.

``ddpkit run --fault-tolerant -n N script.py`` starts torchft's lighthouse and N replicas, each a
one-process ``ddpkit run`` of its own whose elastic agent restarts it when it dies. In each
replica, :func:`ddpkit.init` sees :data:`LIGHTHOUSE_ENV` and builds a :class:`Replica`: a
torchft ``Manager`` with a reconfigurable gloo (or NCCL) process group over the replicas.

At every step the replicas form a quorum (:meth:`Replica.quorum`); the step's global batch is
split over the replicas in it (``ddpkit.loop.loader``), their gradients are averaged through the
manager (:meth:`Replica.average`), and the step is applied only where every participant agrees
it completed (:meth:`Replica.should_commit`); otherwise it is redone on the next quorum. Before
each of its collectives, the participants compare which call each makes
(:meth:`Replica.announce`, :mod:`ddpkit.distributed.ft_calls`): a mismatch is named, not paired. A
replica that joins late, or comes back after a crash, heals at its first quorum from a live peer:
the peer sends its state (weights, optimizer, loop position, RNGs, scaler) through
:class:`SafeTransport`, which loads with ``weights_only=True`` (tensors and plain containers:
nothing a network peer sends can run code) and listens on this machine's address only.

What this module leaves to torchft: the lighthouse, quorums, membership, the reconfigurable
process groups and the commit vote. It writes none of them.

Example:
    >>> active({})
    False
    >>> replica_index({"DDPKIT_FT_REPLICA": "2"})
    2
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch

from ddpkit import _torch
from ddpkit.distributed import ft_calls, ft_control, ft_proxies, stores
from ddpkit.distributed.ft_heal import REFUSALS_BEFORE_STOP, SECRET_ENV, HealRefused, read_secret, transport
from ddpkit.distributed.host import host_port
from ddpkit.errors import EXIT_MISMATCH, DdpkitError, UsageError, user_line, warn

LIGHTHOUSE_ENV = "DDPKIT_FT_LIGHTHOUSE"
"""The lighthouse's address (``http://HOST:PORT``), set by ``ddpkit run --fault-tolerant``."""
REPLICA_ENV = "DDPKIT_FT_REPLICA"
"""This replica's index, 0 to N-1."""
REPLICAS_ENV = "DDPKIT_FT_REPLICAS"
"""How many replicas the job started."""
MIN_REPLICAS_ENV = "DDPKIT_FT_MIN_REPLICAS"
"""The fewest replicas a step may commit with."""
HOST_ENV = "DDPKIT_FT_HOST"
"""The address this replica's servers listen on and tell peers (127.0.0.1 on one machine)."""
JOB_STORE_ENV = "DDPKIT_FT_JOB_STORE"
"""The job's own store, where a replica that finished the job says so (:func:`mark_done`): a replica
restarted after that has nothing to heal from and nothing left to do. ``file:PATH`` on one
machine (a torch ``FileStore`` in a directory only the user can open), ``tcp:HOST:PORT`` across
hosts (a ``TCPStore`` on node 0, beside the lighthouse)."""
DONE_KEY = "ddpkit/ft/done"
"""The key a finished replica sets in the job's store."""
QUORUM_TIMEOUT_ENV = "DDPKIT_FT_QUORUM_TIMEOUT"
"""Seconds a replica waits for a quorum of ``--min-replicas`` before it stops."""
SHARED_GPU_ENV = "DDPKIT_FT_SHARED_GPUS"
"""Set where a node's replicas outnumber its GPUs, as ``REPLICAS:GPUS``: they share GPUs round robin,
which a replica training on CUDA refuses (NCCL runs one rank a GPU)."""

HEARTBEAT_TIMEOUT_MS = 2000
"""How long the lighthouse waits for a replica's heartbeat before it leaves it out of quorums."""
QUORUM_TICK_MS = 100
"""How often the lighthouse checks for a quorum."""
JOIN_TIMEOUT_MS = 60000
"""How long the lighthouse waits for a live replica (one still heartbeating) that has not asked for
this step's quorum yet, before it forms a smaller one. A dead replica stops heartbeating and is
left out after :data:`HEARTBEAT_TIMEOUT_MS` whatever this says. At 10 s, on 3 hosts at 100 Mbit/s
with ResNet-18, a replica still taking a peer's state (90 MB, 7 s on that link) next to the step's
allreduce arrived after it: it was left out, had to heal again at the next step, and the job ran
at 2 of 3 replicas with a 10 s wait in every step."""


def active(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a replica of a fault-tolerant job."""
    environ = os.environ if environ is None else environ
    return bool(environ.get(LIGHTHOUSE_ENV))


def replica_index(environ: Mapping[str, str] | None = None) -> int:
    """This replica's index (0 when unset)."""
    environ = os.environ if environ is None else environ
    return int(environ.get(REPLICA_ENV, "0"))


def job_store(where: str, timeout_s: float = 60.0) -> Any:
    """A client of the job's store :data:`JOB_STORE_ENV` names (``file:PATH`` or ``tcp:HOST:PORT``).

    Raises:
        UsageError: ``where`` is neither.
    """
    import torch.distributed as dist

    kind, _, rest = where.partition(":")
    if kind == "file" and rest:
        return dist.FileStore(rest, -1)
    host, sep, port = rest.rpartition(":")
    if kind == "tcp" and sep and port.isdigit():
        return dist.TCPStore(
            host.strip("[]"), int(port), None, False, timedelta(seconds=timeout_s), wait_for_workers=False
        )
    raise UsageError(f"{JOB_STORE_ENV}={where!r}: expected file:PATH or tcp:HOST:PORT")


def is_done(store: Any) -> bool:
    """Whether a replica has finished the job (:func:`mark_done`)."""
    return bool(store.check([DONE_KEY]))


def mark_done(store: Any) -> None:
    """Say in the job's store that a replica ran the script to its end."""
    store.set(DONE_KEY, "1")


def check_installed() -> None:
    """Refuse in one line where torchft is not installed."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise UsageError("--fault-tolerant needs torchft: pip install 'ddpkit[ft]'") from None


def _bound_server(host: str) -> Callable[..., Any]:
    """torchft's ``ManagerServer``, listening on ``host`` (torchft 0.2 binds ``[::]``: every interface)."""
    from torchft._torchft import ManagerServer

    def make(**kwargs: Any) -> Any:
        kwargs["bind"] = host_port(host, int(str(kwargs["bind"]).rsplit(":", 1)[-1]))
        return ManagerServer(**kwargs)

    return make


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


class Replica:
    """This process's part in a fault-tolerant job: torchft's ``Manager`` and what ddpkit asks of it.

    Args:
        state: returns what a healing peer needs (called by torchft when a peer is behind).
        load: applies such a state here (called by torchft when this replica heals).
        device: where training runs (gloo for CPU, NCCL for CUDA).
        seeded: every replica builds the same model from the seed (no sync at step 0).
        timeout_s: how long a collective or a heal may take.
        environ: the environment ``ddpkit run --fault-tolerant`` set.
    """

    def __init__(
        self,
        state: Callable[[], Any],
        load: Callable[[Any], None],
        *,
        device: torch.device,
        seeded: bool,
        timeout_s: float = 60.0,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        environ = os.environ if environ is None else environ
        if device.type == "cuda" and environ.get(SHARED_GPU_ENV):
            replicas, _, gpus = environ[SHARED_GPU_ENV].partition(":")
            raise UsageError(
                f"ddpkit run --fault-tolerant: {replicas} replicas share this node's {gpus} GPU(s), and NCCL "
                f"cannot run two replicas on one GPU: start at most {gpus} a node (-n {gpus}), or train "
                "with device='cpu'"
            )
        check_installed()
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        manager_log = logging.getLogger("torchft.manager")
        if device.type != "cuda":  # its warning that NCCL's flight recorder cannot reset, each quorum
            manager_log.setLevel(logging.ERROR)
        manager_log.addFilter(_not_refused)  # a refused heal is one line of ddpkit's, not torchft's traceback
        self.index = replica_index(environ)
        self.device = device
        """Where the quorum's collectives run (NCCL's take CUDA tensors only)."""
        self.replicas = int(environ.get(REPLICAS_ENV, "1"))
        self.min_replicas = int(environ.get(MIN_REPLICAS_ENV, "1"))
        host = environ.get(HOST_ENV, "127.0.0.1")
        timeout = timedelta(seconds=timeout_s)
        quorum_timeout = timedelta(seconds=float(environ.get(QUORUM_TIMEOUT_ENV, "60")))
        secret = read_secret(environ[SECRET_ENV]) if environ.get(SECRET_ENV) else None
        if secret is None:
            raise UsageError(
                f"a fault-tolerant replica needs the job's secret ({SECRET_ENV}); start it with "
                "ddpkit run --fault-tolerant"
            )
        private = environ.get(ft_control.CONTROL_ENV)
        if private:  # one machine: torchft's servers in the control plane, the stores in files
            ft_proxies.install(private)
            store_addr, store_port = ft_control.STORE_HOST, self.index + 1
        else:  # across hosts: on this node's address only, not torchft's [::]
            _torch.patch_torchft(ManagerServer=_bound_server(host))
            self._store = stores.serve(host, 0, timeout_s=timeout_s)  # this replica group's own store
            store_addr, store_port = host, self._store.port

        # a peer's state is about the size of this replica's own; 4x leaves room for optimizer state
        # that this replica has not made yet (its first quorum), and no more
        def limit():
            return 4 * _tensor_bytes(state()) + (64 << 20)

        self.transport = transport(host, timeout, secret, limit, name=f"replica {self.index}")

        def start() -> Any:
            pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
            manager = Manager(
                pg=pg,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=self.min_replicas,
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=quorum_timeout,
                connect_timeout=timeout,
                rank=0,
                world_size=1,
                store_addr=store_addr,
                store_port=store_port,
                lighthouse_addr=environ[LIGHTHOUSE_ENV],
                replica_id=f"replica_{self.index}",
                hostname=host,
                checkpoint_transport=self.transport,
                init_sync=not seeded,
            )
            manager.register_state_dict_fn("ddpkit", load, state)
            return manager

        # Made at the first quorum: a replica heartbeats to the lighthouse only once it is ready to
        # train, so the others never wait for one that is still building its model and data.
        self._start = start
        self._manager: Any = None
        self._job_where = environ.get(JOB_STORE_ENV)
        self._job: Any = None
        self.healed = False
        self.before_stop: Callable[[], Any] | None = None
        """Called when no quorum forms, before this replica stops: saves what it holds (the path, or None)."""
        self.at_pass_end: list[Callable[[], None]] = []
        """Called in the quorum a loader forms at the end of its pass, which no step follows: what is due
        between steps is done there (an infrequent sync's exchange), so the evaluation after an epoch sees it."""
        self.first_quorum: Callable[[bool], None] | None = None
        """Called once, after the first quorum, with whether a peer's state healed this replica."""
        self.rank: int = 0
        self.participants: int = 1
        self.whole_batches = False
        """Each replica reads the step's whole global batch (micro-shards, shared out by the quorum),
        rather than its part of it."""
        self._in_quorum = False
        self._backward = False  # a backward ran in the quorum in hand (its gradients await rt.step)
        self._checks = 0  # this step's checked calls (announce)
        self._run: tuple[str, int] | None = None  # the run of calls checked at its first (announce): name, place
        self._quiet = 0  # inside one call checked as a whole (as_one)

    @property
    def manager(self) -> Any:
        """torchft's ``Manager`` of this replica (started on first use)."""
        if self._manager is None:
            self._manager = self._start()
        return self._manager

    def join_first(self) -> None:
        """Join the first quorum now, unless one was joined (healing from a peer that is ahead, or
        resuming from the checkpoint): the training loop then starts where the job stands. The
        loader's first :meth:`quorum` is this one, whose step its batch begins."""
        if self._manager is None:
            self.quorum()

    def note_backward(self) -> None:
        """A backward ran in the quorum in hand: the next batch must wait for its step's commit."""
        self._backward = True

    def quorum(self) -> tuple[int, int]:
        """Join this step's quorum (healing first if this replica is behind); (rank, participants).

        A quorum joined already and not committed is this step's (joined before the loop, a probed
        batch, a second loader's batch of the same step): it is kept, not formed anew, which would
        leave the replicas in quorums of different steps.

        Raises:
            DdpkitError: no quorum formed in time (too few live replicas, or no lighthouse).
            UsageError: a batch after a backward of the quorum in hand (accumulation over batches).
        """
        if self._in_quorum:
            if self._backward:
                raise UsageError(
                    "rt.loader under --fault-tolerant: a batch came after rt.backward and before rt.step; each "
                    "batch is one step of the replicas' quorum, and accumulating over batches is not built yet: "
                    "call rt.step after each batch's backward, and raise global_batch_size instead"
                )
            return self.rank, self.participants
        if self._manager is None and self._mismatched_before():  # (a first quorum: one store read a process)
            raise SystemExit(EXIT_MISMATCH)  # restarted after a collective mismatch: the report is above
        if self._job_finished():
            # another replica finished the job: this one is behind (restarted late) and has nobody
            # to heal from; training on alone would only redo the job
            print(f"ddpkit: replica {self.index}: the job finished without it; nothing left to do", flush=True)
            raise SystemExit(0)
        before = self.manager.current_step()
        try:
            self.manager.start_quorum()
        except Exception as exc:  # torchft raises its RPC errors as they come
            saved = self.before_stop() if self.before_stop is not None else None
            kept = f"; saved {saved}" if saved else ""
            raise DdpkitError(
                f"fault-tolerant replica {self.index}: no quorum ({_first_line(exc)}); "
                f"the lighthouse is gone or fewer than {self.min_replicas} replica(s) are alive"
                f"{kept}"
            ) from None
        if self.transport.refused >= REFUSALS_BEFORE_STOP:
            raise DdpkitError(
                f"fault-tolerant replica {self.index}: refused {self.transport.refused} heal payloads "
                "in a row (forged, or of another step than the quorum's); stopping rather than "
                "training on a state that is not the job's"
            )
        if self.manager.current_step() != before:
            self.healed = True  # a peer's state was loaded (a failed step shows at commit)
        rank = self.manager.participating_rank()
        self.rank = 0 if rank is None else int(rank)
        self.participants = max(1, self.manager.num_participants())
        self._in_quorum = True
        self._checks, self._run = 0, None
        if self.first_quorum is not None:
            first, self.first_quorum = self.first_quorum, None
            first(self.healed)
        return self.rank, self.participants

    def _job_store(self) -> Any:
        """The job's store (a client, made on first use), or None outside ``ddpkit run --fault-tolerant``."""
        if self._job is None and self._job_where:
            self._job = job_store(self._job_where)
        return self._job

    def _job_finished(self) -> bool:
        store = self._job_store()
        return store is not None and is_done(store)

    def _mismatched_before(self) -> bool:
        store = self._job_store()
        return store is not None and ft_calls.marked(store)

    def announce(self, call: str, tensor: torch.Tensor | None = None, *, run: int | None = None) -> None:
        """Before a quorum collective: every participant says which call it makes; where they differ,
        raise :class:`~ddpkit.distributed.ft_calls.CollectiveMismatch` on each, in one line; the first in
        the quorum prints the report first (one line per replica) and marks the job's store, so that the
        launcher stops every replica rather than restart one.

        One allreduce of one number, a fingerprint of the call; the rows follow where they differ
        (:mod:`~ddpkit.distributed.ft_calls`). Nothing is
        compared in a quorum of one, after a failed collective of the step (its sums are undefined),
        or inside :meth:`as_one`.

        Args:
            call: what is called (``"all_reduce(sum)"``, ``"the gradient average"``).
            tensor: what it sends, or None.
            run: the call's place in a run of calls of this name (SyncBatchNorm's layer in its model),
                checked only where a run starts: after a call of another name, or at a place not after
                the last one's (the model is called again). None: checked each time.
        """
        if self._quiet:
            return
        if run is not None and self._run is not None and self._run[0] == call and run > self._run[1]:
            self._run = (call, run)
            return
        self._run = None if run is None else (call, run)
        if self.participants < 2 or self.failed():
            return
        self._checks += 1
        mine = ft_calls.row(self.index, self._checks, self.manager.current_step(), call, tensor, user_line())
        print_ = ft_calls.fingerprint(mine)
        total = torch.tensor([print_], dtype=torch.int64, device=self.device)
        self.manager.allreduce(total, reduce_op=_sum()).wait()
        if self.failed() or int(total.item()) == self.participants * print_:
            return  # the same call everywhere (or a failed sum: undefined, and the step does not commit)
        table = torch.zeros((self.participants, ft_calls.WIDTH), dtype=torch.int64)
        table[self.rank] = mine
        table = table.to(self.device)
        self.manager.allreduce(table, reduce_op=_sum()).wait()  # every participant saw the sum differ
        rows = table.cpu()
        if self.failed():
            return
        if not ft_calls.whole(rows) or not ft_calls.differ(rows):
            # NCCL: a stalled peer's collective aborted, its error not yet the manager's: not a mismatch
            self.manager.report_error(DdpkitError(f"fault-tolerant replica {self.index}: a check did not arrive whole"))
            return
        if self.rank == 0:  # the report first: once the store is marked, the launcher stops the replicas
            text = ft_calls.report(rows)
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
            store = self._job_store()
            if store is not None:
                with contextlib.suppress(RuntimeError, OSError):  # node 0 gone: the replicas end all the same
                    ft_calls.mark(store, text)
        call = ft_calls.Call.of(mine)
        raise ft_calls.CollectiveMismatch(
            f"collective mismatch in step {call.step}: replica {self.index} was about to call {call.signature} "
            f"at check #{call.number}; the report names every replica's call"
        )

    @contextlib.contextmanager
    def as_one(self, call: str, tensor: torch.Tensor | None = None) -> Iterator[None]:
        """The collectives inside are checked as one call (a reduction made of a gather, the link probe)."""
        self.announce(call, tensor)
        with self._quietly():
            yield

    @contextlib.contextmanager
    def _quietly(self) -> Iterator[None]:
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def in_quorum(self) -> bool:
        """Whether a quorum was joined for the step in progress."""
        return self._in_quorum

    def average(self, tensor: torch.Tensor, *, call: str = "average") -> None:
        """Average ``tensor`` in place over this step's participants (a failure shows at commit)."""
        self.announce(call, tensor)
        self.manager.allreduce(tensor).wait()

    def size(self) -> int:
        """Replicas in this step's quorum (what :class:`~ddpkit.parallel.sync_batchnorm.SyncBatchNorm` asks)."""
        return self.participants

    def all_reduce_sum(self, tensor: torch.Tensor, *, call: str = "sum", run: int | None = None) -> None:
        """Sum ``tensor`` in place over this step's replicas (a failure shows at commit); ``call`` and
        ``run`` as :meth:`announce` takes them."""
        self.all_reduce_sum_started(tensor, call=call, run=run).wait()

    def all_reduce_sum_started(self, tensor: torch.Tensor, *, call: str = "sum", run: int | None = None) -> Any:
        """Start summing ``tensor`` in place over this step's replicas; the work to wait on (before
        :meth:`should_commit`, where a failure shows)."""
        self.announce(call, tensor, run=run)
        return self.manager.allreduce(tensor, reduce_op=_sum())

    def all_gather_rows(self, row: torch.Tensor, *, call: str = "gather", run: int | None = None) -> torch.Tensor:
        """Every replica's ``row`` of this step, stacked in quorum order (one summed allreduce)."""
        table, work = self.all_gather_rows_started(row, call=call, run=run)
        work.wait()
        return table

    def all_gather_rows_started(
        self, row: torch.Tensor, *, call: str = "gather", run: int | None = None
    ) -> tuple[torch.Tensor, Any]:
        """Start gathering every replica's ``row``: the table it fills in quorum order (a row each, the
        others' zeros summed in), and the work to wait on."""
        self.announce(call, row, run=run)
        table = torch.zeros((self.participants, *row.shape), dtype=row.dtype, device=row.device)
        table[self.rank] = row
        with self._quietly():  # (checked above, with the row's shape)
            return table, self.all_reduce_sum_started(table)

    def reduce_(self, tensor: torch.Tensor, op: str) -> None:
        """``tensor`` reduced in place over this step's replicas with ``op`` (``"sum"``, ``"mean"``, ``"max"``,
        ``"min"``; on :attr:`device`). Where a replica died during it, torchft leaves the result undefined:
        a floating tensor is then NaN, and the step does not commit."""
        with self.as_one(f"all_reduce({op})", tensor):
            if op in ("sum", "mean"):
                self.all_reduce_sum(tensor)
                if op == "mean":
                    tensor.div_(self.participants)
            else:
                rows = self.all_gather_rows(tensor)
                tensor.copy_(rows.amax(0) if op == "max" else rows.amin(0))
        if self.failed() and tensor.is_floating_point():
            tensor.fill_(float("nan"))

    def failed(self) -> bool:
        """Whether a collective of this step failed (torchft then leaves its tensors undefined).

        On a GPU it asks the process group too: NCCL aborts a stalled collective in the background,
        and torchft's manager learns of it only at the commit; the error is handed to it here.
        """
        if self._manager is None:
            return False
        if self._manager.errored() is None and self.device.type == "cuda":
            error = _torch.torchft_group_error(self._manager)
            if error is not None:
                self._manager.report_error(error)
        return self._manager.errored() is not None

    def should_commit(self, *, checked: bool = False) -> bool:
        """Whether every participant finished this step (True: apply it; False: redo it).

        Args:
            checked: the last collective, just checked, came from the same ``rt.step`` as this commit
                (the gradient average): nothing can come between them, so the commit is not checked.
                Otherwise it is, so that a replica still in a call of its own meets it, not a hang.
        """
        if not checked:
            self.announce("commit (rt.step)")
        self._in_quorum = self._backward = False
        return bool(self.manager.should_commit())

    def finished(self) -> None:
        """This replica ran the script to its end: a replica still behind has nothing left to do."""
        if self._job_where:
            try:
                mark_done(self._job_store())
            except (RuntimeError, OSError) as exc:  # node 0 went first: nobody is left to tell
                warn(
                    f"fault-tolerant replica {self.index}: could not tell the job's store it finished "
                    f"({_first_line(exc)})"
                )

    def shutdown(self) -> None:
        """Stop torchft's servers and threads."""
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None


def _sum() -> Any:
    from torch.distributed import ReduceOp

    return ReduceOp.SUM


def _not_refused(record: logging.LogRecord) -> bool:
    """torchft's log filter: drop its traceback of a heal ddpkit refused (ddpkit said so in one line)."""
    return not (record.exc_info and isinstance(record.exc_info[1], HealRefused))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


__all__ = [
    "DONE_KEY",
    "HOST_ENV",
    "JOB_STORE_ENV",
    "LIGHTHOUSE_ENV",
    "MIN_REPLICAS_ENV",
    "QUORUM_TIMEOUT_ENV",
    "REPLICAS_ENV",
    "REPLICA_ENV",
    "Replica",
    "active",
    "check_installed",
    "is_done",
    "job_store",
    "mark_done",
    "replica_index",
]
