"""``ddpkit slurm``: an sbatch script that runs ``srun ddpkit run ...``, one task per node.

Inside the job, ``ddpkit run`` reads nodes, node rank and master from SLURM (see
:func:`ddpkit.distributed.torchrun.torchrun_args`), so the script needs no addresses or ports.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import sys
from collections.abc import Sequence

from ddpkit._argparse import Parser
from ddpkit.distributed.preemption import EXIT_CODE
from ddpkit.errors import UsageError

_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")

PREEMPT_SIGNAL_S = 120
"""Default lead of SLURM's warning signal over the time limit (``--preempt-signal-s``)."""


def sbatch_script(
    script: str,
    script_args: Sequence[str],
    *,
    nodes: int,
    gpus_per_node: int = 0,
    nproc_per_node: int | None = None,
    cpus_per_task: int | None = None,
    partition: str | None = None,
    time: str | None = None,
    job_name: str = "ddpkit",
    max_restarts: int = 0,
    ddpkit_command: str | None = None,
    requeue: bool = False,
    preempt_signal_s: int = PREEMPT_SIGNAL_S,
) -> str:
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
        requeue: ask SLURM for SIGUSR1 ``preempt_signal_s`` seconds before the time limit (and
            on preemption), pass it to the ranks, which save a checkpoint and exit with 75, and
            requeue the job then; the requeued job resumes (the script needs ``resume="auto"``).
        preempt_signal_s: the warning's lead over the time limit, in seconds.

    Raises:
        UsageError: a count out of range, a time SLURM would not take, or ``requeue`` without a
            time limit or with a lead SLURM cannot give.
    """
    if nodes < 1:
        raise UsageError(f"--nodes must be at least 1, got {nodes}")
    if gpus_per_node < 0 or (cpus_per_task is not None and cpus_per_task < 1):
        raise UsageError("--gpus-per-node must be 0 or more and --cpus-per-task at least 1")
    if time is not None and not _TIME.match(time):
        raise UsageError(f"--time {time!r}: use SLURM's forms, e.g. 30, 4:00:00 or 1-12:00:00")
    if requeue:
        _check_requeue(time, preempt_signal_s)
    nproc = nproc_per_node or gpus_per_node or 1
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1"]
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={cpus_per_task}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if time:
        lines.append(f"#SBATCH --time={time}")
    if requeue:
        lines += [f"#SBATCH --signal=B:USR1@{preempt_signal_s}", "#SBATCH --requeue", "#SBATCH --open-mode=append"]
    lines.append("#SBATCH --output=%x-%j.out")
    command = ddpkit_command or _ddpkit_command()
    run = [command, "run", "-n", str(nproc)]
    if max_restarts:
        run += ["--max-restarts", str(max_restarts)]
    run += [script, *script_args]
    srun = "srun --ntasks-per-node=1 " + " ".join(shlex.quote(part) for part in run)
    lines += [
        "",
        "# One ddpkit run per node; it reads nodes, node rank and master from SLURM.",
        "# The c10d store is unauthenticated: the job's nodes must reach each other on a private network.",
    ]
    if not requeue:
        lines += ["set -euo pipefail", srun]
        return "\n".join(lines) + "\n"
    lines += _REQUEUE.format(srun=srun, code=EXIT_CODE).splitlines()
    return "\n".join(lines) + "\n"


# The batch step (outside any container the tasks run in) gets SIGUSR1, passes it to srun, which
# passes it to every node's ddpkit run and so to the ranks; they save and exit 75, and the batch
# step requeues the job with scontrol, which it has even where the tasks' container does not.
_REQUEUE = """# --requeue: SLURM sends SIGUSR1 to this script before the time limit (and on preemption);
# it passes it on, the ranks save a checkpoint and exit {code}, and the job is requeued, to resume.
set -uo pipefail
echo "ddpkit: job $SLURM_JOB_ID starts (restart ${{SLURM_RESTART_COUNT:-0}})"
{srun} &
step=$!
signalled=0
trap 'signalled=1; kill -USR1 "$step" 2>/dev/null' USR1
trap 'signalled=1; kill -TERM "$step" 2>/dev/null' TERM
code=0
wait "$step" || code=$?
while [ "$signalled" = 1 ]; do      # a signal ends wait early: wait for the step itself
  signalled=0
  code=0
  wait "$step" || code=$?
done
if [ "$code" = {code} ]; then
  if command -v scontrol >/dev/null 2>&1; then
    echo "ddpkit: preempted after saving a checkpoint; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" && exit 0
  fi
  echo "ddpkit: preempted after saving a checkpoint, but this batch step cannot requeue (no scontrol here): resubmit this script with sbatch and it resumes" >&2
fi
exit "$code"
"""


def _check_requeue(time: str | None, lead: int) -> None:
    """``--requeue`` needs a time limit the warning comes before, and a lead SLURM can give."""
    if time is None:
        raise UsageError(
            "--requeue needs --time: SLURM sends the warning signal --preempt-signal-s seconds before the time limit"
        )
    if not 1 <= lead <= 65535:
        raise UsageError(f"--preempt-signal-s must be 1 to 65535 seconds (SLURM's limit), got {lead}")
    limit = _seconds(time)
    if lead >= limit:
        raise UsageError(
            f"--preempt-signal-s {lead} is not before the end of --time {time} ({limit} s); "
            "give a shorter lead or a longer time"
        )


def _seconds(time: str) -> int:
    """SLURM's time forms in seconds: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    days, _, rest = time.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        parts += [0] * (3 - len(parts))
        hours, minutes, seconds = parts
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def _ddpkit_command() -> str:
    """The ddpkit that is running now (the job may not activate its environment), else the one on PATH."""
    import os

    if os.path.basename(sys.argv[0]) == "ddpkit" and os.path.isfile(sys.argv[0]):
        return os.path.abspath(sys.argv[0])
    return shutil.which("ddpkit") or "ddpkit"


def parser() -> argparse.ArgumentParser:
    """The parser of ``ddpkit slurm``."""
    parser = Parser(prog="ddpkit slurm", description="Print an sbatch script that runs SCRIPT with ddpkit on N nodes.")
    parser.add_argument("--nodes", type=int, required=True, help="number of nodes")
    parser.add_argument("--gpus-per-node", dest="gpus_per_node", type=int, default=0, help="GPUs per node")
    parser.add_argument(
        "--nproc-per-node",
        dest="nproc_per_node",
        type=int,
        default=None,
        help="processes per node (default: GPUs per node, else 1)",
    )
    parser.add_argument(
        "--cpus-per-task", dest="cpus_per_task", type=int, default=None, help="CPUs of each node's task"
    )
    parser.add_argument("--partition", default=None, help="SLURM partition")
    parser.add_argument("--time", default=None, help="time limit, e.g. 4:00:00")
    parser.add_argument("--job-name", dest="job_name", default="ddpkit", help="job name (default ddpkit)")
    parser.add_argument("--max-restarts", dest="max_restarts", type=int, default=0, help="restarts after a failure")
    parser.add_argument(
        "--requeue",
        action="store_true",
        help="before the time limit (and on preemption) SLURM signals the job, the ranks save a "
        "checkpoint and exit 75, and the job is requeued to resume (needs --time, and "
        "resume='auto' in the script)",
    )
    parser.add_argument(
        "--preempt-signal-s",
        dest="preempt_signal_s",
        type=int,
        default=PREEMPT_SIGNAL_S,
        help=f"with --requeue: seconds before the time limit SLURM sends SIGUSR1 (default {PREEMPT_SIGNAL_S})",
    )
    parser.add_argument("script", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def cmd_slurm(argv: Sequence[str]) -> int:
    """``ddpkit slurm``: print the sbatch script of the flags on stdout; 0."""
    opts = parser().parse_args(argv)
    sys.stdout.write(
        sbatch_script(
            opts.script,
            opts.args,
            nodes=opts.nodes,
            gpus_per_node=opts.gpus_per_node,
            nproc_per_node=opts.nproc_per_node,
            cpus_per_task=opts.cpus_per_task,
            partition=opts.partition,
            time=opts.time,
            job_name=opts.job_name,
            max_restarts=opts.max_restarts,
            requeue=opts.requeue,
            preempt_signal_s=opts.preempt_signal_s,
        )
    )
    return 0
