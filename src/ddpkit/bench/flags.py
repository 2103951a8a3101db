"""The command line of ``ddpkit bench``: its parser and the checks that turn flags into :class:`~ddpkit.bench.plan.BenchSettings`, each refusal one line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from ddpkit._argparse import Parser
from ddpkit.bench.plan import COMPRESSIONS, DATA, MODELS, MODES, BenchSettings
from ddpkit.errors import UsageError
from ddpkit.parallel.exact_tree import check
from ddpkit.parallel.periodic_parts import EXCHANGES, MEASURE_STEPS, SYNCS
from ddpkit.parallel.periodic_parts import check as check_sync


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(dict.fromkeys(int(part) for part in text.split(",")))
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated integers such as 1,2,4, got {text!r}") from None
    if min(values) < 1:
        raise UsageError(f"{flag} values must be at least 1, got {text!r}")
    return values


def _links(text: str) -> tuple[float, ...]:
    """``--link-mbit 10,100``: positive Mbit/s values, in the order given, once each."""
    try:
        values = tuple(dict.fromkeys(float(part) for part in text.split(",")))
    except ValueError:
        raise UsageError(f"--link-mbit must be a positive number of Mbit/s, got {text!r}") from None
    if any(not v > 0 for v in values):
        raise UsageError(f"--link-mbit must be a positive number of Mbit/s, got {text!r}")
    return values


def parser() -> argparse.ArgumentParser:
    """The parser of ``ddpkit bench`` (read by :func:`parse_settings`)."""
    d = BenchSettings()
    parser = Parser(
        prog="ddpkit bench",
        description="Measure throughput, scaling, memory and where "
        "each step's time goes, per mode, in fresh processes; writes bench.json, bench.md "
        "and scaling.png into --out.",
    )
    add = parser.add_argument
    add("--model", choices=MODELS, default=d.model, help=f"model (default {d.model})")
    add("--data", choices=DATA, default=d.data, help=f"data set (default {d.data})")
    add("--modes", default=",".join(d.modes), help=f"comma-separated {'|'.join(MODES)} (default all)")
    add("--nproc", default="2", help="comma-separated process counts of ddp and ddp-amp (default 2)")
    add(
        "--batch-size",
        "--batch",
        dest="batch",
        type=int,
        default=d.batch,
        help=f"samples per process per step (default {d.batch})",
    )
    add("--steps", type=int, default=d.steps, help=f"timed steps (default {d.steps})")
    add("--warmup", type=int, default=d.warmup, help=f"untimed steps before them (default {d.warmup})")
    add("--seed", type=int, default=d.seed, help=f"seed of weights and data order (default {d.seed})")
    add("--lr", type=float, default=d.lr, help=f"SGD learning rate (default {d.lr})")
    add("--momentum", type=float, default=d.momentum, help=f"SGD momentum (default {d.momentum})")
    add("--out-dir", "--out", dest="out", default=d.out, help=f"output directory (default {d.out})")
    add(
        "--compare-raw",
        action="store_true",
        help="also run a plain PyTorch DDP loop and ddpkit interleaved "
        "(the first ddp/ddp-amp mode, at the largest --nproc) and compare step time, memory and weights",
    )
    add("--repeats", type=int, default=d.repeats, help=f"raw/ddpkit pairs of --compare-raw (default {d.repeats})")
    add(
        "--grad-compression",
        default="none",
        help=f"comma-separated {'|'.join(COMPRESSIONS)}: gradient "
        "compression of the ddp and ddp-amp modes, one row each (default none)",
    )
    add(
        "--hosts",
        default=None,
        help="comma-separated counts of simulated hosts (network namespaces "
        "on a bridge, needs root), --nproc processes each; needs --link-mbit",
    )
    add(
        "--link-mbit",
        default=None,
        help="each simulated host's link speed in Mbit/s (tc tbf); comma-separated "
        "speeds run every hosts row on each, one after the other (10000 stands in for an unshaped link)",
    )
    add(
        "--optimizer",
        choices=("sgd", "adamw"),
        default=d.optimizer,
        help=f"optimizer (default {d.optimizer}); "
        "adamw holds 2 state tensors per parameter, what sharding (fsdp) divides",
    )
    add(
        "--sync-batchnorm",
        "--sync-bn",
        dest="sync_bn",
        default="off",
        help="comma-separated off|on: ddp and ddp-amp rows with BatchNorm "
        "statistics over every process (SyncBatchNorm, ddpkit train's default), one row each (default off)",
    )
    add(
        "--sync",
        default="every-step",
        help=f"comma-separated {'|'.join(SYNCS)}: ddp and ddp-amp rows "
        "whose ranks meet every step, or train apart and meet every --sync-every steps, one row each "
        "(default every-step)",
    )
    add(
        "--sync-every",
        type=int,
        default=None,
        help="optimizer steps between the syncs of local-sgd and diloco (default: chosen from the link and the step)",
    )
    add(
        "--sync-dtype",
        choices=EXCHANGES,
        default=None,
        help="the exchange of local-sgd and diloco rows (default bf16, or int8 where a period chosen from the link is shorter for it)",
    )
    add(
        "--sync-fragments",
        type=int,
        default=1,
        help="local-sgd and diloco rows: the model in F fragments, "
        "each exchanged at its own step of the period (Streaming DiLoCo; default 1)",
    )
    add(
        "--sync-delay",
        type=int,
        default=0,
        help="local-sgd and diloco rows: inner steps each exchange runs in "
        "the background before it is applied (Streaming DiLoCo; default 0)",
    )
    add("--powersgd-rank", type=int, default=None, help="rank of the PowerSGD rows' factors (default: rt.setup's)")
    add(
        "--diagnose-verify",
        action="store_true",
        help="run the fix each row's diagnosis recommends "
        "(the one predicting the most samples/s) and print predicted vs measured samples/s; a prediction "
        "more than 30%% off is flagged as a diagnosis error",
    )
    add(
        "--fault-tolerant",
        action="store_true",
        help="instead of the table: kill one process after --kill-at "
        "and compare ddpkit run --fault-tolerant (it heals) with restart-all (--max-restarts, from the newest "
        "checkpoint) and an uninterrupted run; --nproc replicas, --batch per replica, --steps in all",
    )
    add(
        "--kill-at",
        type=int,
        default=None,
        metavar="STEP",
        help="with --fault-tolerant: the step after which process 1 is SIGKILLed",
    )
    add(
        "--checkpoint-every",
        type=int,
        default=8,
        help="with --fault-tolerant: restart-all's checkpoint interval in steps; with --checkpoints: the "
        "interval of the saves timed (default 8)",
    )
    add(
        "--checkpoints",
        action="store_true",
        help="instead of the table: what a checkpoint costs the loop, written in the background "
        "(rt.save's default), with blocking=True, and as rank 0's plain torch.save; --model (try mlp-large, "
        "150 MB with AdamW's state), --nproc processes, --steps per stretch",
    )
    add(
        "--min-step-s",
        type=float,
        default=0.0,
        metavar="S",
        help="with --fault-tolerant: each step lasts at "
        "least S seconds (the loop sleeps out the rest), standing in for a larger model's step (default 0)",
    )
    add(
        "--data-format",
        default="map",
        help="comma-separated map|shards: the data set as it is, or the same "
        "samples as a ddpkit.Shards stream of 16 shards, one row each (default map)",
    )
    add(
        "--micro-shards",
        type=int,
        default=None,
        metavar="M",
        help="every row trains with rt.setup(micro_shards=M): "
        "each global batch in M shards summed along one fixed tree, the same bits on any power-of-two --nproc "
        "dividing M (ddpkit.parallel.exact); the exchange is recursive halving then doubling, started in the "
        "last shard's backward",
    )
    add(
        "--compare-exact",
        action="store_true",
        help="beside each plain fp32 ddp row, the same row with rt.setup(micro_shards=W), W its processes: "
        "what the same bits on any world size cost in samples/s",
    )
    return parser


def _check_micro_shards(
    opts: Any,
    modes: Sequence[str],
    compressions: Sequence[str],
    formats: Sequence[str],
    syncs: Sequence[str],
    syncs_of_rows: Sequence[str],
    hosts: Sequence[int],
) -> None:
    """What ``--micro-shards`` does not combine with, in one line (``rt.setup`` refuses the same)."""
    refused = [
        ("--modes dp or fsdp", set(modes) & {"dp", "fsdp"}),
        ("--compare-raw", opts.compare_raw),
        ("--fault-tolerant", opts.fault_tolerant),
        ("--grad-compression", set(compressions) - {"none"}),
        ("--sync-batchnorm on", "on" in syncs),
        ("--sync local-sgd or diloco", set(syncs_of_rows) - {"every-step"}),
    ]
    for flag, bad in refused:
        if bad:
            raise UsageError(f"--micro-shards does not combine with {flag}; drop one of the two")
    if "shards" in formats:  # a Shards stream's micro-shards are equal runs of the global batch
        for n in _int_list(opts.nproc, "--nproc"):
            if (opts.batch * n) % opts.micro_shards:
                raise UsageError(
                    f"--micro-shards {opts.micro_shards} cuts a --data-format shards global batch of "
                    f"{opts.batch * n} (--batch-size x --nproc {n}) into equal runs; choose sizes it divides"
                )
    for n in _int_list(opts.nproc, "--nproc"):
        try:
            check(
                opts.micro_shards,
                world_size=n * max(hosts or (1,)),
                sync_batchnorm=False,
                grad_compression=None,
                strategy="ddp",
                sync="every-step",
                ddp_kwargs={},
            )
        except UsageError as exc:
            raise UsageError(
                str(exc).replace("micro_shards=", "--micro-shards ").replace("micro_shards", "--micro-shards")
            ) from None


def parse_settings(argv: Sequence[str]) -> BenchSettings:
    """Validated :class:`BenchSettings` from ``ddpkit bench`` arguments.

    Raises:
        UsageError: unknown flag or mode, or a count out of range.
    """
    opts = parser().parse_args(argv)
    modes = tuple(dict.fromkeys(m.strip() for m in opts.modes.split(",")))
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise UsageError(f"unknown mode {unknown[0]!r} in --modes; choose from {', '.join(MODES)}")
    for flag, value, low in (
        ("--batch-size", opts.batch, 1),
        ("--steps", opts.steps, 1),
        ("--warmup", opts.warmup, 0),
        ("--repeats", opts.repeats, 1),
    ):
        if value < low:
            raise UsageError(f"{flag} must be at least {low}, got {value}")
    compressions = tuple(dict.fromkeys(c.strip() for c in opts.grad_compression.split(",")))
    unknown = [c for c in compressions if c not in COMPRESSIONS]
    if unknown:
        raise UsageError(
            f"unknown compression {unknown[0]!r} in --grad-compression; choose from {', '.join(COMPRESSIONS)}"
        )
    formats = tuple(dict.fromkeys(f.strip() for f in opts.data_format.split(",")))
    if set(formats) - {"map", "shards"}:
        raise UsageError(
            f"unknown data format {sorted(set(formats) - {'map', 'shards'})[0]!r} in --data-format; "
            "choose from map, shards"
        )
    syncs = tuple(dict.fromkeys(v.strip() for v in opts.sync_bn.split(",")))
    if set(syncs) - {"off", "on"}:
        raise UsageError(f"--sync-batchnorm takes off, on or off,on, got {opts.sync_bn!r}")
    if opts.model == "tiny-lm" and opts.data != "synthetic":
        raise UsageError(f"--model tiny-lm trains on synthetic token sequences; drop --data {opts.data}")
    syncs_of_rows = tuple(dict.fromkeys(v.strip() for v in opts.sync.split(",")))
    unknown = [v for v in syncs_of_rows if v not in SYNCS]
    if unknown:
        raise UsageError(f"unknown sync {unknown[0]!r} in --sync; choose from {', '.join(SYNCS)}")
    if opts.sync_every is not None and opts.sync_every < 1:
        raise UsageError(
            f"--sync-every {opts.sync_every}: give the optimizer steps between syncs (1 or more), or leave it "
            "out to have the period chosen from the link"
        )
    if opts.sync_every is not None and not set(syncs_of_rows) - {"every-step"}:
        raise UsageError("--sync-every sets how often local-sgd or diloco meet; add --sync every-step,diloco")
    if (opts.sync_fragments != 1 or opts.sync_delay != 0) and not set(syncs_of_rows) - {"every-step"}:
        raise UsageError(
            "--sync-fragments and --sync-delay stream the exchange of local-sgd or diloco; add --sync every-step,diloco"
        )
    if set(syncs_of_rows) - {"every-step"} and opts.sync_every is None and opts.warmup < MEASURE_STEPS + 1:
        raise UsageError(
            f"--sync {','.join(s for s in syncs_of_rows if s != 'every-step')} without --sync-every chooses its period "
            f"in its first {MEASURE_STEPS + 1} steps; give --warmup {MEASURE_STEPS + 1} (or more) so the timed steps "
            "run with it, or --sync-every H"
        )
    if set(syncs_of_rows) - {"every-step"}:
        check_sync(
            "diloco",
            every=opts.sync_every,
            sync_dtype=opts.sync_dtype,
            strategy="ddp",
            grad_compression=None,
            sync_batchnorm=False,
            precision="fp32",
            fragments=opts.sync_fragments,
            delay=opts.sync_delay,
        )
    hosts = _int_list(opts.hosts, "--hosts") if opts.hosts is not None else ()
    if hosts and opts.link_mbit is None:
        raise UsageError("--hosts needs --link-mbit M, the speed of each simulated host's link")
    if opts.link_mbit is not None and not hosts:
        raise UsageError("--link-mbit shapes the links of simulated hosts; add --hosts H")
    links = _links(opts.link_mbit) if opts.link_mbit is not None else ()
    if hosts and not {"ddp", "ddp-amp"} & set(modes):
        raise UsageError("--hosts runs DDP across simulated hosts; add ddp or ddp-amp to --modes")
    if opts.fault_tolerant:
        if opts.kill_at is None or not 1 <= opts.kill_at < opts.steps:
            raise UsageError("--fault-tolerant needs --kill-at STEP, a step between 1 and --steps - 1")
        counts = _int_list(opts.nproc, "--nproc")
        if len(counts) != 1 or len(hosts) > 1 or counts[0] * (hosts[0] if hosts else 1) < 2:
            raise UsageError("--fault-tolerant runs one --nproc (and at most one --hosts) of 2 or more replicas in all")
        if len(links) > 1:
            raise UsageError("--fault-tolerant runs on one --link-mbit; give one speed")
        if len(syncs_of_rows) > 1:
            raise UsageError("--fault-tolerant runs one --sync; give every-step, local-sgd or diloco")
        if syncs_of_rows[0] != "every-step" and opts.sync_every is None:
            raise UsageError(
                f"--fault-tolerant --sync {syncs_of_rows[0]} needs --sync-every H (the bench compares the "
                "weights of three runs, and each would choose its own period from its own timings)"
            )
        if syncs_of_rows[0] != "every-step" and opts.sync_delay > 1:
            raise UsageError(
                "--fault-tolerant takes --sync-delay 0 or 1 (an exchange runs inside one step's quorum, "
                "behind that step at most)"
            )
        if opts.checkpoint_every < 1:
            raise UsageError(f"--checkpoint-every must be at least 1, got {opts.checkpoint_every}")
        if opts.min_step_s < 0:
            raise UsageError(f"--min-step-s must be 0 or more seconds, got {opts.min_step_s}")
    elif opts.kill_at is not None:
        raise UsageError("--kill-at kills a process in --fault-tolerant's comparison; add --fault-tolerant")
    elif opts.min_step_s:
        raise UsageError("--min-step-s lengthens the steps of --fault-tolerant's comparison; add --fault-tolerant")
    if opts.micro_shards is not None:
        _check_micro_shards(opts, modes, compressions, formats, syncs, syncs_of_rows, hosts)
    if opts.compare_exact and opts.micro_shards is not None:
        raise UsageError("--compare-exact adds micro-shard rows beside plain ones; drop --micro-shards")
    if opts.compare_exact and "ddp" not in modes:
        raise UsageError("--compare-exact compares ddp rows with their micro-shard twins; add ddp to --modes")
    if opts.compare_exact and opts.fault_tolerant:
        raise UsageError("--compare-exact does not combine with --fault-tolerant; run them apart")
    if opts.checkpoints:
        others = [
            flag
            for flag, given in (
                ("--fault-tolerant", opts.fault_tolerant),
                ("--compare-raw", opts.compare_raw),
                ("--compare-exact", opts.compare_exact),
                ("--hosts", opts.hosts is not None),
                ("--micro-shards", opts.micro_shards is not None),
            )
            if given
        ]
        if others:
            raise UsageError(f"--checkpoints times saves in a run of its own; drop {', '.join(others)}")
        if len(_int_list(opts.nproc, "--nproc")) != 1:
            raise UsageError("--checkpoints runs one --nproc; give one number of processes")
        if not 1 <= opts.checkpoint_every <= opts.steps:
            raise UsageError(
                f"--checkpoint-every must be between 1 and --steps ({opts.steps}), got {opts.checkpoint_every}"
            )
    settings = BenchSettings(
        model=opts.model,
        data=opts.data,
        modes=modes,
        nproc=_int_list(opts.nproc, "--nproc"),
        batch=opts.batch,
        steps=opts.steps,
        warmup=opts.warmup,
        seed=opts.seed,
        lr=opts.lr,
        momentum=opts.momentum,
        out=opts.out,
        compare_raw=opts.compare_raw,
        repeats=opts.repeats,
        grad_compression=compressions,
        hosts=hosts,
        link_mbit=links[0] if links else None,
        links=links,
        data_format=formats,
        optimizer=opts.optimizer,
        diagnose_verify=opts.diagnose_verify,
        sync_bn=tuple(v == "on" for v in syncs),
        sync=syncs_of_rows,
        sync_every=opts.sync_every,
        powersgd_rank=opts.powersgd_rank,
        sync_dtype=opts.sync_dtype,
        sync_fragments=opts.sync_fragments,
        sync_delay=opts.sync_delay,
        fault_tolerant=opts.fault_tolerant,
        kill_at=opts.kill_at,
        checkpoint_every=opts.checkpoint_every,
        min_step_s=opts.min_step_s,
        micro_shards=opts.micro_shards,
        compare_exact=opts.compare_exact,
        checkpoints=opts.checkpoints,
    )
    if settings.compare_raw and not {"ddp", "ddp-amp"} & set(modes):
        raise UsageError("--compare-raw compares a DDP run; add ddp or ddp-amp to --modes")
    if settings.compare_raw and max(settings.nproc) * max(hosts or (1,)) < 2:
        raise UsageError("--compare-raw compares DDP runs of 2 or more processes; give --nproc 2")
    return settings


__all__ = ["parse_settings", "parser"]
