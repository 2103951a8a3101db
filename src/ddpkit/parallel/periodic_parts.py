"""What an infrequent sync needs besides :class:`~ddpkit.parallel.periodic.PeriodicSync`: the refusals of its options, the fragments a model splits into, and the one-line notice."""

from __future__ import annotations

import math
from typing import Any

import torch

from ddpkit.errors import UsageError, warn

SYNCS = ("every-step", "local-sgd", "diloco")
"""``rt.setup``'s ``sync`` values: DDP's allreduce every step, or one of the two infrequent ones."""
_DTYPES = {
    None: torch.bfloat16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
    "sparse": torch.int8,
}
"""The exchange's dtype on the wire; the default (None) is bfloat16: half the bytes, and on tiny-lm
DiLoCo's validation loss moved by 0.1% (BENCHMARKS.md). ``"int8"`` sends a quarter of fp32's bytes:
each rank's change plus what rounding kept back last time (error feedback), scaled by the ranks'
largest magnitude and rounded to ``127 // world`` levels, so the ranks' sum fits in int8 on the wire.
``"sparse"`` sends only the largest :data:`SPARSE_DENSITY` of each rank's change plus its feedback
(a 16-bit word each: a 12-bit offset within blocks of :data:`PACK_BLOCK` and a 4-bit value of the
rank's own scale), gathered from every rank; what was not sent is the next feedback."""
EXCHANGES = ("fp32", "bf16", "int8", "sparse")
"""``sync_dtype``'s values, as ``rt.setup``, ``ddpkit bench --sync-dtype`` and the benchmarks take them."""
SPARSE_DENSITY = 1 / 32
"""The share of a fragment's elements a sparse exchange sends where the user gave the period
(SparseLoCo's top-k keeps 1-3%)."""
SPARSE_DENSITIES = (1 / 32, 1 / 64, 1 / 128)
"""The shares a period chosen from the link may send, densest first: the densest that gives the
shortest period is taken. On a held-out character transformer at 10 Mbit/s (BENCHMARKS.md) the
shorter period paid for the sparser exchange: 1/16 at H = 8 ended 11.7% above every-step DDP's
validation loss, 1/32 at H = 5 4.9%, 1/64 at H = 3 1.0%. On a third workload (1000 steps) 1/128
at H = 2 ended 0.7% above it, and 1/256 at H = 2 (4.2%) no better than 1/128 at H = 3 (4.4%):
hence no sparser share."""


def sparse_count(elements: int, density: float | None = None) -> int:
    """Elements a sparse exchange of ``elements`` sends: ``density`` of them (None:
    :data:`SPARSE_DENSITY`), at least one."""
    share = SPARSE_DENSITY if density is None else density
    return 0 if elements == 0 else max(1, math.ceil(elements * share))


POSITION_BLOCK = 1 << 16
"""The second layout's blocks (:data:`BLOCKS`): positions as 16-bit offsets within blocks of this many
elements, after each block's count (int32), and int8 values: 3 bytes an element sent."""
BLOCKS = "sparse:blocks"
"""The marker of an exchange in flight of the second layout (a checkpoint's, read as such)."""
PACK_BLOCK = 1 << 12
"""A sparse packet sends each element as one 16-bit word: its offset within a block of this many elements
(12 bits) and its value (4 bits: :data:`LEVELS` levels either side of zero, of the rank's own scale),
after each block's count (int16): 2 bytes an element sent."""
LEVELS = 7
"""A sparse packet's values: whole multiples of the rank's largest / LEVELS, -LEVELS to LEVELS (4 bits).
What the rounding keeps back is the next feedback. On a character transformer (BENCHMARKS.md) 4-bit values
ended where int8's did, and their smaller packet shortened the period on 4 hosts."""
PACKED = "sparse:packed"
"""The marker of a sparse exchange whose packets are of :data:`PACK_BLOCK` words; a checkpoint's exchange in
flight marked :data:`BLOCKS` or ``"sparse"`` was saved in an earlier layout and is read as such."""


def position_blocks(elements: int) -> int:
    """The blocks of :data:`POSITION_BLOCK` elements that ``elements`` take (the last one partly)."""
    return -(-elements // POSITION_BLOCK)


def pack_blocks(elements: int) -> int:
    """The blocks of :data:`PACK_BLOCK` elements that ``elements`` take (the last one partly)."""
    return -(-elements // PACK_BLOCK)


def position_dtype(elements: int) -> torch.dtype:
    """The whole positions' dtype in a packet of the first layout (a checkpoint's exchange in flight
    marked ``"sparse"``): int32, int64 past int32's range."""
    return torch.int32 if elements <= torch.iinfo(torch.int32).max else torch.int64


def sparse_packet_bytes(elements: int, dense: int = 0, density: float | None = None, layout: str = PACKED) -> int:
    """One rank's sparse packet: a float32 scale, the count of each block (int16), one 16-bit word
    (offset and 4-bit value) for each of the largest ``density`` of ``elements``, and ``dense``
    float32 values sent whole (the BatchNorm statistics' changes).

    Args:
        elements: the elements the largest are chosen from.
        dense: elements sent whole after them.
        density: the share sent (None: :data:`SPARSE_DENSITY`).
        layout: :data:`PACKED`, or an earlier layout's size for an exchange in flight in a checkpoint
            (:data:`BLOCKS`: int32 counts of larger blocks, 16-bit offsets and int8 values;
            ``"sparse"``: whole positions and int8 values).
    """
    count = sparse_count(elements, density)
    if layout == BLOCKS:
        return 4 + 4 * position_blocks(elements) + 3 * count + 4 * dense
    if layout != PACKED:
        return 4 + (position_dtype(elements).itemsize + 1) * count + 4 * dense
    return 4 + 2 * pack_blocks(elements) + 2 * count + 4 * dense


def packet_bytes(name: str, elements: int, density: float | None = None) -> int:
    """One rank's part of one exchange of ``elements``: its sparse packet, or the elements in the dtype."""
    if name == "sparse":
        return sparse_packet_bytes(elements, density=density)
    return elements * _DTYPES[name].itemsize


def wire_bytes(name: str, elements: int, world: int, density: float | None = None) -> float:
    """What each rank sends for one exchange of ``elements``: a ring allreduce of the dense dtypes,
    a ring all-gather of every rank's packet for ``"sparse"``.

    Args:
        name: the exchange, one of :data:`EXCHANGES`.
        elements: elements of the whole model's change.
        world: processes of the job.
        density: a sparse exchange's share (None: :data:`SPARSE_DENSITY`).
    """
    from ddpkit.distributed.probe import bus_bytes

    part = packet_bytes(name, elements, density)
    return float((world - 1) * part if name == "sparse" else bus_bytes(part, world))


def check(
    sync: str,
    *,
    every: int | None,
    sync_dtype: str | None,
    strategy: str,
    grad_compression: str | None,
    sync_batchnorm: bool,
    precision: str,
    fragments: int = 1,
    delay: int = 0,
) -> None:
    """Refuse, in one line, an infrequent sync that cannot work as asked.

    Args:
        sync: ``"every-step"``, ``"local-sgd"`` or ``"diloco"``.
        every: ``sync_every``, the optimizer steps between syncs (None: chosen from the link, :func:`choose_period`).
        sync_dtype: the exchange's dtype (None: bf16; one of :data:`EXCHANGES`).
        strategy: ``rt.setup``'s strategy: fsdp shards what each rank would train alone.
        grad_compression: per-step gradient compression: there is no per-step exchange to compress.
        sync_batchnorm: statistics synchronised every forward defeat training apart.
        precision: fp16's loss scaler would differ per rank between syncs.
        fragments: ``sync_fragments``, the fragments exchanged at their own points of the period.
        delay: ``sync_delay``, the inner steps an exchange runs in the background.

    Raises:
        UsageError: an unknown value, a bad ``sync_every``, fragments or a delay without it, or a refused combination.
    """
    if sync not in SYNCS:
        raise UsageError(f"unknown sync {sync!r}; choose {', '.join(repr(s) for s in SYNCS)}")
    if sync == "every-step":
        if every is not None or sync_dtype is not None or fragments != 1 or delay != 0:
            raise UsageError(
                "sync_every, sync_dtype, sync_fragments and sync_delay set how an infrequent sync "
                "exchanges; give sync='diloco' or 'local-sgd'"
            )
        return
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise UsageError(
            f"sync={sync!r}: sync_every=H is a whole number of optimizer steps of at least 1 between syncs, "
            f"got {every!r}; leave it out to have the period chosen from the link"
        )
    if every is None and (fragments != 1 or delay != 0):
        raise UsageError(
            f"sync={sync!r} without sync_every chooses the period and the overlap from the link; "
            f"give sync_every=H too, or drop sync_fragments and sync_delay"
        )
    if sync_dtype not in _DTYPES:
        raise UsageError(f"sync_dtype={sync_dtype!r}: choose {', '.join(repr(e) for e in EXCHANGES)}")
    if every is None:
        every = 1 << 30  # chosen later: the checks below are of values given with it
    if isinstance(fragments, bool) or not isinstance(fragments, int) or not 1 <= fragments <= every:
        raise UsageError(
            f"sync_fragments={fragments!r}: give a whole number from 1 to sync_every ({every}), the "
            "fragments each sent at their own step of the period"
        )
    if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay < every:
        raise UsageError(
            f"sync_delay={delay!r}: give a whole number of inner steps from 0 to sync_every - 1 "
            f"({every - 1}), so an exchange lands before its fragment is sent again"
        )
    refused = {
        "fsdp": strategy == "fsdp" and "strategy='fsdp' shards the model each rank would train on its own",
        "compression": grad_compression is not None
        and f"grad_compression={grad_compression!r} compresses a "
        "per-step gradient exchange, which infrequent sync does not make",
        "syncbn": sync_batchnorm
        and "sync_batchnorm=True synchronises every forward; BatchNorm statistics are averaged at each sync instead",
        "fp16": precision == "fp16"
        and "precision='fp16' scales each rank's loss on its own between syncs; use bf16 or fp32",
    }
    for reason in refused.values():
        if reason:
            raise UsageError(f"sync={sync!r}: {reason}")


def _fragments(sizes: list[int], count: int) -> list[list[int]]:
    """``count`` runs of consecutive parameter indices with about equal elements each, none empty
    (fewer when the model has fewer parameters)."""
    if not sizes:
        return [[]]
    count = max(1, min(count, len(sizes)))
    total, out, at, done = sum(sizes), [], 0, 0
    for f in range(count):
        left = count - f - 1  # fragments after this one, each needs a parameter
        target = total * (f + 1) / count
        run: list[int] = []
        while at < len(sizes) - left and (not run or done + sizes[at] / 2 <= target):
            run.append(at)
            done += sizes[at]
            at += 1
        out.append(run)
    out[-1] += list(range(at, len(sizes)))
    return out


MEASURE_STEPS = 5
"""Inner steps timed before the period is chosen (the first is set-up and not counted)."""
MIN_EVERY = 2
"""The shortest period chosen: a period of 1 is every-step DDP's exchange with an outer optimiser on top."""
MAX_DELAY: int | None = 1
"""The most steps a chosen exchange runs behind (None: as many as it needs; a fault-tolerant quorum's
is always 1): beyond, the model goes in fragments, one sent each step. On a character transformer at
1 Mbit/s (BENCHMARKS.md) 5 fragments each behind one step ended 2.2% above every-step DDP's
validation loss, where one whole exchange every 6 steps, 5 steps behind, ended 15.2% above."""
LINK_SHARE = 0.8
"""The share of each period the exchange may keep the link busy: room for a step slower than measured."""


def choose_period(
    *,
    step_s: float,
    exchange_bytes: int,
    world: int,
    link_bytes_per_s: float | None,
    latency_s: float,
    sent_bytes: float | None = None,
    max_delay: int | None = None,
) -> dict[str, Any]:
    """The shortest period whose exchange, run in the background, never holds up an inner step.

    The exchange of a whole model's change (``exchange_bytes``, in the exchange's dtype) takes
    ``bus bytes / link + latency`` seconds. It is sent at the period's end and applied ``delay``
    inner steps later (Streaming DiLoCo's overlap), so ``delay`` is the exchange's time in steps and
    the period one step more, the link busy at most :data:`LINK_SHARE` of it.

    Where the delay may not pass ``max_delay`` steps (a fault-tolerant quorum's exchange runs behind
    one step at most) and the whole exchange would need more, the model is exchanged in fragments
    (Streaming DiLoCo's), one sent each ``max_delay`` steps, each small enough to hide behind them:
    the period is as many steps as a whole exchange needs, and never longer than the fragments' count
    times ``max_delay``.

    Args:
        step_s: the slowest rank's inner step, in seconds.
        exchange_bytes: one exchange of the whole model's change, in bytes.
        world: processes of the job (a ring's bytes per rank grow with it).
        link_bytes_per_s: what each rank sends per second (None: unmeasured, faster than the probe sees).
        latency_s: one call's latency.
        sent_bytes: what each rank sends for one exchange (None: a ring allreduce of ``exchange_bytes``).
        max_delay: the most steps an exchange may run behind (None: as many as it needs).

    Returns:
        ``every``, ``delay`` and ``fragments`` to train with, and the numbers behind them.

    >>> choice = choose_period(step_s=0.1, exchange_bytes=2_000_000, world=2, link_bytes_per_s=1.25e6, latency_s=0.001)
    >>> choice["every"], choice["delay"], choice["exchange_s"]
    (22, 21, 1.601)
    >>> choose_period(step_s=0.1, exchange_bytes=2_000_000, world=2, link_bytes_per_s=None, latency_s=0.0)["every"]
    2
    >>> capped = choose_period(step_s=0.1, exchange_bytes=2_000_000, world=2, link_bytes_per_s=1.25e6, latency_s=0.001,
    ...                        max_delay=1)
    >>> capped["every"], capped["delay"], capped["fragments"]
    (21, 1, 21)
    """
    from ddpkit.distributed.probe import bus_bytes

    sent = bus_bytes(exchange_bytes, world) if sent_bytes is None else sent_bytes
    moving = sent / link_bytes_per_s if link_bytes_per_s else 0.0
    exchange = moving + latency_s
    room = LINK_SHARE * max(step_s, 1e-9)  # what one step hides
    steps = math.ceil(exchange / room) if exchange > 0 else 0
    delay, fragments, waits = max(1, steps), 1, False
    every = max(MIN_EVERY, delay + 1)
    if max_delay is not None and delay > max_delay:
        # fragments each sent ``max_delay`` steps apart, their latency paid each time: as few as hide
        hidden = room * max_delay - latency_s
        fragments = max(2, math.ceil(moving / hidden)) if hidden > 0 else steps
        delay, every = max_delay, max(MIN_EVERY, fragments * max_delay)
        waits = hidden <= 0  # a call's latency alone outlasts what the steps hide: no fragment hides
    return {
        "every": every,
        "delay": delay,
        "fragments": fragments,
        "waits": waits,
        "exchange_s": round(exchange, 6),
        "step_s": step_s,  # as the period was chosen from it (shown rounded)
        "exchange_bytes": int(exchange_bytes),
        "link_bytes_per_s": link_bytes_per_s,
        "latency_s": latency_s,
    }


def choose_exchange(
    *,
    step_s: float,
    elements: int,
    dtype: str,
    dtype_given: bool,
    world: int,
    link_bytes_per_s: float | None,
    latency_s: float,
    max_delay: int | None = None,
) -> dict[str, Any]:
    """The period (:func:`choose_period`) and the exchange: ``dtype`` where the user gave it or where
    the link does not set the period (it is :data:`MIN_EVERY` already); else int8 (with error
    feedback) where its quarter of fp32's bytes makes the period shorter, and then sparse (with
    error feedback), each of :data:`SPARSE_DENSITIES` in turn, where its packets make the period
    shorter still. A given ``"sparse"`` takes the density that gives the shortest period. Where the
    delay is capped (``max_delay``) and the model goes in fragments, a period as short in fewer
    fragments wins: a whole exchange behind one step, where one can hide there, as over a process group
    (on 2 simulated hosts at 10 Mbit/s, 100 steps of a character transformer, 1/32 in two fragments
    kept the link busy through every fault-tolerant step: 0.73x every-step DDP's unshaped speed; a
    whole 1/128 0.96x, at the same loss; BENCHMARKS.md).

    The shortest period won on both workloads measured (BENCHMARKS.md): tiny-lm (2 processes, 600
    steps) ended 6.0% below every-step DDP's validation loss with sparse 1/32 at H = 8, 2.7% with
    int8 at H = 32, 3.0% with bf16 at H = 64; a held-out character transformer at 10 Mbit/s 1.0%
    above it with sparse 1/64 at H = 3, 4.9% with 1/32 at H = 5, 15.7% with int8 at H = 22.

    Args:
        step_s: the slowest rank's inner step, in seconds.
        elements: elements of one exchange of the whole model's change.
        dtype: the exchange's dtype so far (``"bf16"`` by default).
        dtype_given: the user gave ``sync_dtype``: it stands.
        world, link_bytes_per_s, latency_s, max_delay: as :func:`choose_period` takes them.

    Returns:
        :func:`choose_period`'s decision with ``dtype`` in it, and ``density`` for a sparse one.

    >>> slow = dict(step_s=0.1, elements=1_000_000, world=2, link_bytes_per_s=1.25e6, latency_s=0.001)
    >>> [(c["dtype"], c.get("density"), c["every"]) for c in (choose_exchange(dtype="bf16", dtype_given=False, **slow),
    ...                                                       choose_exchange(dtype="bf16", dtype_given=True, **slow))]
    [('sparse', 0.03125, 2), ('bf16', None, 22)]
    >>> [choose_exchange(dtype="bf16", dtype_given=False, **{**slow, "link_bytes_per_s": s})["dtype"] for s in (15e6, 30e6)]
    ['int8', 'bf16']
    """

    def period(name: str, density: float | None = None) -> dict[str, Any]:
        decision = {
            **choose_period(
                step_s=step_s,
                exchange_bytes=packet_bytes(name, elements, density),
                world=world,
                link_bytes_per_s=link_bytes_per_s,
                latency_s=latency_s,
                sent_bytes=wire_bytes(name, elements, world, density),
                max_delay=max_delay,
            ),
            "dtype": name,
        }
        if name == "sparse":
            decision["density"] = density
        return decision

    candidates: list[tuple[str, float | None]]
    if dtype == "sparse":
        decision = period("sparse", SPARSE_DENSITIES[0])
        candidates = [("sparse", d) for d in SPARSE_DENSITIES[1:]]
    else:
        decision = period(dtype)
        candidates = [] if dtype_given else [("int8", None), *(("sparse", d) for d in SPARSE_DENSITIES)]

    def rank(choice: dict[str, Any]) -> tuple[int, int]:  # the shortest period; then the fewest fragments
        return choice["every"], choice["fragments"]

    for name, density in candidates:
        if rank(decision) <= (MIN_EVERY, 1):
            break
        candidate = period(name, density)
        if rank(candidate) < rank(decision):
            decision = candidate
    return decision


def chosen_outer_lr(optimizer: Any, world: int) -> float:
    """DiLoCo's outer learning rate where the period is chosen from the link: ``sqrt(world)`` where
    the inner optimizer is adaptive (a param group with ``betas`` or ``eps``: Adam, AdamW, RMSprop,
    Adagrad, Lion...), 1 (the replicas' average) otherwise.

    Every-step DDP on ``world`` ranks takes each step on ``world`` times a rank's batch. SGD's step is
    linear in the gradient, so the average of the ranks' steps is that step. An adaptive optimizer's
    step is the gradient over its own noise, and the noise of a batch ``world`` times smaller is
    ``sqrt(world)`` times larger: the average of the ranks' steps is up to ``sqrt(world)`` times
    shorter than every-step DDP's (the square-root scaling rule of adaptive optimizers, Malladi et
    al. 2022). On two character transformers with AdamW on 4 ranks (BENCHMARKS.md) the average ended
    5.6% and 7.4% above every-step DDP's validation loss, ``sqrt(4)`` times it 2.1% and 3.9%; on 2 ranks
    ``sqrt(2)`` times it ended 0.1% and 0.7% closer to every-step DDP than the average.

    >>> chosen_outer_lr(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]), 4)
    2.0
    >>> chosen_outer_lr(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9), 4)
    1.0
    """
    groups = getattr(optimizer, "param_groups", None) or []
    adaptive = any("betas" in group or "eps" in group for group in groups)
    return math.sqrt(max(1, world)) if adaptive else 1.0


def announce(kind: str, every: int | None, is_main: bool) -> None:
    """Say once that the run's result now depends on the world size."""
    if is_main:
        period = f"every {every} steps" if every is not None else f"its period chosen after {MEASURE_STEPS + 1} steps"
        warn(
            f"sync={kind!r} ({period}): each rank takes its inner steps on its own share of the "
            "global batch, so the result depends on the number of processes; evaluate, predict and "
            "checkpoints use the synced weights"
        )


__all__ = [
    "BLOCKS",
    "EXCHANGES",
    "LEVELS",
    "MEASURE_STEPS",
    "PACKED",
    "PACK_BLOCK",
    "POSITION_BLOCK",
    "SPARSE_DENSITIES",
    "SPARSE_DENSITY",
    "SYNCS",
    "announce",
    "check",
    "choose_exchange",
    "choose_period",
    "chosen_outer_lr",
    "wire_bytes",
]
