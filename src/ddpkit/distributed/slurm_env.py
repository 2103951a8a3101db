"""SLURM's variables and host lists: nodes, tasks per node, and the port of a job.

:mod:`ddpkit.distributed.environment` reads a task started by ``srun`` through these; ``ddpkit run``
under ``srun`` takes its nodes and master from there (:mod:`ddpkit.distributed.torchrun`).

Example:
    >>> expand_nodelist("node[01-03],gpu5")
    ['node01', 'node02', 'node03', 'gpu5']
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ddpkit.distributed._vars import read_int as _int
from ddpkit.errors import DdpkitError

_SLURM_PORT_BASE = 15000
_SLURM_PORT_SPAN = 20000


def slurm_port(environ: Mapping[str, str]) -> int:
    """A port derived from the job id, so concurrent jobs on one node do not collide."""
    job_id = re.sub(r"\D", "", environ.get("SLURM_JOB_ID", "")) or "0"
    return _SLURM_PORT_BASE + int(job_id) % _SLURM_PORT_SPAN


def slurm_tasks_on_node(environ: Mapping[str, str], world_size: int, num_hosts: int) -> int:
    """Tasks on this node, from ``SLURM_NTASKS_PER_NODE`` or the ``2(x3),1`` form."""
    if environ.get("SLURM_NTASKS_PER_NODE"):
        return _int(environ, "SLURM_NTASKS_PER_NODE")
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if spec:
        counts: list[int] = []
        for part in spec.split(","):
            match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
            if match:
                counts += [int(match.group(1))] * int(match.group(2) or 1)
        node = _int(environ, "SLURM_NODEID", 0)
        if node < len(counts):
            return counts[node]
    return max(1, world_size // max(1, num_hosts))


_RANGE = re.compile(r"\[([^\]]*)\]")


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list such as ``node[01-03,07],gpu5`` or ``a[1-2]-b[3-4]``.

    Zero padding is kept (``node[08-10]`` gives ``node08 node09 node10``). Several bracket
    groups in one name expand as a product, in SLURM's order.

    Raises:
        DdpkitError: unbalanced brackets or a malformed range.
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts.extend(_expand_host(item))
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    items, depth, current = [], 0, []
    for char in nodelist.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise DdpkitError(f"SLURM node list {nodelist!r} has an unbalanced ']'")
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise DdpkitError(f"SLURM node list {nodelist!r} has an unbalanced '['")
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def _expand_host(pattern: str) -> list[str]:
    match = _RANGE.search(pattern)
    if match is None:
        return [pattern]
    prefix, suffix = pattern[: match.start()], pattern[match.end() :]
    expanded = []
    for value in _expand_ranges(match.group(1), pattern):
        expanded.extend(_expand_host(prefix + value + suffix))
    return expanded


def _expand_ranges(spec: str, pattern: str) -> list[str]:
    values = []
    for part in spec.split(","):
        part = part.strip()
        bounds = part.split("-")
        if len(bounds) == 1 and part.isdigit():
            values.append(part)
        elif len(bounds) == 2 and bounds[0].isdigit() and bounds[1].isdigit():
            low, high = int(bounds[0]), int(bounds[1])
            if high < low:
                raise DdpkitError(f"SLURM node list {pattern!r}: range {part} runs backwards")
            width = len(bounds[0])
            values.extend(str(n).zfill(width) for n in range(low, high + 1))
        else:
            raise DdpkitError(f"SLURM node list {pattern!r}: cannot read range {part!r}")
    return values
