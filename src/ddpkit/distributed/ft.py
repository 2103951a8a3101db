"""Per-step fault tolerance on torchft: replicas that drop out and heal while the others go on.

``ddpkit run --fault-tolerant -n N script.py`` starts torchft's lighthouse and N replicas, each a
one-process ``ddpkit run`` of its own whose elastic agent restarts it when it dies. In each
replica, :func:`ddpkit.init` sees :data:`LIGHTHOUSE_ENV` and builds a :class:`Replica`: a
torchft ``Manager`` with a reconfigurable gloo (or NCCL) process group over the replicas.

At every step the replicas form a quorum (:meth:`Replica.quorum`); the step's global batch is
split over the replicas in it (``ddpkit.loop.loader``), their gradients are averaged through the
manager (:meth:`Replica.average`), and the step is applied only where every participant agrees
it completed (:meth:`Replica.should_commit`); otherwise it is redone on the next quorum. A
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

import hashlib
import hmac
import http.server
import io
import logging
import os
import secrets
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch

from ddpkit import _bounds, _torch
from ddpkit.distributed import ft_control, stores
from ddpkit.distributed.host import host_port
from ddpkit.errors import DdpkitError, UsageError, warn

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


SECRET_ENV = "DDPKIT_FT_SECRET_FILE"
"""The file holding the job's secret (made by ``ddpkit run --fault-tolerant`` on one machine; given with
``--secret-file`` on every node across hosts): heal payloads and their requests are signed with it."""
REFUSALS_BEFORE_STOP = 3
"""Heal payloads refused in a row (forged, or of another step) after which a replica stops."""


def read_secret(path: str) -> bytes:
    """The job's secret from ``path``: a file of this user's that nobody else can read.

    Raises:
        UsageError: missing, too short, someone else's, or readable by others.
    """
    import stat

    try:
        info = os.stat(path)
        with open(path, "rb") as handle:
            secret = handle.read(4096).strip()
    except OSError as exc:
        raise UsageError(
            f"the fault-tolerant job's secret file {path} cannot be read ({exc.strerror}); "
            f"{_MAKE_SECRET.format(path=path)}"
        ) from None
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise UsageError(
            f"the fault-tolerant job's secret file {path} is open to others (mode "
            f"{stat.S_IMODE(info.st_mode):o}, owner uid {info.st_uid}): make it yours alone with "
            f"chmod 600 {path}"
        )
    if len(secret) < 16:
        raise UsageError(
            f"the fault-tolerant job's secret file {path} holds {len(secret)} bytes; {_MAKE_SECRET.format(path=path)}"
        )
    return secret


_MAKE_SECRET = (
    "give every node the same file of at least 16 random bytes, readable by you alone: "
    "python -c 'import secrets; print(secrets.token_hex(32))' > {path} && chmod 600 {path}"
)


def write_secret(path: str) -> None:
    """A new random secret in ``path``, readable by this user alone (the file must not exist)."""
    import secrets

    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(secrets.token_hex(32) + "\n")


def _mac(secret: bytes, *parts: bytes) -> str:
    return hmac.new(secret, b"\n".join(parts), hashlib.sha256).hexdigest()


class HealRefused(RuntimeError):
    """A heal payload this replica will not load: unsigned, signed for another request, too large, or of
    another step than the quorum's. Its message is the one line the replica prints."""


class SafeTransport:
    """torchft's checkpoint transport for healing: signed, bounded, and without pickles a peer could forge.

    The sending replica serializes its state with ``torch.save`` once, when torchft asks it to
    (``send_checkpoint``), and serves those bytes over HTTP on ``host`` only until the step
    commits, to requests signed with the job's secret (an HMAC-SHA256 over the URL asked and a
    fresh nonce): anyone else gets 403 at once. The answer carries an HMAC over the URL, the nonce
    and the bytes' SHA-256. The receiving one reads at most ``limit()`` bytes, checks that MAC before
    anything of the payload is parsed, refuses a record that declares more than it holds
    (:func:`ddpkit._bounds.check`), loads with ``torch.load(weights_only=True)``, and refuses a state
    whose own step is not the step the quorum named. torchft's own HTTP and process-group
    transports unpickle what they receive (``weights_only=False``), unsigned, and listen on every
    interface.
    """

    def __init__(
        self,
        host: str,
        timeout: timedelta,
        secret: bytes,
        limit: Callable[[], int] | None = None,
        name: str = "replica",
    ) -> None:
        from torchft.checkpointing.transport import CheckpointTransport

        if not isinstance(self, CheckpointTransport):  # torchft checks the type
            raise TypeError("SafeTransport must be made through transport()")
        self.host = host
        self.timeout = timeout
        self.name = name
        self.refused = 0
        """Heal payloads refused in a row (reset by one loaded)."""
        self._secret = secret
        self._limit = limit or (lambda: 1 << 40)
        self._ready = threading.Condition()
        self._served: tuple[int, bytes] | None = None
        self._not_served: int | None = None  # a step a quorum asked for that this replica is not at
        self._nonces: set[str] = set()
        transport = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                wanted = self.path.rsplit("/", 1)[-1]
                nonce, _, mac = self.headers.get("X-Ddpkit-Auth", "").partition(":")
                url = f"{transport.metadata()}{wanted}"
                if not (
                    wanted.isdigit()
                    and nonce
                    and mac
                    and hmac.compare_digest(mac, _mac(transport._secret, b"GET", url.encode(), nonce.encode()))
                ):
                    self.send_error(403, "not signed with this job's secret")
                    return
                with transport._ready:
                    if nonce in transport._nonces:
                        self.send_error(403, "a request seen before")
                        return
                    transport._nonces.add(nonce)
                    # the peer may ask before this replica's quorum thread has staged the state
                    transport._ready.wait_for(
                        lambda: (
                            transport._not_served == int(wanted)
                            or (transport._served is not None and transport._served[0] == int(wanted))
                        ),
                        timeout=transport.timeout.total_seconds(),
                    )
                    served = transport._served
                if served is None or served[0] != int(wanted):
                    self.send_error(404, "no checkpoint of that step is being served")
                    return
                digest = hashlib.sha256(served[1]).hexdigest().encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(served[1])))
                self.send_header(
                    "X-Ddpkit-Mac", _mac(transport._secret, b"STATE", url.encode(), nonce.encode(), digest)
                )
                self.end_headers()
                self.wfile.write(served[1])

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="ddpkit-ft-heal", daemon=True)
        self._thread.start()

    def metadata(self) -> str:
        """Where a peer fetches this replica's state: ``http://HOST:PORT/checkpoint/`` (the step follows)."""
        return f"http://{host_port(self.host, self._server.server_address[1])}/checkpoint/"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Serve ``state_dict`` (serialized now) as the state of ``step`` until the step ends.

        A state whose own step (torchft's part of it) is not ``step`` is not served: only a forged
        quorum names a step that the replica it names as the source is not at.

        Args:
            dst_ranks: the replicas that will fetch it (torchft's argument; the job's secret says who may).
            step: the step the state is of; a fetch names it.
            state_dict: torchft's ``{"user": ..., "torchft": ...}`` of tensors and plain data.
            timeout: unused: serving waits for nobody.
        """
        own = _step_of(state_dict)
        if own != step:
            _say(
                f"fault-tolerant {self.name}: not serving its state as step {step}: it is at step {own} "
                "(a forged quorum call?)"
            )
            with self._ready:
                self._not_served = step
                self._ready.notify_all()
            return
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)  # CUDA tensors too: the peer loads onto its CPU
        with self._ready:
            self._served = (step, buffer.getvalue())
            self._nonces.clear()
            self._ready.notify_all()

    def disallow_checkpoint(self) -> None:
        """Stop serving: the step ended, the state may change."""
        with self._ready:
            self._served = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """A peer's state of ``step``, signed with the job's secret, bounded, loaded with ``weights_only=True``.

        Args:
            src_rank: the peer's rank in the quorum (torchft's argument; ``metadata`` says where).
            metadata: the peer's :meth:`metadata`.
            step: the step whose state to fetch.
            timeout: how long the fetch may take.

        Raises:
            HealRefused: the payload is not the job's, too large, or of another step (one line, printed).
        """
        try:
            state = self._fetch(metadata, step, timeout)
        except HealRefused as exc:
            self.refused += 1
            _say(f"fault-tolerant {self.name}: {exc}; this step is redone")
            raise
        self.refused = 0
        return state

    def _fetch(self, metadata: str, step: int, timeout: timedelta) -> Any:
        url = f"{metadata}{step}"
        nonce = secrets.token_hex(16)
        request = urllib.request.Request(
            url, headers={"X-Ddpkit-Auth": f"{nonce}:{_mac(self._secret, b'GET', url.encode(), nonce.encode())}"}
        )
        limit = self._limit()
        try:
            with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as answer:
                declared = int(answer.headers.get("Content-Length") or -1)
                if not 0 <= declared <= limit:
                    raise HealRefused(
                        f"refused the state offered at {url}: it declares {declared} bytes, more "
                        f"than {limit} (a state this replica's size allows)"
                    )
                data = answer.read(declared)
                mac = answer.headers.get("X-Ddpkit-Mac", "")
        except urllib.error.HTTPError as exc:
            raise HealRefused(
                f"could not fetch the state of step {step} from {url} (HTTP {exc.code}: {exc.reason})"
            ) from None
        except (OSError, ValueError) as exc:
            raise HealRefused(f"could not fetch the state of step {step} from {url} ({exc})") from None
        digest = hashlib.sha256(data).hexdigest().encode()
        if len(data) != declared or not hmac.compare_digest(
            mac, _mac(self._secret, b"STATE", url.encode(), nonce.encode(), digest)
        ):
            raise HealRefused(
                f"refused the state offered at {url}: it is not signed with this job's secret "
                "(forged, or from another job)"
            )
        try:
            _bounds.check(data, url)
        except _bounds.Disproportionate as exc:
            raise HealRefused(f"refused the state offered at {exc}") from None
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if _step_of(state) != step:
            raise HealRefused(
                f"refused the state offered at {url}: it is of step {_step_of(state)}, the quorum "
                f"named step {step} (a forged quorum call?)"
            )
        return state

    def shutdown(self, wait: bool = True) -> None:
        """Close the server."""
        self._server.shutdown()
        self._server.server_close()


def _step_of(state: Any) -> Any:
    own = state.get("torchft") if isinstance(state, dict) else None
    return own.get("step") if isinstance(own, dict) else None


def _say(line: str) -> None:
    sys.stderr.write(f"ddpkit: {line}\n")
    sys.stderr.flush()


def transport(
    host: str, timeout: timedelta, secret: bytes, limit: Callable[[], int] | None = None, name: str = "replica"
) -> Any:
    """A :class:`SafeTransport` that is also a torchft ``CheckpointTransport``.

    Args:
        host: the address its heal server listens on (127.0.0.1 on one machine).
        timeout: how long a request waits for the state of the step it names.
        secret: the job's secret, with which requests and payloads are signed.
        limit: the most bytes a peer's state may have (None: no bound beyond the file's own).
        name: how this replica is named in its one-line messages.
    """
    from torchft.checkpointing.transport import CheckpointTransport

    kind = type("SafeCheckpointTransport", (SafeTransport, CheckpointTransport), {})
    return kind(host, timeout, secret, limit, name)


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
        check_installed()
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        environ = os.environ if environ is None else environ
        manager_log = logging.getLogger("torchft.manager")
        if device.type != "cuda":  # its warning that NCCL's flight recorder cannot reset, each quorum
            manager_log.setLevel(logging.ERROR)
        manager_log.addFilter(_not_refused)  # a refused heal is one line of ddpkit's, not torchft's traceback
        self.index = replica_index(environ)
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
            ft_control.install(private)
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
        self.first_quorum: Callable[[bool], None] | None = None
        """Called once, after the first quorum, with whether a peer's state healed this replica."""
        self.rank: int = 0
        self.participants: int = 1
        self._in_quorum = False

    @property
    def manager(self) -> Any:
        """torchft's ``Manager`` of this replica (started on first use)."""
        if self._manager is None:
            self._manager = self._start()
        return self._manager

    def quorum(self) -> tuple[int, int]:
        """Join this step's quorum (healing first if this replica is behind); (rank, participants).

        Raises:
            DdpkitError: no quorum formed in time (too few live replicas, or no lighthouse).
        """
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

    def in_quorum(self) -> bool:
        """Whether a quorum was joined for the step in progress."""
        return self._in_quorum

    def average(self, tensor: torch.Tensor) -> None:
        """Average ``tensor`` in place over this step's participants (a failure shows at commit)."""
        self.manager.allreduce(tensor).wait()

    def size(self) -> int:
        """Replicas in this step's quorum (what :class:`~ddpkit.parallel.sync_batchnorm.SyncBatchNorm` asks)."""
        return self.participants

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over this step's replicas (a failure shows at commit)."""
        from torch.distributed import ReduceOp

        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """Every replica's ``row`` of this step, stacked in quorum order (one summed allreduce)."""
        table = torch.zeros((self.participants, *row.shape), dtype=row.dtype, device=row.device)
        table[self.rank] = row
        self.all_reduce_sum(table)
        return table

    def should_commit(self) -> bool:
        """Whether every participant finished this step (True: apply it; False: redo it)."""
        self._in_quorum = False
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


def _not_refused(record: logging.LogRecord) -> bool:
    """torchft's log filter: drop its traceback of a heal ddpkit refused (ddpkit said so in one line)."""
    return not (record.exc_info and isinstance(record.exc_info[1], HealRefused))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


__all__ = [
    "DONE_KEY",
    "HOST_ENV",
    "HealRefused",
    "JOB_STORE_ENV",
    "LIGHTHOUSE_ENV",
    "MIN_REPLICAS_ENV",
    "QUORUM_TIMEOUT_ENV",
    "REPLICAS_ENV",
    "REPLICA_ENV",
    "SECRET_ENV",
    "Replica",
    "SafeTransport",
    "active",
    "check_installed",
    "is_done",
    "job_store",
    "mark_done",
    "read_secret",
    "replica_index",
    "transport",
    "write_secret",
]
