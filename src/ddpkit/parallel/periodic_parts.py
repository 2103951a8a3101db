"""What an infrequent sync needs besides :class:`~ddpkit.parallel.periodic.PeriodicSync`: the refusals of its options, the fragments a model splits into, and the one-line notice."""

from __future__ import annotations

import torch

from ddpkit.errors import UsageError, warn

SYNCS = ("every-step", "local-sgd", "diloco")
"""``rt.setup``'s ``sync`` values: DDP's allreduce every step, or one of the two infrequent ones."""
_DTYPES = {None: torch.bfloat16, "fp32": torch.float32, "bf16": torch.bfloat16}
"""The exchange's dtype; the default (None) is bfloat16: half the bytes, and on tiny-lm DiLoCo's
validation loss moved by 0.1% (BENCHMARKS.md)."""


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
        every: ``sync_every``, the optimizer steps between syncs.
        sync_dtype: the exchange's dtype (None or ``"fp32"``; ``"bf16"``).
        strategy: ``rt.setup``'s strategy: fsdp shards what each rank would train alone.
        grad_compression: per-step gradient compression: there is no per-step exchange to compress.
        sync_batchnorm: statistics synchronised every forward defeat training apart.
        precision: fp16's loss scaler would differ per rank between syncs.
        fragments: ``sync_fragments``, the fragments exchanged at their own points of the period.
        delay: ``sync_delay``, the inner steps an exchange runs in the background.

    Raises:
        UsageError: an unknown value, a missing or bad ``sync_every``, or a refused combination.
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
    if every is None or isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise UsageError(
            f"sync={sync!r} needs sync_every=H, a whole number of optimizer steps of at least 1 "
            f"between syncs, got {every!r}"
        )
    if sync_dtype not in _DTYPES:
        raise UsageError(f"sync_dtype={sync_dtype!r}: choose 'fp32' or 'bf16'")
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


def announce(kind: str, every: int, is_main: bool) -> None:
    """Say once that the run's result now depends on the world size."""
    if is_main:
        warn(
            f"sync={kind!r} (every {every} steps): each rank takes its inner steps on its own share of the "
            "global batch, so the result depends on the number of processes; evaluate, predict and "
            "checkpoints use the synced weights"
        )


__all__ = ["SYNCS", "announce", "check"]
