"""The argument parser every ``ddpkit`` command uses, below the commands that borrow it.

:mod:`ddpkit.cli`, :mod:`ddpkit.bench` and :mod:`ddpkit.slurm` all build their parsers from
:class:`Parser`; it lives here, under all three, so that none of them imports another to get it
(``cli`` imports ``bench`` and ``slurm`` to run their commands).
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
        raise UsageError(f"{message} (see '{self.prog} --help')")
