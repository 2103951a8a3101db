"""Functions run by ddpkit.launch (or in-process for a world of one) in tests/test_streams.py."""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset

import ddpkit

SIZES = [20, 44, 31, 25, 38, 22, 23]  # 7 uneven shards, 203 samples
STARTS = [sum(SIZES[:i]) for i in range(len(SIZES))]
TOTAL = sum(SIZES)
GLOBAL_BATCH = 12


def sample(index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    x = torch.sin(torch.arange(4, dtype=torch.float32) * (index + 1) * 0.37)
    y = torch.tensor([float(x.sum() * 0.5 + (index % 5) * 0.1)])
    return index, x, y


class Plain(IterableDataset):
    """A plain stream of ``length`` samples ``(index, x, y)``."""

    def __init__(self, length: int = TOTAL):
        self.length = length

    def __iter__(self):
        for index in range(self.length):
            yield sample(index)


def read_shard(shard: int):
    for offset in range(SIZES[shard]):
        yield sample(STARTS[shard] + offset)


def shards(**kwargs) -> ddpkit.Shards:
    kwargs.setdefault("cache", False)
    return ddpkit.Shards(list(range(len(SIZES))), read_shard, **kwargs)


def make(kind: str):
    return Plain() if kind == "plain" else shards()


def coverage(worker_counts: tuple[int, ...] = (0, 2), epochs: int = 2) -> dict:
    """Per (kind, workers, epoch): this rank's stream indices, steps and counts, with shuffle=True."""
    rt = ddpkit.init(seed=3)
    out = {}
    for kind in ("plain", "shards"):
        dataset = make(kind)  # Shards learn their lengths once, on the first loader
        for workers in worker_counts:
            loader = rt.loader(
                dataset, global_batch_size=GLOBAL_BATCH, shuffle=True, num_workers=workers, name=f"{kind}{workers}"
            )
            for epoch in range(epochs):
                loader.set_epoch(epoch)
                seen, steps, counts = [], 0, []
                for index, _x, _y in loader:
                    seen += index.tolist()
                    counts.append((loader.local_count, loader.global_count))
                    steps += 1
                out[f"{kind}/{workers}/{epoch}"] = {"seen": seen, "steps": steps, "counts": counts}
    return out


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x)


def train(
    mode: str, checkpoint: str, *, epochs: int = 2, stop_at: int = 25, workers: int = 0, kind: str = "shards"
) -> dict:
    """Global batch 12, shuffle: ``full``, ``stop`` (save after step ``stop_at``), ``resume``."""
    rt = ddpkit.init(seed=0)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt)
    state = {"model": model, "opt": opt}
    if mode == "resume":
        rt.load(checkpoint, state)
    loader = rt.loader(make(kind), global_batch_size=GLOBAL_BATCH, shuffle=True, num_workers=workers)
    trained = []
    for _ in rt.epochs(epochs):
        for index, x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            rt.backward(loss)
            rt.step(opt)
            trained += index.tolist()
            if mode == "stop" and rt.global_step == stop_at:
                rt.save(checkpoint, state)
                return {"stopped": rt.global_step}
    weights = {k: v.detach().clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
    return {"weights": weights, "steps": rt.global_step, "trained": trained}


def evaluation(workers: int = 0) -> dict:
    """evaluate and predict on a plain stream and on Shards of (x, class) samples."""
    rt = ddpkit.init(seed=0)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    out = {}
    for kind in ("plain", "shards"):
        data = pairs(kind)
        metrics = ddpkit.evaluate(model, data, num_classes=3, batch_size=10, num_workers=workers)
        predicted = ddpkit.predict(model, data, batch_size=10, num_workers=workers, to="all")
        out[kind] = {"metrics": metrics, "predicted": predicted}
    rt.barrier()
    return out


class PlainPairs(IterableDataset):
    """(x, class) samples of a plain stream."""

    def __iter__(self):
        for index, x, _ in Plain():
            yield x, index % 3


def _pair_shard(shard: int):
    for index, x, _ in read_shard(shard):
        yield x, index % 3


def pairs(kind: str):
    if kind == "plain":
        return PlainPairs()
    return ddpkit.Shards(list(range(len(SIZES))), _pair_shard, cache=False)


def _corrupt(shard: int):
    for offset, item in enumerate(read_shard(shard)):
        if shard == 5 and offset == 3:
            raise OSError("unexpected end of data")
        yield item


def corrupt_shard(workers: int = 0) -> None:
    """One rank reads a shard that raises; the others must not wait forever."""
    rt = ddpkit.init(seed=0)
    model = rt.setup(Net())
    loader = rt.loader(
        ddpkit.Shards(list(range(len(SIZES))), _corrupt, lengths=SIZES),
        global_batch_size=GLOBAL_BATCH,
        num_workers=workers,
    )
    for _, x, y in loader:
        rt.backward(torch.nn.functional.mse_loss(model(x), y))


class SplitByRank(IterableDataset):
    """A stream that splits itself by rank (as with datasets.distributed.split_dataset_by_node)."""

    def __iter__(self):
        rank, world = ddpkit.current().rank, ddpkit.current().world_size
        for index in range(rank, 50 + rank, world):
            yield sample(index)


def split_by_rank(evaluate: bool) -> None:
    rt = ddpkit.init(seed=0)
    if evaluate:
        ddpkit.evaluate(torch.nn.Linear(4, 3), _Firsts(SplitByRank()), num_classes=3)
    for _ in rt.loader(SplitByRank(), global_batch_size=GLOBAL_BATCH):
        pass


class _Firsts(IterableDataset):
    def __init__(self, source):
        self.source = source

    def __iter__(self):
        for index, x, _ in self.source:
            yield x, index % 3
