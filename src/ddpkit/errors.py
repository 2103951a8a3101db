"""Errors that ddpkit reports to users as one clear line instead of a traceback."""

from __future__ import annotations


class DdpkitError(Exception):
    """A problem the user can fix; the CLI prints its message alone and exits with ``exit_code``."""

    exit_code = 1


class UsageError(DdpkitError):
    """Bad flags, paths or values given by the user (exit code 2, like argparse)."""

    exit_code = 2
