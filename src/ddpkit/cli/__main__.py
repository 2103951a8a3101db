"""``python -m ddpkit.cli COMMAND ...``: the ``ddpkit`` command (``ddpkit bench --hosts`` starts it so)."""

import sys

from ddpkit.cli import main

sys.exit(main())
