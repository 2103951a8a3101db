"""The heal transport of a fault-tolerant job: a peer's state, signed, bounded and safe to load.

A replica that is behind (restarted, or late) heals at its first quorum from a live peer:
:class:`SafeTransport` serves the peer's state over HTTP on its own address to requests signed with
the job's secret (:func:`read_secret`), and the healing replica checks the answer's signature, its
size and its records' bounds before it loads it with ``torch.load(weights_only=True)``, and that the
state is of the step the quorum named. Anything else is :class:`HealRefused`, in one line.

Example:
    >>> _mac(b"secret", b"GET", b"http://127.0.0.1:1/checkpoint/3", b"nonce")[:16]
    '113166982c9d7ca1'
"""

from __future__ import annotations

import hashlib
import hmac
import http.server
import io
import os
import secrets
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from ddpkit import _bounds
from ddpkit.distributed.host import host_port
from ddpkit.errors import UsageError

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


__all__ = [
    "REFUSALS_BEFORE_STOP",
    "SECRET_ENV",
    "HealRefused",
    "SafeTransport",
    "read_secret",
    "transport",
    "write_secret",
]
