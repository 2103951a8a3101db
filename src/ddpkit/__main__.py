"""``python -m ddpkit COMMAND ...``: the ``ddpkit`` command, where the console script is not on PATH."""

import sys

from ddpkit.cli import main

sys.exit(main())
