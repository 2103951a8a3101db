"""``ddpkit slurm``: an sbatch script that runs ``srun ddpkit run ...``, one task per node.

Inside the job, ``ddpkit run`` reads nodes, node rank and master from SLURM (see
:func:`ddpkit.dist.torchrun.torchrun_args`), so the script needs no addresses or ports.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import sys
from typing import Sequence

from ddpkit._argparse import Parser
from ddpkit.errors import UsageError

_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


def sbatch_script(script: str, script_args: Sequence[str], *, nodes: int, gpus_per_node: int = 0,
                  nproc_per_node: int | None = None, cpus_per_task: int | None = None,
                  partition: str | None = None, time: str | None = None, job_name: str = "ddpkit",
                  max_restarts: int = 0, ddpkit_command: str | None = None) -> str:
    """The text of an sbatch script for ``script`` on ``nodes`` nodes.

    Each node gets one task (``srun --ntasks-per-node=1``) that runs ``ddpkit run`` with one
    process per GPU (or ``nproc_per_node``); the rendezvous port is derived from the job id.

    Args:
        script: the training script each node's ``ddpkit run`` starts.
        script_args: its arguments.
        nodes: ``#SBATCH --nodes``.
        gpus_per_node: ``#SBATCH --gpus-per-node`` (0: none asked for).
        nproc_per_node: processes per node (default: ``gpus_per_node``, else 1).
        cpus_per_task: ``#SBATCH --cpus-per-task`` of each node's one task.
        partition: ``#SBATCH --partition``.
        time: ``#SBATCH --time``, in one of SLURM's forms (``30``, ``4:00:00``, ``1-12:00:00``).
        job_name: ``#SBATCH --job-name``.
        max_restarts: ``ddpkit run --max-restarts``.
        ddpkit_command: the ``ddpkit`` to run (default: the one running now, else the one on PATH).

    Raises:
        UsageError: a count out of range or a time SLURM would not take.
    """
    if nodes < 1:
        raise UsageError(f"--nodes must be at least 1, got {nodes}")
    if gpus_per_node < 0 or (cpus_per_task is not None and cpus_per_task < 1):
        raise UsageError("--gpus-per-node must be 0 or more and --cpus-per-task at least 1")
    if time is not None and not _TIME.match(time):
        raise UsageError(f"--time {time!r}: use SLURM's forms, e.g. 30, 4:00:00 or 1-12:00:00")
    nproc = nproc_per_node or gpus_per_node or 1
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1"]
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={cpus_per_task}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if time:
        lines.append(f"#SBATCH --time={time}")
    lines.append("#SBATCH --output=%x-%j.out")
    command = ddpkit_command or _ddpkit_command()
    run = [command, "run", "-n", str(nproc)]
    if max_restarts:
        run += ["--max-restarts", str(max_restarts)]
    run += [script, *script_args]
    lines += [
        "",
        "# One ddpkit run per node; it reads nodes, node rank and master from SLURM.",
        "# The c10d store is unauthenticated: the job's nodes must reach each other on a private network.",
        "set -euo pipefail",
        "srun --ntasks-per-node=1 " + " ".join(shlex.quote(part) for part in run),
    ]
    return "\n".join(lines) + "\n"


def _ddpkit_command() -> str:
    """The ddpkit that is running now (the job may not activate its environment), else the one on PATH."""
    import os

    if os.path.basename(sys.argv[0]) == "ddpkit" and os.path.isfile(sys.argv[0]):
        return os.path.abspath(sys.argv[0])
    return shutil.which("ddpkit") or "ddpkit"


def cmd_slurm(argv: Sequence[str]) -> int:
    """``ddpkit slurm``: print the sbatch script of the flags on stdout; 0."""
    parser = Parser(prog="ddpkit slurm", description="Print an sbatch script that runs SCRIPT with ddpkit on N nodes.")
    parser.add_argument("--nodes", type=int, required=True, help="number of nodes")
    parser.add_argument("--gpus-per-node", dest="gpus_per_node", type=int, default=0, help="GPUs per node")
    parser.add_argument("--nproc-per-node", dest="nproc_per_node", type=int, default=None,
                        help="processes per node (default: GPUs per node, else 1)")
    parser.add_argument("--cpus-per-task", dest="cpus_per_task", type=int, default=None, help="CPUs of each node's task")
    parser.add_argument("--partition", default=None, help="SLURM partition")
    parser.add_argument("--time", default=None, help="time limit, e.g. 4:00:00")
    parser.add_argument("--job-name", dest="job_name", default="ddpkit", help="job name (default ddpkit)")
    parser.add_argument("--max-restarts", dest="max_restarts", type=int, default=0, help="restarts after a failure")
    parser.add_argument("script", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    opts = parser.parse_args(argv)
    sys.stdout.write(sbatch_script(opts.script, opts.args, nodes=opts.nodes, gpus_per_node=opts.gpus_per_node,
                                   nproc_per_node=opts.nproc_per_node, cpus_per_task=opts.cpus_per_task,
                                   partition=opts.partition, time=opts.time, job_name=opts.job_name,
                                   max_restarts=opts.max_restarts))
    return 0
