"""The seed-002 scenario: does adding hosts make an epoch faster?

Starts N "hosts" (one ``ddpkit train`` agent each, one process per host) on loopback for
N = 1, 2, 3, with the same global batch, and prints the time per epoch of each:

    python benchmarks/hosts.py --hosts 1,2,3 --epochs 3 --out runs/hosts --global-batch 48

Each host is a separate elastic agent joined through the c10d store at 127.0.0.1, exactly as
separate machines would be (see tests/test_multinode.py for hosts in network namespaces).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from ddpkit.distributed.host import free_port


def run_hosts(hosts: int, epochs: int, out: Path, extra: list[str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    master = f"127.0.0.1:{free_port()}"
    ddpkit = str(Path(sys.executable).with_name("ddpkit"))
    procs = [subprocess.Popen([ddpkit, "train", "--nproc", "1", "--nnodes", str(hosts), "--node-rank", str(rank),
                               "--master", master, "--epochs", str(epochs), "--out", str(out), *extra],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for rank in range(hosts)]
    errors = [proc.communicate()[1] for proc in procs]
    if any(proc.returncode != 0 for proc in procs):
        raise SystemExit(f"{hosts} host(s) failed:\n" + "\n".join(e.strip()[-2000:] for e in errors if e.strip()))
    summary = json.loads((out / "summary.json").read_text())
    return {"hosts": hosts, "epoch_seconds": summary["train_seconds"] / epochs,
            "samples_per_second": summary["samples_per_second"], "test_accuracy": summary["test_accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="1,2,3")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default="runs/hosts")
    parser.add_argument("extra", nargs=argparse.REMAINDER,
                        help="more ddpkit train flags (the global batch must divide by every host count)")
    opts, unknown = parser.parse_known_args()
    opts.extra = unknown + opts.extra
    rows = [run_hosts(int(n), opts.epochs, Path(opts.out) / f"hosts{n}", opts.extra) for n in opts.hosts.split(",")]
    base = rows[0]["epoch_seconds"]
    print("| hosts | s / epoch | speed-up | samples/s | test accuracy |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['hosts']} | {row['epoch_seconds']:.3f} | {base / row['epoch_seconds']:.2f}x | "
              f"{row['samples_per_second']:.0f} | {row['test_accuracy']:.1%} |")


if __name__ == "__main__":
    main()
