"""``ddpkit.init``: frozen :class:`Settings`, checked; the group joined; the :class:`Runtime` composed.

Example:
    >>> import ddpkit
    >>> rt = ddpkit.init()          # a world of one under plain python
    >>> rt.world_size, rt.is_main
    (1, True)
    >>> rt.close()
"""

from __future__ import annotations

import atexit
import os
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ddpkit import rng
from ddpkit.checkpoint import restore
from ddpkit.checkpoint import resume as resuming
from ddpkit.distributed import collectives, entry, ft, preemption, process_group, store_sync
from ddpkit.distributed.environment import Environment, detect
from ddpkit.errors import UsageError
from ddpkit.loop import heal
from ddpkit.observe import collectives as obs_collectives
from ddpkit.observe import heartbeats, watchdog
from ddpkit.observe import trackers as trackers_mod
from ddpkit.observe.reporter import Reporter
from ddpkit.parallel.replica import FaultTolerant
from ddpkit.runtime.facade import Runtime
from ddpkit.state.precision import Precision
from ddpkit.state.run import RunState

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_SAVE_TIMEOUT_S = 60.0

_current: Runtime | None = None


@dataclass(frozen=True)
class Settings:
    """What :func:`ddpkit.init` was given, checked before any process group exists (see there)."""

    seed: int | None = None
    precision: str = "fp32"
    backend: str | None = None
    device: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    out_dir: str | None = None
    keep_checkpoints: int = 3
    checkpoint_dir: str | None = None
    resume: str | None = None
    hang_timeout: float | None = None
    save_timeout: float = DEFAULT_SAVE_TIMEOUT_S
    trackers: tuple[str, ...] | None = None
    """The trackers named (None: the default, TensorBoard where it is installed)."""
    run_name: str | None = None
    config: Any = None

    def check(self) -> None:
        """Refuse bad settings in one line, before any process group work.

        Raises:
            UsageError: an unknown precision, ``resume="auto"`` without a ``checkpoint_dir``, a
                ``hang_timeout`` that is not a number of seconds >= 0, or W&B or MLflow
                without an ``out_dir``.
        """
        Precision(self.precision, torch.device("cpu"))
        trackers = tuple(self.trackers or ())
        remote = [name for name in trackers if name in trackers_mod.REMOTE]
        if remote and self.out_dir is None:
            raise UsageError(
                f"trackers={trackers!r} need ddpkit.init(out_dir=...): their files and ddpkit's metrics go there"
            )
        if self.config is not None and not isinstance(self.config, Mapping):
            raise UsageError(f"config must be a mapping of names to values, got {type(self.config).__name__}")
        if self.resume == "auto" and self.checkpoint_dir is None:
            raise UsageError("resume='auto' needs checkpoint_dir=... to look in")
        watchdog.check_timeout(self.hang_timeout)


def init(
    *,
    seed: int | None = None,
    precision: str = "fp32",
    backend: str | None = None,
    device: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    out_dir: str | os.PathLike | None = None,
    keep_checkpoints: int = 3,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    hang_timeout: float | None = None,
    save_timeout: float = DEFAULT_SAVE_TIMEOUT_S,
    trackers: str | Sequence[str] | None = None,
    run_name: str | None = None,
    config: Mapping[str, Any] | None = None,
) -> Runtime:
    """Learn our place from the launcher, pick device and backend, and join the process group.

    Args:
        seed: seeds torch, numpy and random identically on every rank, so that every rank builds
            the same initial weights, and keys the data order and per-sample randomness.
            ``rt.setup`` then gives each rank a stream of its own (``seed + 1_000_003 * (rank + 1)``)
            so that dropout differs between ranks: random data that must be equal on every rank is
            drawn before ``rt.setup``, or from a ``torch.Generator`` seeded from this seed. Under
            ``micro_shards`` every rank goes on with rank 0's stream (one process's), each batch a
            loader hands out keys it by the batch, and each shard draws from a stream keyed by the
            step and the shard.
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + GradScaler).
        backend: ``"nccl"``, ``"gloo"`` or ``"mpi"``; chosen from the device when omitted.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; the local rank's GPU when CUDA is usable.
        timeout: seconds to wait for the master and for any collective.
        out_dir: where :meth:`Runtime.log` writes metrics (rank 0 only).
        keep_checkpoints: newest checkpoints kept when saving into a directory.
        checkpoint_dir: where :meth:`Runtime.checkpoint` saves and :meth:`Runtime.resume` looks.
        resume: ``"auto"`` (the newest complete checkpoint of ``checkpoint_dir``, if any: what
            a run restarted by ``ddpkit run --max-restarts`` needs), a checkpoint path, or None.
        hang_timeout: seconds in which no rank makes progress before the job counts as hung:
            ddpkit prints where each rank is and the stuck rank's Python stack, then every
            rank exits with code 124 (see :mod:`ddpkit.observe.watchdog`). None (the default):
            adaptive, a rank that waited in one collective for minutes while a peer made no
            progress in its own code; every rank busy in its own code is never a hang. 0: off.
            In every job of several processes, unless 0, a collective mismatch (ranks in
            different collectives) is named with each rank's line, and every rank exits with 123.
        save_timeout: seconds ``rt.save`` and ``rt.load`` wait for every rank to arrive before
            failing with one line that names the missing ranks (e.g. a save under ``if rt.is_main``).
        trackers: where :meth:`Runtime.log` also writes, from rank 0: any of ``"tensorboard"``
            (the default), ``"wandb"`` and ``"mlflow"`` (a list, or ``"a,b"``; ``()`` for none).
            Each is its own library, an optional extra (``pip install ddpkit[wandb]``); a resumed
            run continues the same tracker run with every step once
            (:mod:`ddpkit.observe.trackers`).
        run_name: the run's name in W&B and MLflow.
        config: the run's hyperparameters, recorded by the trackers with ``init``'s settings,
            the world size, ddpkit's and torch's versions and the git commit.

    Returns:
        The :class:`Runtime`; calling ``init`` again with the same settings returns the same one
        until it is closed.

    Raises:
        UsageError: ``init`` was already called with other settings and not closed; a tracker
            unknown, not installed or unable to start (on every rank, before any training).
    """
    global _current
    entry.install_excepthook()  # an uncaught DdpkitError in the script: one line, not a traceback
    settings = Settings(
        seed=seed,
        precision=precision,
        backend=backend,
        device=device,
        timeout=timeout,
        out_dir=_text(out_dir),
        keep_checkpoints=keep_checkpoints,
        checkpoint_dir=_text(checkpoint_dir),
        resume=_text(resume),
        hang_timeout=hang_timeout,
        save_timeout=save_timeout,
        trackers=None if trackers is None else trackers_mod.names(trackers),
        run_name=run_name,
        config=None if config is None else dict(config) if isinstance(config, Mapping) else config,
    )
    if _current is not None and not _current._closed:
        _same_settings(_current._settings, settings)
        return _current
    settings.check()  # before any process group exists
    _check_directories(settings, is_main=detect().rank == 0)
    env, chosen_device, chosen_backend = join(settings)
    if seed is not None:
        rng.seed_everything(seed)
    _start_trackers(settings, env)
    run = RunState(Precision(settings.precision, chosen_device), seed=settings.seed)
    peers = resuming.Peers(env.rank, env.world_size, settings.timeout, settings.save_timeout)
    if ft.active():
        run.world = _replica(run, peers, settings, chosen_device, env)
    run.preemption = preemption.Preemption()
    run.preemption.install()
    if env.rank == 0 and settings.out_dir is not None:
        run.tracking = trackers_mod.Remote(
            settings.trackers or (),
            settings.out_dir,
            run_name=run_name,
            config=trackers_mod.run_config(asdict(settings), settings.config, env.world_size),
            deferred=settings.checkpoint_dir is not None,
        )
    dog = watchdog.watch(hang_timeout, rank=env.rank, world_size=env.world_size, device=chosen_device)
    out_dir = Path(settings.out_dir) if settings.out_dir is not None else None
    reporter = Reporter(out_dir, settings.trackers, dog)
    runtime = Runtime(
        env, chosen_device, chosen_backend, settings, run=run, peers=peers, reporter=reporter, on_close=_forget
    )
    if dog is not None:
        heartbeats.set_target(runtime)
    _current = runtime
    atexit.register(runtime._close_at_exit)
    return runtime


def _check_directories(settings: Settings, *, is_main: bool) -> None:
    """``checkpoint_dir`` and ``out_dir``: a directory, or a path whose nearest existing part is one, that
    rank 0 (which writes there) can write in; refused at ``init`` rather than at the first save, an epoch on.

    Raises:
        UsageError: a path that is a file or lies under one, or one rank 0 cannot write in.
    """
    if not is_main:  # another node's view of the path says nothing of rank 0's
        return
    for name, path in (("checkpoint_dir", settings.checkpoint_dir), ("out_dir", settings.out_dir)):
        if path is None:
            continue
        existing = Path(path)
        try:
            while not existing.exists() and existing != existing.parent:
                existing = existing.parent
            is_dir = existing.is_dir()
        except OSError as exc:  # a part this user may not look into
            raise UsageError(
                f"{name}={path!r}: {exc.strerror or exc} ({existing}); give a directory this user can write in"
            ) from None
        if not is_dir:
            raise UsageError(
                f"{name}={path!r}: {existing} is a file, not a directory; give a directory, which ddpkit makes "
                "if it does not exist yet"
            )
        if not os.access(existing, os.W_OK | os.X_OK):
            raise UsageError(f"{name}={path!r}: this user cannot write in {existing}; give a directory it can write in")


def join(settings: Settings) -> tuple[Environment, torch.device, str]:
    """Learn this process's place from the launcher, pick device and backend, join the group.

    Returns:
        The environment, the device and the backend; with more than one process the default
        group is up and every rank shares one key for its store meetings.
    """
    env = detect()
    device = process_group.choose_device(env, settings.device)
    backend = process_group.choose_backend(device, settings.backend)
    if device.type == "cuda":  # one process too (device="cuda:1"): torch.cuda's calls without a device mean it
        torch.cuda.set_device(device)
    if env.distributed:
        if settings.hang_timeout != 0:  # the watchdog sees a rank wait in DDP's exchange through it
            obs_collectives.turn_on_flight_recorder()
        process_group.init(env, backend, device, settings.timeout)
        store_sync.begin(collectives.broadcast_object(uuid.uuid4().hex if env.rank == 0 else None))
    if env.restart_count and env.rank == 0:
        sys.stderr.write(_restart_line(env, os.environ) + "\n")
    return env, device, backend


def _restart_line(env: Environment, environ: Mapping[str, str]) -> str:
    """What rank 0 says as torch's elastic agent starts the workers again after one failed (torch says
    it only at INFO, which torchrun does not show); ``environ`` tells a fault-tolerant replica's."""
    of = f" of {env.max_restarts}" if env.max_restarts is not None else ""
    whose = f"replica {environ[ft.REPLICA_ENV]}'s workers start" if ft.REPLICA_ENV in environ else "every worker starts"
    return f"ddpkit: restart {env.restart_count}{of}: a worker failed (its output is above); {whose} again"


def _replica(run: RunState, peers: resuming.Peers, settings: Settings, device: torch.device, env: Environment) -> Any:
    """A replica of ``ddpkit run --fault-tolerant``: torchft's manager, with ddpkit's heal state, as the run's world."""
    remote = [name for name in settings.trackers or () if name in trackers_mod.REMOTE]
    if remote:
        raise UsageError(
            f"--fault-tolerant does not send to {', '.join(remote)} yet (replicas take turns "
            "logging); use tensorboard and metrics.jsonl"
        )
    if env.world_size != 1:
        raise UsageError("--fault-tolerant runs one process per replica; start it with ddpkit run --fault-tolerant")

    def healed(saved: Mapping[str, Any]) -> None:
        heal.apply_heal(run, mode.state, saved)
        said = (
            f"ddpkit: replica {ft.replica_index()} healed from replica {saved.get('replica')}: {run.loop.resumed_at()}"
        )
        sys.stderr.write(said + "\n")

    manager = ft.Replica(
        lambda: heal.heal_state(run, mode.state, ft.replica_index()),
        healed,
        device=device,
        seeded=settings.seed is not None,
        timeout_s=min(settings.timeout, 30.0),
    )
    mode = FaultTolerant(manager)
    directory = Path(settings.checkpoint_dir) if settings.checkpoint_dir is not None else None

    def first_quorum(healed: bool) -> None:
        """Resume from a file unless a peer's state healed this replica."""
        waiting, mode.waiting_resume = mode.waiting_resume, None
        if waiting is not None and not healed:
            restore.resume(run, peers, settings.resume, directory, waiting[0], strict=waiting[1])

    def before_stop() -> Any:
        """No quorum formed: the replica ranked first in the last one saves what it holds (the state of
        its last committed step) into ``checkpoint_dir``, so a restarted job resumes from it."""
        if directory is None or mode.state is None or run.loop.step == 0 or not mode.is_main(0):
            return None
        return resuming.save(run, peers, directory, mode.state, keep=settings.keep_checkpoints)

    manager.first_quorum = first_quorum
    manager.before_stop = before_stop
    return mode


def _start_trackers(settings: Settings, env: Environment) -> None:
    """Rank 0 tries each tracker; every rank refuses in one line when one cannot start."""
    if not settings.trackers:  # the default: TensorBoard where it loads, with a warning where not
        return
    found = trackers_mod.problem(settings.trackers, settings.out_dir) if env.rank == 0 else None
    if env.distributed:
        found = collectives.broadcast_object(found)
    if found:
        if env.distributed:
            process_group.destroy()
        raise UsageError(found)


def current() -> Runtime | None:
    """The runtime made by the last :func:`ddpkit.init`, if it is still open."""
    return _current


def _forget(runtime: Runtime) -> None:
    global _current
    if _current is runtime:
        _current = None


def _text(value: str | os.PathLike | None) -> str | None:
    return None if value is None else str(value)


def _same_settings(running: Settings, asked: Settings) -> None:
    """Refuse a second ``init`` whose settings differ from the running one's."""
    mine, theirs = asdict(running), asdict(asked)
    differ = {k: v for k, v in theirs.items() if mine[k] != v}
    if differ:
        shown = ", ".join(f"{k}={v!r} (running: {mine[k]!r})" for k, v in differ.items())
        raise UsageError(
            f"ddpkit.init was already called with other settings: {shown}; "
            "call rt.close() first, or pass the same settings"
        )
