"""Bitwise world-size invariance: every global batch as fixed micro-shards, summed along one fixed tree.

``rt.setup(model, optimizer, micro_shards=M)`` makes a run end at the same bits on 1, 2, 4, ...
processes (any power of two W that divides M), where SyncBatchNorm and DDP only end at the same
weights up to float rounding:

- **The shards.** Shard ``s`` of a global batch holds its samples ``s, s + M, s + 2M, ...``.
  Rank ``r`` holds the batch's samples ``r, r + W, ...`` (the loader's strided split), so its
  local shard ``j`` (``local[j::M // W]``) is global shard ``r + j * W``. ``rt.shards(x, y)`` hands
  them out; each runs its own forward and ``rt.backward``, with the same tensor shapes whatever W is.
- **BatchNorm per shard** ("ghost batch norm"): a shard normalises with its own statistics, as
  a process of batch size ``B // M`` would. Its running statistics take every shard's batch
  statistics in shard order, after the step (each rank gathers the others'), exactly as one
  process running the shards one after another would update them.
- **One summation tree.** Shard gradients (of its mean loss times its share of the batch) are
  summed as ``tree(g) = tree(g[0::2]) + tree(g[1::2])``. Its first ``log2 W`` splits are the
  residue classes of the ranks, so each rank sums its own shards along the same tree, and the
  ranks' partial sums are gathered (``all_gather``: the same bytes as an allreduce for two
  processes) and summed along the top of the tree. Every addition is the one a single process does.
- **The same kernels.** A shard is computed with the same intra-op thread count on any W
  (``usable cores // M``: thread count changes how a CPU GEMM splits its sums), deterministic
  cuDNN, and its own random stream (seeded by the run's seed, the step and the shard), so
  dropout draws the same masks.

The price: one process computes its M shards one after another on ``cores // M`` threads each,
and BatchNorm normalises over ``B // M`` samples rather than the global batch (the usual choice at
scale, Hoffer et al., 2017). Refused with it, in one line each: SyncBatchNorm, gradient
compression, fsdp, infrequent syncs, ``torch.compile``, DDP arguments, ``rt.accumulate``, a
fault-tolerant job, a world size that is not a power of two dividing M, and streams.

Example (one process; the same lines under ``ddpkit run -n 2`` end at the same bits):
    >>> import torch, ddpkit, torch.nn.functional as F
    >>> rt = ddpkit.init(seed=0)
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    >>> net, opt = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1), micro_shards=2)
    >>> data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    >>> for x, y in rt.loader(data, global_batch_size=8):
    ...     for xs, ys in rt.shards(x, y):
    ...         rt.backward(F.cross_entropy(net(xs), ys))
    ...     _ = rt.step(opt)
    >>> rt.global_step
    2
    >>> rt.close()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ddpkit.errors import UsageError
from ddpkit.parallel.exact_tree import (
    _add_grads,
    _pack,
    _take,
    _unpack,
    broadcast_from_rank0,
    check,
    threads_for,
    tree_sum,
)

__all__ = ["Exact", "check", "tree_sum", "threads_for"]


class Exact:
    """The micro-shard state of one run: the shard in hand, the shards' gradients and statistics."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        *,
        micro_shards: int,
        world_size: int,
        rank: int,
        seed: int | None,
        device: torch.device,
    ) -> None:
        self.micro_shards, self.world_size, self.rank = micro_shards, world_size, rank
        self.local_shards = micro_shards // world_size
        self.seed, self.device = seed, device
        params = list(model.parameters())
        if optimizer is not None:
            params += [p for group in optimizer.param_groups for p in group["params"]]
        self.params = [p for p in {id(p): p for p in params}.values() if p.requires_grad]
        self.norms = [m for m in model.modules() if isinstance(m, _BatchNorm)]
        self.current: tuple[int, int, int] | None = None  # (local index j, global shard s, its samples)
        self.leaves: dict[int, list[Any]] = {}  # local index -> gradients per parameter
        self.stats: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # j -> norm -> (mean, var)
        self.expected: list[int] = []  # local shards of the batch in hand with samples
        self.cut = False  # a batch was cut and its exchange is due
        self.batch_count = 0  # samples of the global batch in hand
        self._saved: dict[int, tuple[Any, ...]] = {}
        self.exchange_seconds = 0.0  # spent in the ranks' all_gathers (ddpkit bench reads it)
        self.exchange_calls = 0  # collectives of the last step's exchange
        for index, norm in enumerate(self.norms):
            norm.register_forward_pre_hook(self._make_pre_hook(index))
            norm.register_forward_hook(self._make_post_hook(index))

    # -- the shards of a batch ------------------------------------------------------------------
    def shards(self, active: Any, step: int, batch: tuple[Any, ...]) -> Iterator[Any]:
        """Each local shard of ``batch`` with samples, in its own random stream; see ``rt.shards``.

        Checks and marks the batch as cut at once (not at the first ``next``): a rank whose shards
        are all empty (a short last batch) yields nothing, yet its ``rt.step`` must still take
        part in the exchange."""
        if not getattr(active, "cuts_global_batches", False):
            raise UsageError(
                "rt.shards needs a batch from rt.loader over a map-style dataset (micro_shards "
                "splits its global batches; streams are not built for it)"
            )
        if active.sampler.world_size != self.world_size:
            raise UsageError("rt.shards: this loader splits batches over another world size than the run's")
        if self.cut:
            raise UsageError(
                "rt.shards: the shards of the previous batch were not stepped; call rt.step "
                "after the last shard's rt.backward"
            )
        total = active.global_count
        sizes = [len(range(s, total, self.micro_shards)) for s in range(self.micro_shards)]
        mine = [j for j in range(self.local_shards) if sizes[self.rank + j * self.world_size]]
        self.expected, self.batch_count, self.cut = mine, total, True
        return self._each(mine, sizes, step, batch)

    def _each(self, mine: list[int], sizes: list[int], step: int, batch: tuple[Any, ...]) -> Iterator[Any]:
        for j in mine:
            s = self.rank + j * self.world_size
            parts = tuple(_take(item, j, self.local_shards) for item in batch)
            self.current = (j, s, sizes[s])
            try:
                with self._random_stream(step, s):
                    yield parts[0] if len(parts) == 1 else parts
            finally:
                self.current = None
            if j not in self.leaves:
                raise UsageError(
                    "rt.shards: a shard went by without rt.backward; call rt.backward(loss) "
                    "once for every shard it hands out"
                )

    @contextlib.contextmanager
    def _random_stream(self, step: int, shard: int) -> Iterator[None]:
        if self.seed is None:  # unseeded: nothing to make equal
            yield
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.manual_seed((self.seed * 1_000_003 + step * 65_537 + shard) % (2**63))
            yield

    def weight(self) -> float:
        """What the shard's mean loss is multiplied by: its share of the global batch's samples."""
        if self.current is None:
            raise UsageError(
                "with micro_shards, call rt.backward inside `for shard in rt.shards(*batch)`, once per shard"
            )
        if self.current[0] in self.leaves:
            raise UsageError("rt.backward ran twice on one shard; micro_shards takes one backward per shard")
        return self.current[2] / self.batch_count

    def after_backward(self) -> None:
        """Keep the shard's gradients as a leaf of the tree and clear them for the next shard."""
        current = self.current
        assert current is not None  # rt.backward's weight() came first and refused one outside a shard
        self.leaves[current[0]] = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    # -- the step --------------------------------------------------------------------------------
    def reduce(self) -> None:
        """Before the optimizer steps (or the gradients are clipped): the tree's sum of every shard's gradients into ``.grad`` and
        every shard's BatchNorm statistics into the running ones, in shard order (a collective)."""
        if self.current is not None or set(self.leaves) != set(self.expected):
            raise UsageError(
                "rt.step came before every shard of the batch ran rt.backward; finish the "
                "`for shard in rt.shards(...)` loop first"
            )
        local = tree_sum([self.leaves.get(j) for j in range(self.local_shards)], _add_grads)
        stats = [self.stats.get(j) for j in range(self.local_shards)]
        self.leaves, self.stats, self.expected, self.cut = {}, {}, [], False
        if self.world_size == 1:
            total = local
            gathered_stats = [stats]
        else:
            import time

            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            total, gathered_stats = self._across_ranks(local, stats)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.exchange_seconds += time.perf_counter() - start
        for p, grad in zip(self.params, total if total is not None else [None] * len(self.params)):
            p.grad = grad
        self._update_running(gathered_stats)

    def _across_ranks(self, local: list[Any] | None, stats: list[Any]) -> tuple[list[Any] | None, list[Any]]:
        """Every rank's partial sum and shard statistics, gathered; the top of the tree summed here.

        With two processes that both hold a partial sum the top of the tree is one addition,
        which an allreduce makes on both ranks (its ``a + b`` is ``b + a``): no gathered copies."""
        import torch.distributed as dist

        present = torch.tensor(
            [0.0 if local is None or g is None else 1.0 for g in (local or [None] * len(self.params))]
            + [0.0 if s is None else 1.0 for s in stats],
            dtype=torch.float64,
        )
        stat_width = sum(1 + 2 * n.num_features for n in self.norms)
        stat_rows = [
            _pack(s, self.norms) if s is not None else torch.zeros(stat_width, dtype=torch.float64) for s in stats
        ]
        head = torch.cat([present, *stat_rows]).to(self.device)
        heads = [torch.empty_like(head) for _ in range(self.world_size)]
        dist.all_gather(heads, head)
        self.exchange_calls = 1
        heads = [h.cpu() for h in heads]  # (a float64 row: presence flags, then statistics)
        n = len(self.params)
        total: list[Any] = [None] * n
        for dtype in sorted({p.dtype for p in self.params}, key=str):
            idx = [i for i, p in enumerate(self.params) if p.dtype == dtype]
            flat = torch.cat(
                [
                    (
                        local[i] if local is not None and local[i] is not None else torch.zeros_like(self.params[i])
                    ).reshape(-1)
                    for i in idx
                ]
            )
            if self.world_size == 2 and all(heads[r][i] > 0 for r in range(2) for i in idx):
                dist.all_reduce(flat)  # a + b, the top of the tree (b + a on the other rank: equal bits)
                flats = [flat]
            else:  # the ranks' partial sums, the top of the tree summed here
                flats = [torch.empty_like(flat) for _ in range(self.world_size)]
                dist.all_gather(flats, flat)
            self.exchange_calls += 1
            partials: list[list[torch.Tensor | None]] = [[None] * len(idx) for _ in flats]
            for r, other in enumerate(flats):
                offset = 0
                for k, i in enumerate(idx):
                    size = self.params[i].numel()
                    if len(flats) == 1 or heads[r][i] > 0:
                        partials[r][k] = other[offset : offset + size].view_as(self.params[i])
                    offset += size
            for i, grad in zip(idx, tree_sum(partials, _add_grads)):
                total[i] = grad
        gathered = []
        for r in range(self.world_size):
            rows = heads[r][n + self.local_shards :].view(self.local_shards, -1) if stat_width else None
            # without BatchNorm layers (rows None) no shard has statistics: every flag is 0
            gathered.append(
                [
                    None if heads[r][n + j] == 0 or rows is None else _unpack(rows[j], self.norms)
                    for j in range(self.local_shards)
                ]
            )
        return (None if all(g is None for g in total) else total), gathered

    def _update_running(self, gathered: list[list[Any]]) -> None:
        """Each shard's statistics, in shard order, as one process's forwards would have applied them."""
        if not self.norms:
            return
        with torch.no_grad():
            for s in range(self.micro_shards):
                shard = gathered[s % self.world_size][s // self.world_size]
                if shard is None:
                    continue
                for index, norm in enumerate(self.norms):
                    if index not in shard or not norm.track_running_stats:
                        continue
                    mean, var = shard[index]
                    tracked, running_mean, running_var = norm.num_batches_tracked, norm.running_mean, norm.running_var
                    assert tracked is not None and running_mean is not None and running_var is not None  # tracked stats
                    tracked.add_(1)
                    alpha = 1.0 / float(tracked) if norm.momentum is None else norm.momentum
                    running_mean.mul_(1 - alpha).add_(mean.to(running_mean), alpha=alpha)
                    running_var.mul_(1 - alpha).add_(var.to(running_var), alpha=alpha)

    threads_before: int | None = None
    """The process's intra-op thread count before :func:`setup` fixed the shards' (``rt.close`` restores it)."""

    def restore_threads(self) -> None:
        """Give the process back the thread count it had before the run fixed it."""
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)
            self.threads_before = None

    @contextlib.contextmanager
    def probing(self) -> Iterator[None]:
        """Training-mode passes outside the shards, kept out of the statistics and the tree
        (``ddpkit bench`` times compute with it, after its timed steps); their gradients are the
        caller's to drop."""
        self._probing = True
        try:
            yield
        finally:
            self._probing = False

    # -- BatchNorm's statistics, per shard -------------------------------------------------------
    _probing = False

    def _make_pre_hook(self, index: int) -> Any:
        def pre_hook(module: _BatchNorm, args: Any) -> None:
            if not (module.training and module.track_running_stats) or self._probing:
                return
            if self.current is None:
                raise UsageError(
                    "with micro_shards, a training-mode forward of a BatchNorm model runs inside "
                    "`for shard in rt.shards(*batch)` (its statistics are kept per shard); "
                    "call model.eval() for other forwards"
                )
            if index in self.stats.get(self.current[0], {}):
                raise UsageError(
                    f"micro_shards: BatchNorm layer {type(module).__name__} ran twice in one shard's "
                    "forward; micro_shards keeps one set of statistics per layer and shard"
                )
            running_mean, running_var, tracked = module.running_mean, module.running_var, module.num_batches_tracked
            assert running_mean is not None and running_var is not None and tracked is not None  # tracked stats
            self._saved[index] = (
                running_mean,
                running_var,
                tracked.clone(),
                module.momentum,
            )
            # momentum 1 on zeroed buffers: the kernel leaves exactly this shard's mean and unbiased variance
            module.running_mean = torch.zeros_like(running_mean)
            module.running_var = torch.zeros_like(running_var)
            module.momentum = 1.0

        return pre_hook

    def _make_post_hook(self, index: int) -> Any:
        def post_hook(module: _BatchNorm, args: Any, output: Any) -> None:
            if index not in self._saved:
                return
            mean, var, tracked, momentum = self._saved.pop(index)
            current, running_mean, running_var = self.current, module.running_mean, module.running_var
            num_batches_tracked = module.num_batches_tracked
            # the pre-hook saved this layer: inside a shard, with its statistics tracked
            assert current is not None and running_mean is not None and running_var is not None
            assert num_batches_tracked is not None
            self.stats.setdefault(current[0], {})[index] = (
                running_mean.detach(),
                running_var.detach(),
            )
            module.running_mean, module.running_var, module.momentum = mean, var, momentum
            num_batches_tracked.copy_(tracked)

        return post_hook


def setup(
    model: torch.nn.Module,
    optimizer: Any,
    micro_shards: int,
    *,
    device: torch.device,
    world_size: int,
    rank: int,
    seed: int | None,
) -> Exact:
    """Put ``model`` on ``device`` with rank 0's weights, fix the threads and cuDNN, and return its :class:`Exact`.

    Args:
        model: the user's model (not wrapped: the shards' sum replaces DDP's).
        optimizer: its optimizer, whose parameters' gradients are summed too (None: the model's only).
        micro_shards: M.
        device: this process's device.
        world_size: processes of the job (a power of two dividing M, checked by :func:`check`).
        rank: this process's rank.
        seed: the run's seed, which keys each shard's random stream (None: unseeded).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads_for(micro_shards))
    model.to(device)
    if device.type == "cuda":
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    if world_size > 1:
        broadcast_from_rank0(model)
    exact = Exact(
        model, optimizer, micro_shards=micro_shards, world_size=world_size, rank=rank, seed=seed, device=device
    )
    exact.threads_before = previous
    return exact
