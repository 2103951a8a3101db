"""Learning the lengths of :class:`ddpkit.Shards` once per job: given, cached (rank 0's cache
decides), or counted now, round robin over ranks and each rank's workers.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.utils.data import DataLoader, Dataset

from ddpkit.distributed import collectives
from ddpkit.errors import warn
from ddpkit.loop.streams.shards import ShardError, Shards, count_shard, shard_name


class _Counting(Dataset):
    """Counts shards in DataLoader workers: item ``i`` is (shard, count or error line)."""

    def __init__(self, shards: Shards, mine: list[int], progress: Callable[[], None] | None):
        self.shards, self.mine, self.progress = shards, mine, progress

    def __len__(self) -> int:
        return len(self.mine)

    def __getitem__(self, i: int) -> tuple[int, int | str]:
        try:
            return self.mine[i], count_shard(self.shards, self.mine[i], self.progress)
        except ShardError as exc:
            return self.mine[i], str(exc)


def ensure_lengths(
    shards: Shards, *, num_workers: int, rank: int, world_size: int, progress: Callable[[], None] | None = None
) -> None:
    """Give ``shards`` its lengths: given, cached (rank 0's cache decides), or counted now.

    A collective when the lengths are not given: every rank must call it. Shards are counted
    round robin over ranks (and over each rank's workers); a shard that fails to read is
    raised on every rank, naming it, so no rank is left waiting.

    Args:
        shards: the stream; its ``lengths`` are set in place, and rank 0 caches them.
        num_workers: DataLoader workers that count this rank's shards (0: the main process).
        rank: this process's global rank.
        world_size: processes of the job.
        progress: called once per sample counted (None: not called).
    """
    if shards.lengths is not None:
        return

    cached = shards.load_cached() if rank == 0 else None
    if world_size > 1:
        cached = collectives.broadcast_object(cached)
    if cached is not None:
        shards.lengths = list(cached)
        return
    mine = list(range(rank, len(shards.shards), world_size))
    found: dict[int, int | str] = {}
    if mine:
        workers = min(num_workers, len(mine))
        for shard, count in DataLoader(_Counting(shards, mine, progress), batch_size=None, num_workers=workers):
            found[int(shard)] = count if isinstance(count, str) else int(count)
    every = [found] if world_size == 1 else collectives.all_gather_object(found)
    merged = {shard: count for part in every for shard, count in part.items()}
    failed = sorted((shard, count) for shard, count in merged.items() if isinstance(count, str))
    if failed:
        raise ShardError(failed[0][1] + (f" (and {len(failed) - 1} more shards)" if len(failed) > 1 else ""))
    shards.lengths = [int(merged[i]) for i in range(len(shards.shards))]
    empty = [shard_name(shards, i) for i, n in enumerate(shards.lengths) if n == 0]
    if rank == 0:
        shards.save_cached()
        if empty:
            warn(
                f"ddpkit: {len(empty)} shard(s) yield no samples and are left out: "
                f"{', '.join(empty[:5])}{' ...' if len(empty) > 5 else ''}"
            )
