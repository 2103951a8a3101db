"""A DdpkitError raised in a worker after init reaches the terminal as one line, with its exit code."""

from __future__ import annotations

import pytest

from helpers import ddpkit


@pytest.mark.timeout(150)
def test_usage_error_after_init_in_a_worker_is_printed_as_one_line(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("import ddpkit\nrt = ddpkit.init()\nraise ddpkit.UsageError('give --lr a number')\n")
    result = ddpkit("run", "-n", "2", str(script), timeout=140)
    assert result.returncode == 1                      # ddpkit run: a rank failed
    # torch's init_process_group buffers stderr around the excepthook; the line must get out anyway
    assert "ddpkit: error: give --lr a number" in result.stderr
    assert "exit code 2" in result.stderr              # the worker's own status for a usage error
    assert "Traceback" not in result.stderr
