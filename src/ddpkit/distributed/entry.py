"""Run a worker's script as ``python`` would, then end the process without interpreter teardown.

A finished gloo job can still die at exit: after ``destroy_process_group()``, Python's
finalisation and torch's C++ threads race, and now and then the process aborts with
``terminate called without an active exception`` (SIGABRT), so a job that did all its work
fails, and under ``--max-restarts`` runs again. Ending with ``os._exit`` after the exit
handlers skips that teardown. ``ddpkit run``, ``train``, ``predict`` and ``bench`` start every
worker through this module (:func:`main`); the children of :func:`ddpkit.launch` run their
function through :func:`call_and_record`, which ends them the same way.

Under plain torchrun or srun, put it in front of the script to get the same clean exit::

    torchrun --nproc-per-node 4 -m ddpkit.entry train.py --lr 0.1
    srun python -m ddpkit.entry train.py --lr 0.1
    torchrun --nproc-per-node 4 -m ddpkit.entry -m mypackage.train

The script sees what ``python train.py`` gives it: ``__name__ == "__main__"``, an absolute
``__file__``, ``sys.argv`` (its first item absolute too) and ``sys.path[0]`` (the script's
directory; the current one for ``-m``). The process then exits as Python would (0; the code
of ``sys.exit``; 1 after an uncaught exception, printed by ``sys.excepthook``) after the same
steps: non-daemon threads joined, ``atexit`` handlers run (ddpkit's :meth:`Runtime.close
<ddpkit.Runtime.close>` destroys the process group there), files left open and stdout and
stderr flushed. Only the C-level teardown is skipped: objects still alive are not freed (files
left open are flushed, not closed), and C++ static destructors do not run.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

from ddpkit import _torch
from ddpkit.distributed import stores
from ddpkit.distributed.parent import die_with_launcher
from ddpkit.errors import DdpkitError, script_failed, translated

_USAGE = "usage: python -m ddpkit.entry SCRIPT [ARGS...] | -m MODULE [ARGS...]\n"


def run_target(argv: Sequence[str]) -> int:
    """Run ``SCRIPT ARGS`` or ``-m MODULE ARGS`` as ``__main__``; the exit code Python would give.

    An uncaught exception is printed through ``sys.excepthook`` (ddpkit's prints a
    :class:`~ddpkit.DdpkitError` as one line), with the traceback starting in the script.
    """
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        sys.stderr.write(_USAGE)
        return 2
    private_rendezvous()
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file in argv[0]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")  # __file__ absolute, as python
    except SystemExit as exc:
        if not isinstance(exc.code, (int, type(None))):
            sys.stderr.write(f"{exc.code}\n")
        return exit_code(exc)
    except BaseException as exc:  # noqa: BLE001 - reported as python would
        return _report(exc)
    return 0


def exit_code(exc: SystemExit) -> int:
    """The status ``raise SystemExit(code)`` gives under python: None is 0, other non-ints 1."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def _report(exc: BaseException) -> int:
    # The traceback starts in the script, as under python: our frames and runpy's are dropped.
    ours = {_report.__code__.co_filename, runpy.run_path.__code__.co_filename}
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    exc.__traceback__ = tb
    try:
        sys.excepthook(type(exc), exc, tb)
    except BaseException:  # noqa: BLE001 - a broken hook must not hide exc
        traceback.print_exception(type(exc), exc, tb)
    return 128 + signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1  # 130, as a shell shows it


def run_exit_steps(*, flush_files: bool = True) -> None:
    """What Python does at exit before its C-level teardown: join threads, run ``atexit`` handlers.

    Each handler runs once; afterwards none is registered. Call it at most once per process.
    With ``flush_files``, files the script left open are flushed too (teardown would have
    flushed and closed them); a forked child must not, as its copies of the parent's buffers
    would be written twice.
    """
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize calls first
    atexit._run_exitfuncs()
    if flush_files:
        flush_open_files()


def flush_open_files() -> None:
    """Flush every open, writable file object, so what the script wrote reaches the OS.

    Wrappers push into the files they wrap (text into its buffer, a GzipFile into its file),
    in no known order, so three passes carry data down three levels. Files are not closed: a
    compressed stream left open lacks its trailer, as it may after a crash; use ``with``.
    """
    import gc
    import io

    # type(), not isinstance(): some objects warn or compute when their __class__ is read
    opened = [obj for obj in gc.get_objects() if issubclass(type(obj), (io.TextIOBase, io.BufferedIOBase))]
    for _ in range(3):
        for stream in opened:
            try:
                if not stream.closed and stream.writable():
                    stream.flush()
            except Exception:  # noqa: BLE001 - a file that cannot flush must not stop the others
                pass


def leave(code: int) -> NoReturn:
    """Flush stdout and stderr and end the process now, with ``code`` (120 if a flush fails, as python)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            code = code or 120
    os._exit(code & 0xFF)


def finish(code: int) -> NoReturn:
    """End this worker as Python would, minus the teardown that can abort it (see module doc)."""
    run_exit_steps()
    leave(code)


def private_rendezvous() -> None:
    """In a worker of a one-machine ``ddpkit run`` / ``ddpkit.launch`` job: ``init_process_group()``
    of the user's own code meets through the job's private store, not a ``TCPStore`` on every interface.

    A no-op elsewhere (plain torchrun, srun, several nodes): there ``env://`` is torch's own.
    """
    if not os.environ.get(stores.STORE_DIR_ENV):
        return
    asked = os.environ.get("DDPKIT_ASKED_MASTER")  # ddpkit.distributed.torchrun.ASKED_MASTER_ENV (above this module)
    if asked:  # what torchrun gives a script asked so
        host, _, port = asked.rpartition(":")
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host.strip("[]"), port
    _torch.use_env_rendezvous(stores.env_rendezvous)


def _is_file(stream) -> bool:  # type: ignore[no-untyped-def]
    try:
        stream.fileno()
    except (OSError, ValueError, AttributeError):
        return False  # io.StringIO and the like: not where the user would look
    return True


def install_excepthook() -> None:
    """Report an uncaught :class:`DdpkitError` in a user script as one line, with its exit code.

    Other exceptions keep the previous hook and their traceback. The process then ends as
    :func:`finish` ends it: threads joined, exit handlers run (the process group is
    destroyed), open files flushed, and no interpreter teardown that gloo could abort.
    """
    previous = sys.excepthook
    if getattr(previous, "_ddpkit", False):
        return

    def hook(kind, value, traceback):  # type: ignore[no-untyped-def]
        if not isinstance(value, DdpkitError):
            value = translated(value) or value  # torch's error for a setting ddpkit made: its line
        if not isinstance(value, DdpkitError):
            previous(kind, value, traceback)
            return
        # torch's init_process_group wraps this hook and points sys.stderr at a buffer it prints
        # after the hook returns; this one never returns (os._exit), so write past the buffer.
        stream = sys.stderr if _is_file(sys.stderr) else sys.__stderr__
        rank = os.environ.get("RANK")
        prefix = f"[rank{rank}]: " if rank is not None and stream is not sys.stderr else ""
        stream.write(f"{prefix}ddpkit: error: {value}\n")
        stream.flush()
        finish(value.exit_code)  # threads, atexit handlers, open files, then os._exit

    hook._ddpkit = True  # type: ignore[attr-defined]
    sys.excepthook = hook


# -- the children of ddpkit.launch ---------------------------------------------------------------


def call_and_record(
    fn: Callable[..., Any], error_dir: str, start_method: str, launcher: FromLauncher | None, *args: Any
) -> Any:
    """A child of :func:`ddpkit.launch`: run ``fn``; on an exception, note when and what.

    Peers of a failing rank fail too (their collectives lose a partner) and the agent may see
    them first; the time each exception was raised (``error_dir/rankN.json``, read by the
    parent) tells the root cause apart. Either way the child then ends like a worker of
    :func:`main`: exit handlers now, ``os._exit`` once torch has handed the return value back.

    Args:
        fn: the user's function; its return value comes back pickled into bytes.
        error_dir: the parent's directory for ``rankN.json``, written only when ``fn`` fails.
        start_method: how the child was started; ``"fork"`` clears the exit handlers copied from the parent.
        launcher: for a ``"forkserver"`` child, the launcher's environment, stdout and stderr.
        *args: positional arguments of ``fn``.
    """
    if launcher is not None:
        launcher.take()
    die_with_launcher(through_forkserver=start_method == "forkserver")  # the launcher killed: this child ends too
    if start_method == "fork":
        atexit._clear()  # the parent's handlers, copied by fork: never this child's to run
    private_rendezvous()
    try:
        result = _by_value(fn, fn(*args))
    except SystemExit as exc:
        if exit_code(exc) != 0:
            _record(error_dir, exc)
            _leave_after_handoff(start_method, exit_code(exc))
            raise
        result = _by_value(fn, None)  # as torch's record() treats sys.exit(0)
    except BaseException as exc:
        script_failed(exc)  # as Python's excepthook would tell the run: it closes as failed
        _record(error_dir, exc)
        _leave_after_handoff(start_method, 1)
        raise
    _leave_after_handoff(start_method, 0)
    return result


class FromLauncher:
    """What a forkserver's child needs of its launcher and cannot inherit: its environment, stdout and stderr.

    The child is a fork of the server, so it starts with the environment and the standard streams
    the server had when it started, perhaps several launches ago (another job's private
    directory, variables since changed or removed, a stdout since redirected), not the
    launcher's of now as a spawned child would. Pickled for the child while multiprocessing
    starts it, this object sends the launcher's environment and duplicates of its descriptors 1
    and 2 along (``multiprocessing.reduction.DupFd``, the way multiprocessing sends a pipe);
    :meth:`take` in the child makes them the child's own, and sets torch's threads from
    ``OMP_NUM_THREADS``. Other variables torch reads only when imported keep the server's values.
    """

    def __init__(self, environ: dict[str, str] | None = None, streams: Sequence[Any] = ()) -> None:
        self.environ = dict(os.environ) if environ is None else environ
        self.streams = streams  # in the child: what DupFd sent for descriptors 1 and 2 (None: closed)

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        streams = [reduction.DupFd(fd) if _is_open(fd) else None for fd in (1, 2)]
        return (FromLauncher, (self.environ, streams))

    def take(self) -> None:
        """In the child: the launcher's streams as descriptors 1 and 2, its environment plus the agent's variables."""
        for fd, stream, python_stream in zip((1, 2), self.streams, (sys.stdout, sys.stderr)):
            if stream is not None:
                if python_stream is not None:
                    python_stream.flush()
                received = stream.detach()
                os.dup2(received, fd)
                os.close(received)
        agent = {key: value for key, value in os.environ.items() if _torch.set_by_elastic_agent(key)}
        os.environ.clear()
        os.environ.update(self.environ)
        os.environ.update(agent)
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # torch read the server's when the server imported it
            import torch

            torch.set_num_threads(int(threads))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _record(error_dir: str, exc: BaseException) -> None:
    record = {
        "rank": int(os.environ.get("RANK", "0")),
        "time": time.time(),
        "message": f"{type(exc).__name__}: {exc}",
        "traceback": traceback.format_exc(),
    }
    (Path(error_dir) / f"rank{record['rank']}.json").write_text(json.dumps(record))


def _by_value(fn: Callable[..., Any], result: Any) -> bytes:
    """``result`` pickled into bytes that :func:`ddpkit.launch` unpickles in the parent.

    torch hands return values back through a multiprocessing queue, which sends tensors as file
    descriptors served by a listener thread of this child; the exit steps, which run before the
    hand-off, stop that listener. Plain bytes need no listener. Failing here, with a clear error,
    also beats failing after :func:`_leave_after_handoff` chose the status of a success.

    Tensors on a GPU come back on the host: unpickled as they were, each would start CUDA in the
    parent on this rank's device (which a notebook's next forked launch cannot survive).
    """
    import io
    import pickle

    import torch

    class _OnTheHost(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if not isinstance(obj, torch.Tensor) or obj.device.type in ("cpu", "meta"):
                return NotImplemented
            if obj.requires_grad and not obj.is_leaf:
                return NotImplemented  # pickle refuses it as it is, in its own words
            host = obj.detach().cpu()
            kept = torch.nn.Parameter(host, obj.requires_grad) if isinstance(obj, torch.nn.Parameter) else host
            kept.requires_grad_(obj.requires_grad)
            return kept.__reduce_ex__(pickle.HIGHEST_PROTOCOL)

    try:
        buffer = io.BytesIO()
        _OnTheHost(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(result)
        return buffer.getvalue()
    except Exception as exc:
        raise TypeError(
            f"{getattr(fn, '__qualname__', fn)} returned a value that cannot be sent back "
            f"to the parent process: {type(exc).__name__}: {exc}"
        ) from exc


def _leave_after_handoff(start_method: str, code: int) -> None:
    """Run the exit handlers now, and end with ``os._exit(code)`` at interpreter exit.

    torch's wrapper still has to put the return value on its queue and wait until the parent
    read it; only then does the child reach interpreter exit, where the one handler left is ours.
    """
    run_exit_steps(flush_files=start_method != "fork")
    atexit.register(leave, code)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """``python -m ddpkit.entry SCRIPT ARGS...``: run the script, then :func:`finish`."""
    die_with_launcher()  # ddpkit run killed (any signal, SIGKILL too): this worker ends with it
    install_excepthook()
    finish(run_target(sys.argv[1:] if argv is None else argv))
