"""A held-out language model on slow links: ddpkit's chosen period against Accelerate and torchft.

Issue 46's measure on a workload no ddpkit default was tuned on: a character transformer (4
layers, width 256, 3.2M parameters, sequences of 64 bytes) on another corpus (the source of the
Python standard library's top-level modules, which every machine running this has: the last 5% of
its windows are the validation split), for ``--steps`` AdamW steps of one global batch. Each loop
is started on its own simulated hosts (:class:`ddpkit.bench.netsim.SimulatedHosts`, one process
per host), and in one run of this script:

- ``every-step``: ddpkit's every-step DDP on an unshaped link (10 Gbit/s): the speed and the loss
  to match;
- ``ddpkit``: ``rt.setup(model, optimizer, sync="diloco")`` with no ``sync_every``, on the shaped
  link: the period, delay and exchange precision chosen from the link;
- ``accelerate``: Accelerate's ``LocalSGD`` as its documentation writes it (steps under
  ``no_sync``, the model averaged in fp32 every ``local_sgd_steps``);
- ``torchft``: torchft's ``DiLoCo`` (a ``Manager`` per host, its lighthouse on host 0, its
  example's outer Nesterov SGD, lr 0.7, momentum 0.9);
- ``ddpkit-ft``: the ``ddpkit`` loop under ``ddpkit run --fault-tolerant`` (a replica per host, the
  period chosen inside a quorum, behind one step at most), nobody killed: what fault tolerance costs
  a chosen period. A replica's steps take their batches from ``rt.loader`` (a quorum forms at each),
  so its windows are the loader's shuffle of the same split, as many a step.

The peers run with the period ddpkit chose on the same link (``--peer-every chosen``), or with
the periods given (``--peer-every 200`` or ``chosen,200``). Every loop trains the same model from
the same seed on the same global batches (step ``s`` takes the windows ``perm[s*G:(s+1)*G]`` of
one seeded permutation, rank ``r`` its ``r``-th slice), so the loops differ only in how they sync.
A loop's speed is its samples over the wall time from the end of the warm-up steps to the end of
its loop (its last exchange included); its loss is the validation loss of rank 0's weights after
the loop. Needs root (network namespaces and ``tc``), Accelerate and torchft::

    sudo python benchmarks/heldout_lm.py --hosts 2 --link-mbit 10 --steps 800 --out runs/heldout
    sudo python benchmarks/heldout_lm.py --hosts 2 --link-mbit 1 --loops every-step,ddpkit --out runs/heldout-1

Prints one table and writes ``heldout.json`` to ``--out``. ``--corpus torch-nn --width 192
--layers 6`` is a third workload (torch's ``torch/nn`` sources, 2.7M parameters), to check on
data and a model size nobody chose a default on what the held-out one was used to choose. One
loop alone, on loopback and without shaping (its quality; the speed needs the simulated hosts)::

    ddpkit run -n 2 benchmarks/heldout_lm.py --worker ddpkit --sync-every 2 --sync-delay 1 \
        --sync-dtype sparse --sparse-density 0.0078125 --corpus torch-nn --width 192 --layers 6 \
        --steps 600 --out runs/third-128
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SEQ = 64
VOCAB = 128
PORT = 29533
LIGHTHOUSE_PORT = 29534
UNSHAPED_MBIT = 10000.0
LOOPS = ("every-step", "ddpkit", "accelerate", "torchft", "ddpkit-ft")


# -- the workload ---------------------------------------------------------------------------------

CORPORA = {
    "stdlib": lambda: sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")),
    "torch-nn": lambda: sorted(Path(torch.__file__).parent.joinpath("nn").rglob("*.py")),
}
"""The corpora: the standard library's top-level modules (the held-out workload), or torch's
``torch/nn`` package (a third workload, checked after the held-out one chose the sparse shares)."""


def corpus(name: str = "stdlib", limit: int = 3_000_000) -> torch.Tensor:
    """The corpus' ``.py`` files, in path order, as ASCII codes (others: ``?``)."""
    text = bytearray()
    for path in CORPORA[name]():
        text += path.read_bytes()
        if len(text) >= limit:
            break
    codes = torch.frombuffer(bytearray(text[:limit]), dtype=torch.uint8).long()
    return torch.where(codes < VOCAB, codes, torch.full_like(codes, ord("?")))


def windows(name: str = "stdlib") -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows of ``SEQ + 1`` codes: (train, validation), the last 5% validating."""
    codes = corpus(name)
    count = codes.numel() // (SEQ + 1)
    rows = codes[: count * (SEQ + 1)].view(count, SEQ + 1)
    split = count - max(1, count // 20)
    return rows[:split], rows[split:]


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        batch, length, width = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(batch, length, 3, self.heads, width // self.heads).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)
        h = h + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return h + self.fc2(F.gelu(self.fc1(self.norm2(h))))


class CharGPT(nn.Module):
    """A small decoder-only transformer over bytes."""

    def __init__(self, width: int = 256, layers: int = 4, heads: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.randn(SEQ, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def loss_of(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    logits = model(rows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1))


@torch.no_grad()
def validation_loss(model: nn.Module, rows: torch.Tensor) -> float:
    was = model.training
    model.eval()
    total = sum(loss_of(model, rows[i : i + 256]).item() * len(rows[i : i + 256]) for i in range(0, len(rows), 256))
    model.train(was)
    return total / len(rows)


class Batches:
    """Rank ``rank``'s slice of the global batch of each step, the same for every loop."""

    def __init__(self, train: torch.Tensor, per_rank: int, rank: int, world: int, seed: int) -> None:
        self.train, self.per_rank, self.rank, self.world = train, per_rank, rank, world
        self.order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))

    def __call__(self, step: int) -> torch.Tensor:
        size = self.per_rank * self.world
        start = (step * size) % (len(self.order) - size + 1)
        mine = self.order[start + self.rank * self.per_rank : start + (self.rank + 1) * self.per_rank]
        return self.train[mine]


# -- the loops (one process per host) -------------------------------------------------------------

def _report(opts: argparse.Namespace, model: nn.Module, val: torch.Tensor, started: float, **extra: Any) -> None:
    seconds = time.perf_counter() - started
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if opts.worker == "torchft":
        world = int(os.environ["NUM_REPLICA_GROUPS"])
    elif opts.worker == "ddpkit-ft":
        world = int(os.environ["DDPKIT_FT_REPLICAS"])
    result = {
        "loop": opts.worker,
        "timed_s": round(seconds, 3),
        "samples_per_s": round(opts.steps * opts.batch * world / seconds, 2),
        "val_loss": round(validation_loss(model, val), 5),
        **extra,
    }
    (Path(opts.out) / "result.json").write_text(json.dumps(result))


def _ddpkit(opts: argparse.Namespace) -> None:
    import ddpkit
    from ddpkit.parallel import periodic

    if opts.sparse_density:
        from ddpkit.parallel import periodic_parts

        periodic_parts.SPARSE_DENSITY = opts.sparse_density
    if opts.max_delay:
        from ddpkit.parallel import periodic_parts

        periodic_parts.MAX_DELAY = opts.max_delay
    rt = ddpkit.init(seed=opts.seed)
    train, val = windows(opts.corpus)
    torch.manual_seed(opts.seed)
    model = CharGPT(opts.width, opts.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.01)
    kwargs: dict[str, Any] = {} if opts.worker == "every-step" else {"sync": "diloco"}
    if opts.sync_every and opts.worker != "every-step":  # a period given (the quality of another choice)
        kwargs.update(sync_every=opts.sync_every, sync_delay=opts.sync_delay, sync_dtype=opts.sync_dtype,
                      outer_lr=opts.outer_lr, outer_momentum=0.0)
    model, optimizer = rt.setup(model, optimizer, **kwargs)
    started, redone = time.perf_counter(), 0
    if rt.replica is not None or opts.loader:  # a fault-tolerant replica: each step's batch from rt.loader
        replicas = int(os.environ["DDPKIT_FT_REPLICAS"]) if rt.replica is not None else rt.world_size
        loader = rt.loader(torch.utils.data.TensorDataset(train), global_batch_size=opts.batch * replicas, shuffle=True)
        committed = 0
        for _ in rt.epochs(1):
            for (rows,) in loader:
                if committed == opts.warmup:
                    started = time.perf_counter()
                rt.backward(loss_of(model, rows))
                if rt.step(optimizer):
                    committed += 1
                else:
                    redone += 1
                if committed == opts.warmup + opts.steps:
                    break
    else:
        batches = Batches(train, opts.batch, rt.rank, rt.world_size, opts.seed)
        for _ in rt.epochs(1):
            for step in range(opts.warmup + opts.steps):
                if step == opts.warmup:
                    started = time.perf_counter()
                rt.backward(loss_of(model, batches(step)))
                rt.step(optimizer)
    # rt.epochs ended with the final exchange: every rank holds the common model
    syncer = periodic.of(model)
    if rt.is_main:
        decision = None if syncer is None else syncer.decision
        _report(opts, model, val, started, decision=decision, sync_every=opts.sync_every or None,
                sync_delay=opts.sync_delay, sync_dtype=opts.sync_dtype, sparse_density=opts.sparse_density,
                redone=redone)


def _accelerate(opts: argparse.Namespace) -> None:
    from accelerate import Accelerator
    from accelerate.local_sgd import LocalSGD

    acc = Accelerator(cpu=not torch.cuda.is_available())
    train, val = windows(opts.corpus)
    torch.manual_seed(opts.seed)
    model = CharGPT(opts.width, opts.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.01)
    model, optimizer = acc.prepare(model, optimizer)
    batches = Batches(train, opts.batch, acc.process_index, acc.num_processes, opts.seed)
    started = time.perf_counter()
    with LocalSGD(accelerator=acc, model=model, local_sgd_steps=opts.every, enabled=True) as local_sgd:
        for step in range(opts.warmup + opts.steps):
            if step == opts.warmup:
                started = time.perf_counter()
            with acc.no_sync(model):
                acc.backward(loss_of(model, batches(step).to(acc.device)))
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
    if acc.process_index == 0:
        _report(opts, acc.unwrap_model(model), val, started, every=opts.every)


def _torchft(opts: argparse.Namespace) -> None:
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.local_sgd import DiLoCo

    group, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    train, val = windows(opts.corpus)
    torch.manual_seed(opts.seed)
    model = CharGPT(opts.width, opts.layers)
    inner = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.01)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        outer.load_state_dict(state["outer"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner": inner.state_dict(), "outer": outer.state_dict()}

    host = os.environ["HOST_ADDRESS"]
    pg = ProcessGroupGloo(timeout=timedelta(seconds=300))   # one fp32 exchange takes ~25 s at 10 Mbit/s
    store = torch.distributed.TCPStore(host, 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    manager = Manager(pg=pg, min_replica_size=groups, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"heldout_{group}", timeout=timedelta(seconds=600), rank=0, world_size=1,
                      use_async_quorum=False, init_sync=False, store_addr=host, store_port=store.port,
                      checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=60), device=torch.device("cpu")),
                      hostname=host)
    batches = Batches(train, opts.batch, group, groups, opts.seed)
    started = time.perf_counter()
    with DiLoCo(manager, [model], inner, outer, sync_every=opts.every, backup_device=torch.device("cpu"),
                pin_memory=False):
        for step in range(opts.warmup + opts.steps):
            if step == opts.warmup:
                started = time.perf_counter()
            inner.zero_grad()
            loss_of(model, batches(step)).backward()
            inner.step()
    if group == 0:
        _report(opts, model, val, started, every=opts.every, outer_steps=manager.current_step())
    manager.shutdown(wait=False)


# -- the driver ------------------------------------------------------------------------------------

_LIGHTHOUSE = """
import sys, time
from torchft._torchft import LighthouseServer
server = LighthouseServer(bind=sys.argv[1], min_replicas=int(sys.argv[2]), join_timeout_ms=10000, quorum_tick_ms=100)
print(server.address(), flush=True)
while True:
    time.sleep(3600)
"""


def run_loop(opts: argparse.Namespace, loop: str, link_mbit: float, every: int | None, out: Path) -> dict[str, Any]:
    """One loop on ``opts.hosts`` simulated hosts; its ``result.json``, or why it failed."""
    from ddpkit.bench import netsim
    from ddpkit.distributed.host import usable_cores

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    args = ["--worker", loop, "--out", str(out), "--steps", str(opts.steps), "--warmup", str(opts.warmup),
            "--batch", str(opts.batch), "--lr", str(opts.lr), "--seed", str(opts.seed), "--every", str(every or 0),
            "--corpus", opts.corpus, "--width", str(opts.width), "--layers", str(opts.layers)]
    args += ["--loader"] if opts.loader else []
    args += ["--max-delay", str(opts.max_delay)] if opts.max_delay else []
    if opts.sync_every:
        args += ["--sync-every", str(opts.sync_every), "--sync-delay", str(opts.sync_delay)]
        args += ["--sync-dtype", opts.sync_dtype] if opts.sync_dtype else []
    env = {"OMP_NUM_THREADS": str(max(1, usable_cores() // opts.hosts)), "PYTHONUNBUFFERED": "1", "RUST_LOG": "warn"}
    started = time.perf_counter()
    with netsim.SimulatedHosts(opts.hosts, link_mbit) as sim:
        logs = [open(out / f"host{h}.log", "w") for h in range(opts.hosts)]
        if loop == "torchft":
            lighthouse = sim.popen(0, [sys.executable, "-c", _LIGHTHOUSE, f"{sim.addresses[0]}:{LIGHTHOUSE_PORT}",
                                       str(opts.hosts)], stdout=subprocess.PIPE, text=True, env=env)
            assert lighthouse.stdout is not None
            lighthouse.stdout.readline()
            procs = [sim.popen(h, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                                   __file__, *args],
                               env={**env, "REPLICA_GROUP_ID": str(h), "NUM_REPLICA_GROUPS": str(opts.hosts),
                                    "TORCHFT_LIGHTHOUSE": f"http://{sim.addresses[0]}:{LIGHTHOUSE_PORT}",
                                    "HOST_ADDRESS": sim.addresses[h]},
                               stdout=logs[h], stderr=subprocess.STDOUT)
                     for h in range(opts.hosts)]
        elif loop == "ddpkit-ft":
            from ddpkit.distributed import ft_heal

            secret = out / "secret"
            ft_heal.write_secret(str(secret))
            procs = [sim.popen(h, [sys.executable, "-m", "ddpkit.cli", "run", "--fault-tolerant", "--secret-file",
                                   str(secret), "--min-replicas", str(opts.hosts), "--nnodes", str(opts.hosts),
                                   "--node-rank", str(h), "--master", f"{sim.addresses[0]}:{PORT}", "-n", "1",
                                   __file__, *args],
                               env=env, stdout=logs[h], stderr=subprocess.STDOUT)
                     for h in range(opts.hosts)]
        else:
            procs = [sim.popen(h, [sys.executable, "-m", "ddpkit.cli", "run", "--nnodes", str(opts.hosts),
                                   "--node-rank", str(h), "--master", f"{sim.addresses[0]}:{PORT}", "-n", "1",
                                   __file__, *args],
                               env=env, stdout=logs[h], stderr=subprocess.STDOUT)
                     for h in range(opts.hosts)]
        deadline = time.monotonic() + opts.timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.5)
        codes = [p.poll() for p in procs]
        for log in logs:
            log.close()
    found: dict[str, Any] = {"loop": loop, "link_mbit": link_mbit, "wall_s": round(time.perf_counter() - started, 1)}
    if any(code != 0 for code in codes) or not (out / "result.json").exists():
        found["failed"] = " / ".join(f"host {h} (exit {code}): " + " | ".join(
            (out / f"host{h}.log").read_text().strip().splitlines()[-3:]) for h, code in enumerate(codes) if code != 0)
        return found
    return {**found, **json.loads((out / "result.json").read_text())}


def _table(rows: list[dict[str, Any]]) -> str:
    reference = next((r for r in rows if r["loop"] == "every-step" and "failed" not in r), None)
    lines = ["| loop | link | period | samples/s | ÷ every step unshaped | validation loss | vs every step |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for row in rows:
        if "failed" in row:
            lines.append(f"| {row['loop']} | {row['link_mbit']:g} Mbit/s | failed: {row['failed'][:300]} |||||")
            continue
        decision = row.get("decision")
        if decision:
            period = f"chose {decision['every']}, delay {decision['delay']}, {decision.get('dtype', 'bf16')}"
            if decision.get("fragments", 1) > 1:
                period += f", {decision['fragments']} fragments"
        elif row.get("sync_every"):
            period = f"given {row['sync_every']}, delay {row['sync_delay']}, {row.get('sync_dtype') or 'bf16'}"
        else:
            period = str(row.get("every") or "every step")
        speed = f"{row['samples_per_s'] / reference['samples_per_s']:.2f}" if reference else "—"
        loss = f"{(row['val_loss'] / reference['val_loss'] - 1) * 100:+.1f}%" if reference else "—"
        lines.append(f"| {row['loop']} | {row['link_mbit']:g} Mbit/s | {period} | {row['samples_per_s']:.1f} | "
                     f"{speed} | {row['val_loss']:.4f} | {loss} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/heldout_lm.py", description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=LOOPS, help=argparse.SUPPRESS)
    parser.add_argument("--every", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--sync-every", type=int, default=0, help="the ddpkit loop's period (default: chosen)")
    parser.add_argument("--sync-delay", type=int, default=0, help="with --sync-every: its delay")
    parser.add_argument("--sync-dtype", default=None, help="with --sync-every: its exchange")
    parser.add_argument("--sparse-density", type=float, default=None,
                        help="the share a sparse exchange sends (an experiment: default SPARSE_DENSITY)")
    parser.add_argument("--outer-lr", type=float, default=1.0,
                        help="with --sync-every: DiLoCo's outer learning rate (1: the replicas' average)")
    parser.add_argument("--loader", action="store_true",
                        help="the ddpkit loops take their batches from rt.loader, as ddpkit-ft's replicas do")
    parser.add_argument("--max-delay", type=int, default=0,
                        help="an experiment: the most steps a chosen exchange runs behind (fragments beyond)")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--link-mbit", type=float, default=10.0)
    parser.add_argument("--loops", default=",".join(LOOPS))
    parser.add_argument("--peer-every", default="chosen", help="the peers' periods: 'chosen' (ddpkit's), numbers")
    parser.add_argument("--steps", type=int, default=800, help="timed optimizer steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="sequences a process a step")
    parser.add_argument("--corpus", choices=tuple(CORPORA), default="stdlib")
    parser.add_argument("--width", type=int, default=256, help="the transformer's width (8 heads)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a loop may run")
    parser.add_argument("--out", default="runs/heldout")
    opts = parser.parse_args(argv)
    if opts.worker is not None:
        {"every-step": _ddpkit, "ddpkit": _ddpkit, "ddpkit-ft": _ddpkit, "accelerate": _accelerate,
         "torchft": _torchft}[opts.worker](opts)
        return 0
    loops = [loop.strip() for loop in opts.loops.split(",") if loop.strip()]
    unknown = [loop for loop in loops if loop not in LOOPS]
    if unknown:
        parser.error(f"unknown loop {unknown[0]!r}: choose from {', '.join(LOOPS)}")
    out = Path(opts.out)
    rows: list[dict[str, Any]] = []
    chosen: int | None = None
    for loop in loops:
        if loop in ("every-step", "ddpkit", "ddpkit-ft"):
            link = UNSHAPED_MBIT if loop == "every-step" else opts.link_mbit
            rows.append(run_loop(opts, loop, link, None, out / loop))
            if loop == "ddpkit" and rows[-1].get("decision"):
                chosen = int(rows[-1]["decision"]["every"])
        else:
            for every in opts.peer_every.split(","):
                period = chosen if every == "chosen" else int(every)
                if period is None:
                    parser.error("--peer-every chosen needs the ddpkit loop to run first (in --loops)")
                rows.append(run_loop(opts, loop, opts.link_mbit, period, out / f"{loop}-{period}"))
                print(json.dumps(rows[-1]), flush=True)
            continue
        print(json.dumps(rows[-1]), flush=True)
    table = _table(rows)
    print(table)
    meta = {"hosts": opts.hosts, "link_mbit": opts.link_mbit, "steps": opts.steps, "warmup": opts.warmup,
            "batch": opts.batch, "lr": opts.lr, "seed": opts.seed, "python": sys.version.split()[0],
            "torch": torch.__version__, "corpus": opts.corpus, "corpus_windows": [len(t) for t in windows(opts.corpus)],
            "parameters": sum(p.numel() for p in CharGPT(opts.width, opts.layers).parameters())}
    (out / "heldout.json").write_text(json.dumps({"meta": meta, "rows": rows, "table": table}, indent=1))
    return 0 if all("failed" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
