"""Reading one launcher variable: an integer, a port or a comma list, each failure one line naming the
variable.

Shared by the launcher readers of :mod:`ddpkit.distributed.environment`, the SLURM helpers of
:mod:`ddpkit.distributed.slurm_env` and :mod:`ddpkit.distributed.host`'s GPU list, which all import it
(none imports the others' readers).
"""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.errors import UsageError


def read_int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    """``environ[name]`` as an integer; ``default`` when it is unset or empty.

    Raises:
        UsageError: the variable is missing and there is no default, or it is not an integer.
    """
    value = environ.get(name)
    if value is None or value == "":
        if default is None:
            raise UsageError(f"environment variable {name} is missing; the launcher did not set it")
        return default
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"environment variable {name}={value!r} is not an integer") from None


def read_port(environ: Mapping[str, str], name: str, default: int) -> int:
    """``environ[name]`` as a port (1-65535); ``default`` when it is unset or empty.

    Raises:
        UsageError: not an integer, or outside 1-65535.
    """
    port = read_int(environ, name, default)
    if not 0 < port < 65536:
        raise UsageError(f"{name}={port} is not a valid port; use 1-65535")
    return port


def read_list(environ: Mapping[str, str], name: str) -> list[str]:
    """``environ[name]``'s comma-separated items, blanks dropped (``CUDA_VISIBLE_DEVICES``,
    ``SLURM_STEP_GPUS``); empty when it is unset."""
    return [item.strip() for item in environ.get(name, "").split(",") if item.strip()]
