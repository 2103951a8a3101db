"""Errors that ddpkit reports to users as one clear line instead of a traceback."""

from __future__ import annotations


class DdpkitError(Exception):
    """A problem the user can fix; the CLI prints its message alone and exits with ``exit_code``."""

    exit_code = 1


class UsageError(DdpkitError):
    """Bad flags, paths or values given by the user (exit code 2, like argparse)."""

    exit_code = 2


def _is_file(stream) -> bool:  # type: ignore[no-untyped-def]
    try:
        stream.fileno()
    except (OSError, ValueError, AttributeError):
        return False           # io.StringIO and the like: not where the user would look
    return True


def install_excepthook() -> None:
    """Report an uncaught :class:`DdpkitError` in a user script as one line, with its exit code.

    Other exceptions keep the previous hook and their traceback. Exit handlers still run
    (the process group is destroyed) before the process exits.
    """
    import os
    import sys

    previous = sys.excepthook
    if getattr(previous, "_ddpkit", False):
        return

    def hook(kind, value, traceback):  # type: ignore[no-untyped-def]
        if not isinstance(value, DdpkitError):
            previous(kind, value, traceback)
            return
        import atexit

        # torch's init_process_group wraps this hook and points sys.stderr at a buffer it prints
        # after the hook returns; this one never returns (os._exit), so write past the buffer.
        stream = sys.stderr if _is_file(sys.stderr) else sys.__stderr__
        rank = os.environ.get("RANK")
        prefix = f"[rank{rank}]: " if rank is not None and stream is not sys.stderr else ""
        stream.write(f"{prefix}ddpkit: error: {value}\n")
        stream.flush()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        os._exit(value.exit_code)

    hook._ddpkit = True  # type: ignore[attr-defined]
    sys.excepthook = hook
