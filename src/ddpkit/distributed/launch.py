""":func:`ddpkit.launch`: a function in N processes on one machine, through torch's elastic launcher.

The ``mp.spawn`` pattern without the index argument, from a notebook or a script. The job meets
in a private directory (:func:`ddpkit.distributed.torchrun.private_job`), like a one-machine ``ddpkit
run``, and its children end through :mod:`ddpkit.entry`, so a finished job cannot abort in
interpreter teardown.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import pickle
import sys
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ddpkit.distributed import entry, stores
from ddpkit.distributed.failures import describe, is_secondary, root_failure
from ddpkit.distributed.torchrun import AGENT_ENV, _thread_env, private_job
from ddpkit.errors import EXIT_HANG, EXIT_MISMATCH, DdpkitError, UsageError


class LaunchError(DdpkitError):
    """A process started by :func:`launch` failed; carries its rank and traceback."""

    def __init__(self, rank: int, message: str, traceback: str = ""):
        self.rank = rank
        self.message = message
        self.child_traceback = traceback
        text = f"rank {rank} failed: {message}"
        super().__init__(text + (f"\n\nTraceback from rank {rank}:\n{traceback}" if traceback else ""))


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    max_restarts: int = 0,
    start_method: str | None = None,
) -> dict[int, Any]:
    """Call ``fn(*args)`` in ``nprocs`` processes on one machine and wait for all of them.

    Unlike ``mp.spawn`` no index is passed first: ``ddpkit.init()`` inside ``fn`` knows the
    rank. The rendezvous keeps its state in a new private directory, so two launches never collide
    and nothing of the job listens beyond loopback.

    Args:
        fn: the function each process calls; its return value must pickle.
        nprocs: processes to start (the world size), at least 1.
        args: positional arguments of ``fn``, the same in every process.
        max_restarts: times the elastic agent restarts every process after one fails.
        start_method: ``"spawn"``, ``"fork"`` or ``"forkserver"``; None: ``"fork"`` for a function
            of an interactive ``__main__`` (a notebook, a REPL, ``python -c`` or ``python -``) or of a
            package's ``__main__.py`` (``python -m pkg``), which spawned children cannot import, else
            ``"spawn"``.
            ``"forkserver"`` with ``multiprocessing.set_forkserver_preload(["torch", ...])`` starts
            each process without importing torch again; every launch's children still get the
            environment, stdout and stderr of that launch, not those the server started with.

    Returns:
        Each rank's return value, ``{rank: value}``, in rank order.

    Raises:
        LaunchError: the first rank that failed, with its traceback.

    Example:
        >>> def work():
        ...     rt = ddpkit.init()
        ...     return rt.all_reduce(rt.rank)
        >>> ddpkit.launch(work, nprocs=2)        # doctest: +SKIP
        {0: 1.0, 1: 1.0}
    """
    if nprocs < 1:
        raise UsageError(f"nprocs must be at least 1, got {nprocs}")
    method = start_method or _start_method(fn)
    if method in ("spawn", "forkserver"):
        _refuse_an_unguarded_call(method)
        _refuse_what_children_cannot_import(fn, method)
    if method == "fork" and _cuda_started():
        raise UsageError(
            'ddpkit.launch: this process has used CUDA already, and a forked child cannot ("Cannot '
            're-initialize CUDA in forked subprocess"); call ddpkit.launch before any CUDA call (restart the '
            "notebook's kernel), or define the function in a .py file and import it, which starts by spawn"
        )
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with private_job() as (directory, worker_env):
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nprocs,
            run_id=uuid.uuid4().hex[:12],
            rdzv_backend="c10d",
            rdzv_endpoint=stores.rendezvous_file(directory),
            rdzv_configs={"store_type": "file"},  # a file of the private directory: no socket
            local_addr="127.0.0.1",
            max_restarts=max_restarts,
            monitor_interval=0.1,
            start_method=method,
        )
        with (
            tempfile.TemporaryDirectory(prefix="ddpkit-launch-") as error_dir,
            _thread_env(nprocs, {**AGENT_ENV, **worker_env}),
        ):
            try:
                launcher = entry.FromLauncher() if config.start_method == "forkserver" else None
                call = elastic_launch(config, entry.call_and_record)
                returned = call(fn, error_dir, config.start_method, launcher, *args)
            except ChildFailedError as exc:
                # a rank's own error first; then the watchdog's verdict, which a peer's lost collective follows
                earliest = _earliest_error(error_dir)
                own = earliest if earliest is not None and not is_secondary(earliest.message) else None
                failed = (
                    own or _watchdogs_verdict(exc.failures) or earliest or _launch_error(*root_failure(exc.failures))
                )
                raise _after_cuda_in_the_parent(failed, method) from None
    # bytes: see entry._by_value; in rank order, whichever rank finished first
    return {rank: pickle.loads(value) for rank, value in sorted(returned.items())}


_VERDICTS = {
    EXIT_MISMATCH: "the ranks called different collectives; the report above names each rank's call and line",
    EXIT_HANG: "the job hung; the report above names the stuck rank and shows its stack",
}


def _watchdogs_verdict(failures: Mapping[int, Any]) -> LaunchError | None:
    """The watchdog's verdict where a rank ended by it (exit code 123 or 124), as the error, with that exit
    code; None where none did. A peer's error (its collective lost the rank that reported) is its consequence."""
    ended = {rank: f.exitcode for rank, f in failures.items() if getattr(f, "exitcode", None) in _VERDICTS}
    if not ended:
        return None
    rank = min(ended)
    error = LaunchError(rank, f"exit code {ended[rank]}: {_VERDICTS[ended[rank]]}")
    error.exit_code = ended[rank]
    return error


def _earliest_error(error_dir: str) -> LaunchError | None:
    records = []
    for path in Path(error_dir).glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
    if not records:
        return None
    first = min(records, key=lambda r: (is_secondary(r["message"]), r["time"], r["rank"]))
    return LaunchError(first["rank"], first["message"], first["traceback"].strip())


def _refuse_an_unguarded_call(method: str) -> None:
    """Refuse, in one line, a launch from the top level of a script outside ``if __name__ == "__main__":``.

    A spawned (or forkserver) child imports the script's ``__main__`` again, so an unguarded call
    runs once more in each child, where multiprocessing stops it in its bootstrapping phase: every
    worker failed before it reached the function, and all the launch could say was "<NONE>". The
    script's top-level statement that is running now is read from its source; a file that cannot
    be read or parsed is not refused.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if _package_main() is not None:  # its children never import it: the function is what they miss
        return
    frame = sys._getframe(1)
    while frame is not None and not (
        frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__"
    ):
        frame = frame.f_back
    if frame is None or not path or frame.f_code.co_filename != path:
        return
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return
    line = frame.f_lineno
    statement = next((n for n in tree.body if n.lineno <= line <= (n.end_lineno or n.lineno)), None)
    if statement is None or (isinstance(statement, ast.If) and _is_main_guard(statement.test)):
        return
    raise UsageError(
        f"ddpkit.launch: {Path(path).name} line {line} reaches it from the script's top level, which each worker "
        f"runs again when it imports the script (start method {method!r}); put that code under "
        '`if __name__ == "__main__":`'
    )


def _refuse_what_children_cannot_import(fn: Callable[..., Any], method: str) -> None:
    """Refuse, in one line, a function a spawned child cannot get: it is sent by name and imported there.

    A lambda or a function defined inside another has no name to import (pickle says "Can't pickle
    local object"); a function the script defines under ``if __name__ == "__main__":`` has one, but the
    child imports the script without running that block, and every worker failed before it reached the
    function with "Can't get attribute" in two tracebacks a worker. A script that cannot be read or
    parsed is not refused.
    """
    name = getattr(fn, "__qualname__", type(fn).__name__)
    how = f"(start method {method!r}): define it with def at the top level of a module"
    if "<lambda>" in name or "<locals>" in name:
        kind = "a lambda" if name.endswith("<lambda>") else "defined inside a function"
        raise UsageError(f"ddpkit.launch: {name} is {kind}, which the workers cannot import {how}")
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(fn, "__module__", None) != "__main__" or not path:
        return
    package = _package_main()
    if package is not None:
        raise UsageError(
            f"ddpkit.launch: {name} is defined in {package}'s __main__.py (python -m {package}), which "
            f"workers started by {method!r} never import; define it in another module of {package} and "
            "import it, or leave start_method unset (a package's __main__ starts its workers by fork)"
        )
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return
    if name.split(".")[0] not in _names_an_import_binds(tree.body):
        raise UsageError(
            f'ddpkit.launch: {name} is defined under `if __name__ == "__main__":` in {Path(path).name}, which the '
            f"workers do not run when they import the script {how}, above that block"
        )


def _names_an_import_binds(body: list[ast.stmt]) -> set[str]:
    """The names a module's statements bind when it is imported: its definitions, assignments and imports,
    inside its ``if``/``try``/``with``/``for``/``while``/``match`` blocks too, but not under
    ``if __name__ == "__main__":`` (its ``else:`` does run)."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If):  # the main guard's `else:` runs on import; its body does not
            names |= _names_an_import_binds(node.orelse)
            if not _is_main_guard(node.test):
                names |= _names_an_import_binds(node.body)
        elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                names |= _names_an_import_binds(block)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            names |= _names_an_import_binds(node.body) | _names_an_import_binds(node.orelse)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            names |= _names_an_import_binds(node.body)
        elif isinstance(node, ast.Match):
            for case in node.cases:
                names |= _names_an_import_binds(case.body)
    return names


def _is_main_guard(test: ast.expr) -> bool:
    """``__name__ == "__main__"``, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    texts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and texts == ["__main__"]


def _interactive() -> bool:
    """Whether ``__main__`` is no file a spawned child could run again: a notebook, a REPL, ``python -c``
    or ``python -`` (whose ``__file__`` is ``"<stdin>"``)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return not (path and os.path.isfile(path))


def _cuda_started() -> bool:
    import torch

    return torch.cuda.is_initialized()


def _package_main() -> str | None:
    """The package whose ``__main__.py`` runs as ``__main__`` (``python -m pkg``), else None: spawned
    children never import it (multiprocessing leaves a package's ``__main__`` out)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None) or ""
    return name.removesuffix(".__main__") if name.endswith(".__main__") else None


def _start_method(fn: Callable[..., Any]) -> str:
    # A function of an interactive __main__, or of a package's __main__.py, cannot be imported by a
    # spawned child: fork it. Everything else gets the safe default, spawn.
    if getattr(fn, "__module__", None) == "__main__" and (_interactive() or _package_main()):
        return "fork"
    return "spawn"


FORKED_AFTER_CUDA = (
    "; this process had started CUDA before the fork (torch.cuda.is_available() does, unless "
    "PYTORCH_NVML_BASED_CUDA_CHECK=1 is set before it), which forked workers cannot use: restart the "
    "notebook's kernel and set os.environ['PYTORCH_NVML_BASED_CUDA_CHECK'] = '1' in its first cell, or "
    "define the function in a .py file and import it, which starts by spawn"
)


def _after_cuda_in_the_parent(error: LaunchError, method: str) -> LaunchError:
    """``error`` with what to do where a forked worker's CUDA failed to start ("CUDA error: initialization
    error"): the parent's ``torch.cuda.is_available()`` starts the driver, which :func:`_cuda_started`
    cannot see (torch has not initialized itself), and a fork cannot use it."""
    if method != "fork" or "initialization error" not in str(error) or "CUDA" not in str(error):
        return error
    return LaunchError(error.rank, f"{error.message}{FORKED_AFTER_CUDA}", error.child_traceback)


def _launch_error(rank: int, failure: Any) -> LaunchError:
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message", {}) if isinstance(data, dict) else {}
    if isinstance(message, dict):
        text = str(message.get("message", "")).strip()
        traceback = str(message.get("extraInfo", {}).get("py_callstack", "")).strip()
    else:
        text, traceback = str(message), ""
    if text == "<NONE>":  # torch's placeholder: the worker wrote no error file (it failed before the function)
        text = f"{describe(failure)}, before it reached the function; its output above says why"
    return LaunchError(rank, text or describe(failure), traceback)
