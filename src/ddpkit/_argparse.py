"""The argument parser every ``ddpkit`` command uses, in the base layer below all of them.

The commands of :mod:`ddpkit.cli`, ``ddpkit bench`` (:mod:`ddpkit.bench.plan`) and
:mod:`ddpkit.slurm` build their parsers from :class:`Parser`. It needs only
:mod:`ddpkit.errors`, so it lives with the base modules: ``bench`` sits below ``cli`` and must
not import it, and ``cli`` imports ``bench`` and ``slurm`` to run their commands.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

from ddpkit.errors import UsageError


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line, without the usage block.

    The error is raised as :class:`~ddpkit.errors.UsageError`, so the CLI prints it as
    ``ddpkit COMMAND: error: ...`` and exits 2, like argparse, and code calling a command
    in-process (tests) can catch it.
    """

    def error(self, message: str) -> NoReturn:
        """Raise ``message`` as a :class:`~ddpkit.errors.UsageError` naming ``PROG --help``."""
        raise UsageError(f"{message} (see '{self.prog} --help')")
