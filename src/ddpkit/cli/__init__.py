"""The ``ddpkit`` command line: ``main`` picks the command, one module per command does the rest.

Usage errors are one line on stderr and exit code 2 (:class:`~ddpkit.errors.UsageError`); any
other :class:`~ddpkit.errors.DdpkitError` is one line with its own exit code. The flags of
``ddpkit train`` and ``ddpkit predict`` are made from the fields of their config dataclasses
(:func:`ddpkit._argparse.add_fields`), so each setting's help is its field's docstring.

Nothing in ddpkit imports this package but ``python -m ddpkit`` (``ddpkit/__main__.py``): it is
the top layer, checked by import-linter.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from ddpkit.cli import bench, demo, doctor, export, predict, run, slurm, train
from ddpkit.errors import DdpkitError, UsageError

COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "run": (run.cmd_run, "start a script in N processes per node (over torch.distributed.run)"),
    "train": (train.cmd_train, "train a built-in recipe (convnet/mlp/resnet on digits/mnist/cifar10/synthetic)"),
    "predict": (predict.cmd_predict, "predict with a ddpkit train checkpoint, one row per input in input order"),
    "bench": (bench.cmd_bench, "measure throughput, scaling, memory and the step breakdown per mode"),
    "export": (export.cmd_export, "write a checkpoint's model weights (sharded or not) as one plain state dict"),
    "slurm": (slurm.cmd_slurm, "print an sbatch script that runs a script with ddpkit on N nodes"),
    "doctor": (doctor.cmd_doctor, "check this machine and launch for what would make a run fail"),
    "demo": (demo.cmd_demo, "run the built-in end-to-end demonstration"),
}
"""Each command's function (its arguments after the command's name -> exit code) and one line of help."""


def _usage() -> str:
    lines = ["usage: ddpkit COMMAND [OPTIONS]", "", "commands:"]
    lines += [f"  {name:<8} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "'ddpkit COMMAND --help' describes a command."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ddpkit`` console script.

    Output piped into a reader that stops early (``ddpkit train --help | head``) ends the command
    quietly, as in other command-line tools, instead of with a ``BrokenPipeError`` traceback.
    """
    try:
        try:
            return _main(list(sys.argv[1:] if argv is None else argv))
        finally:
            sys.stdout.flush()  # here, not at exit, so a closed pipe is caught below
            if argv is None:  # the console script, which exits next
                _quick_exit()
    except BrokenPipeError:
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141  # 128 + SIGPIPE, as a shell reports


def _quick_exit() -> None:
    """Spare the interpreter's last garbage collection over torch's objects (0.7 s of CPU here).

    With torch imported, exiting spends most of a second in the collection at shutdown. The
    command's own work is done and closed by now (files, trackers, the launcher's workers); what
    an ``atexit`` handler does still runs, and objects still free by reference counting. Only
    ``main()`` as the console script does this, never a caller that goes on running.
    """
    import gc

    gc.collect()  # finalizers of garbage already unreachable still run, now
    gc.freeze()


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from ddpkit._version import __version__

        print(f"ddpkit {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    try:
        if name not in COMMANDS:
            raise UsageError(f"unknown command {name!r}; choose one of {', '.join(COMMANDS)}")
        return COMMANDS[name][0](rest)
    except DdpkitError as exc:
        sys.stderr.write(f"ddpkit {name}: error: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write(f"ddpkit {name}: interrupted\n")
        return 130
