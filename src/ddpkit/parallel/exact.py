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
scale, Hoffer et al., 2017). ``rt.accumulate`` (k batches a step) adds each shard's gradients over
the group's batches in order before the tree, and weighs each shard by the group's samples.
``compile=True`` compiles the model after the shards' hooks are on, and streams through
``rt.loader`` are cut like map-style batches (a ``ddpkit.Shards`` stream's ranks read contiguous
columns, so its shards lie end to end and sum along :func:`tree_sum_halves`). Refused with it, in
one line each that says why and what instead: SyncBatchNorm, gradient compression, fsdp,
infrequent syncs, DDP arguments, sparse gradients, a buffer of the model's own changed in place by
the shards' forwards (each process would keep its own shards' updates), and a world size that is
not a power of two dividing M.

**A fault-tolerant job** (``ddpkit run --fault-tolerant``, each replica one process): each step's
quorum shares the shards out by subtrees of the one-process tree (:meth:`Exact._share`), so the
survivors compute a dead replica's shards and a healed one takes its share back, at the same bits.

**The exchange** (:mod:`ddpkit.parallel.exact_exchange`): recursive halving then doubling along the
tree's top, which moves what a ring allreduce moves, in buckets sent while the last shard's
backward runs. On CUDA, deterministic kernels (:func:`deterministic_cuda`).

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
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ddpkit import _torch, rng
from ddpkit.distributed import collectives
from ddpkit.errors import UsageError, translate_uncaught
from ddpkit.observe.collectives import counted_wait
from ddpkit.parallel import modes
from ddpkit.parallel.exact_exchange import TreeExchange
from ddpkit.parallel.exact_tree import (
    _add_grads,
    _at,
    _cut_alike,
    _pack_table,
    _path_of,
    _take,
    _unpack_table,
    broadcast_from_rank0,
    check,
    reversed_bits,
    threads_for,
    tree_sum,
    tree_sum_halves,
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
        quorum: Any = None,
    ) -> None:
        self.micro_shards, self.world_size, self.rank = micro_shards, world_size, rank
        self.quorum = quorum
        """A fault-tolerant replica's :class:`~ddpkit.distributed.ft.Replica` (None: the shards are the
        process group's): each step's quorum shares the shards (:meth:`_share`)."""
        self.local_shards = micro_shards // world_size
        self.seed, self.device = seed, device
        self._model, self._optimizer = model, optimizer
        self.others: list[Any] = []  # more optimizers given to rt.setup with the model
        self.params = self._trainable()
        self._index = {id(p): i for i, p in enumerate(self.params)}  # a parameter's place in self.params
        self._hooked: set[int] = set()  # parameters whose ready hook is registered (by id)
        self.norms = [m for m in model.modules() if isinstance(m, _BatchNorm)]
        self.own_buffers = [
            (f"{name}.{key}" if name else key, buffer)
            for name, module in model.named_modules()
            if not isinstance(module, _BatchNorm)
            for key, buffer in module.named_buffers(recurse=False)
            if buffer is not None
        ]
        """The model's buffers that are not BatchNorm's (a causal mask, a running statistic of its own), by name."""
        self._buffer_versions: list[int] | None = None  # theirs as the step's first shards were cut
        self.current: tuple[int, int, int] | None = None  # (local index j, global shard s, its samples)
        self.leaves: dict[int, list[Any]] = {}  # local index -> gradients per parameter
        self.stats: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # j -> norm -> (mean, var)
        self.expected: list[int] = []  # local shards of the batch in hand with samples
        self.done: set[int] = set()  # local shards of the batch in hand that ran rt.backward
        self.cut = False  # a batch was cut and its exchange is due
        self.batch_count = 0  # samples of the global batch in hand
        self.group: tuple[int, bool] | None = None  # rt.accumulate: (samples of the group, its last batch)
        self.batches = 0  # batches cut since the last step (several in an accumulation group)
        self.reduced = False  # the batch's gradients were summed into .grad, and no step followed yet
        self.carried: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, the sum before this batch)
        self.halves = False  # the step's shards lie end to end (a ddpkit.Shards stream), not interleaved
        self.reversed_slots = False  # interleaved, rank r read the strided part reversed_bits(r) (see shards)
        self.group_stats: list[dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = []  # earlier batches'
        self._saved: dict[int, tuple[Any, ...]] = {}
        self.exchange_seconds = 0.0  # the step waited for the ranks' exchange (ddpkit bench reads it)
        self.exchange_calls = 0  # collectives of the last step's exchange
        self.exchange: TreeExchange | None = None
        self._overlap = False  # in the last shard's backward: buckets go to the exchange as they fill
        self._ready: dict[int, int] = {}  # bucket -> its gradients finished in this backward
        self._held: list[Any] = []  # the last shard's own gradients, until the optimizer stepped (after_backward)
        if world_size > 1:
            self.exchange = TreeExchange(self.params, world_size=world_size, rank=rank, device=device)
            self._hook_ready()
        for index, norm in enumerate(self.norms):
            norm.register_forward_pre_hook(self._make_pre_hook(index))
            norm.register_forward_hook(self._make_post_hook(index))

    def _trainable(self) -> list[torch.Tensor]:
        """The parameters that train now: the model's and its optimizer's (a group added since)."""
        first = [self._optimizer] if self._optimizer is not None else []
        return modes.trainable([self._model], first + self.others)

    def _hook_ready(self) -> None:
        for p in self.params:
            if id(p) not in self._hooked:
                self._hooked.add(id(p))
                p.register_post_accumulate_grad_hook(self._ready_hook)

    def _follow_trainable(self) -> None:
        """At a step's start: the parameters that train now (a layer unfrozen since ``rt.setup``, its
        optimizer's new group), so their shards' gradients are kept apart and summed along the tree
        too; every rank changes them at the same step, as the script does."""
        now = self._trainable()
        if [id(p) for p in now] == [id(p) for p in self.params]:
            return
        self.params = now
        self._index = {id(p): i for i, p in enumerate(now)}
        if self.exchange is not None:
            self.exchange.retarget(now)
            self._hook_ready()

    # -- the shards of a batch ------------------------------------------------------------------
    def shards(self, active: Any, step: int, batch: tuple[Any, ...]) -> Iterator[Any]:
        """Each local shard of ``batch`` with samples, in its own random stream; see ``rt.shards``.

        Checks and marks the batch as cut at once (not at the first ``next``): a rank whose shards
        are all empty (a short last batch) yields nothing, yet its ``rt.step`` must still take
        part in the exchange."""
        if not getattr(active, "cuts_global_batches", False):
            raise UsageError(
                "rt.shards needs a batch from rt.loader (micro_shards cuts its global batches, "
                "which a plain DataLoader does not have)"
            )
        if active.sampler.world_size != self.world_size:
            raise UsageError("rt.shards: this loader splits batches over another world size than the run's")
        if self.cut and self.group is None:
            raise UsageError(
                "rt.shards: the shards of the previous batch were not stepped; call rt.step "
                "after the last shard's rt.backward (or step every k batches inside rt.accumulate)"
            )
        if self.cut and self.done != set(self.expected):
            raise UsageError(
                "rt.shards: a batch came before every shard of the previous one ran rt.backward; "
                "finish the `for shard in rt.shards(...)` loop first"
            )
        if self.reduced:  # accumulating by hand (loss / k, rt.step every k batches): as .grad accumulates in
            if self.quorum is not None:  # torch, this batch's sum is added to the one before at its end
                raise UsageError(
                    "rt.shards: a batch after the previous one's gradients were summed, with no rt.step between "
                    "(accumulating by hand), under --fault-tolerant: a step a replica's death drops would lose "
                    "the batches before it; step every batch"
                )
            self._carry()
        if self.cut:  # the next batch of an accumulation group: its statistics follow the last one's
            self.group_stats.append(self.stats)
            self.stats = {}
        else:
            self._follow_trainable()
            if not self._probing:
                self._buffer_versions = [_torch.version_of(buffer) for _, buffer in self.own_buffers]
        full = active.sampler.global_batch_size
        if full < self.micro_shards:
            raise UsageError(
                f"micro_shards={self.micro_shards} cuts a global batch of {full} samples into shards of less than "
                f"one sample; raise global_batch_size to at least {self.micro_shards}, or lower micro_shards"
            )
        total, halves = active.global_count, bool(getattr(active, "contiguous_split", False))
        reversed_slots = bool(getattr(active.sampler, "reversed_slots", False))
        if self.cut and (halves, reversed_slots) != (self.halves, self.reversed_slots):
            raise UsageError("rt.accumulate with micro_shards: one group's batches come from one loader")
        self.halves, self.reversed_slots = halves, reversed_slots
        rows = None
        if halves:  # a Shards stream: rank r reads contiguous columns, so shards lie end to end
            if full % self.micro_shards:
                raise UsageError(
                    f"micro_shards={self.micro_shards} cuts a ddpkit.Shards stream's global batch of {full} "
                    f"samples into equal runs; make global_batch_size a multiple of {self.micro_shards}"
                )
            rows = full // self.micro_shards
            sizes = [max(0, min(total, (s + 1) * rows) - s * rows) for s in range(self.micro_shards)]
        else:
            sizes = [len(range(s, total, self.micro_shards)) for s in range(self.micro_shards)]
        mine = [j for j in range(self.local_shards) if sizes[self._global(j)] and self._computes(self._global(j))]
        self.expected, self.done, self.batch_count, self.cut = mine, set(), total, True
        self._held = []
        self.batches += 1
        return self._each(mine, sizes, step, self.batches - 1, batch, rows, self._collated(active, batch))

    def _collated(self, active: Any, batch: tuple[Any, ...]) -> list[Any] | None:
        """Each local shard's part of ``batch`` as the loader's collate made it from the shard's samples
        alone (:class:`ddpkit.loop.loader.ShardCollate`); None: cut from the batch (the same then).

        Raises:
            UsageError: the script's collate pads each batch to its longest sample, and ``batch`` is not
                the loader's tensors: a shard cut from it would be padded as no other world size pads it.
        """
        parts, whole = getattr(active, "shard_batches", None), getattr(active, "whole_batch", None)
        if not parts or whole is None or len(parts) != self.local_shards:
            return None
        found = [_path_of(item, whole) for item in batch]
        paths = [path for path in found if path is not None]
        if len(paths) == len(found):
            return [None if part is None else tuple(_at(part, path) for path in paths) for part in parts]
        if _cut_alike(whole, [part for part in parts if part is not None]):
            return None
        raise UsageError(
            "rt.shards: the loader's collate_fn pads each batch to its longest sample, so a shard cut from this "
            "rank's batch is padded as no other number of processes pads it; pass rt.shards the loader's "
            "tensors as they come (it hands out each shard as the collate_fn made it from the shard's "
            "samples), or pad to a fixed length"
        )

    def refuse_inside_shard(self, call: str) -> None:
        """Refuse ``call`` (``rt.all_reduce``, ``rt.log``, ...) while a shard is in hand.

        Its result would combine this shard with other ranks' shards, where one process computing
        every shard combines none, so the run's bits would depend on the number of processes; and a
        rank whose shards of a short last batch are all empty never calls it, so the others would wait.

        Raises:
            UsageError: naming the call and what to do instead.
        """
        if self.current is not None:
            raise UsageError(
                f"{call} inside `for shard in rt.shards(...)`: it would combine this shard with other ranks' "
                "shards (one process combines none), so the bits would depend on the number of processes, and "
                "a rank whose shards of a short last batch are empty would never call it; sum what the shards "
                "give and call it once after the shard loop"
            )

    def _refuse_script_collectives(self, before: int | None) -> None:
        """Refuse a shard whose body ran a ``torch.distributed`` collective of the script's own on the
        default group: a loss over the batch gathered from every rank (CLIP's, SimCLR's negatives,
        ``torch.distributed.nn.all_gather``), MoCo's queue of gathered keys. On 2 processes it gathers
        other ranks' shards; on one, nothing: the runs part silently (1 and 2 processes ended 2.8
        apart in their weights' sum). Counted by the group's sequence number (gloo, nccl), less
        ddpkit's own calls; a group of the script's own is not seen.

        Raises:
            UsageError: after the first shard that did.
        """
        if before is None or self._probing:
            return
        after = collectives.script_collectives()
        if after is not None and after != before:
            raise UsageError(
                "micro_shards: a torch.distributed collective ran inside `for shard in rt.shards(...)` (a loss "
                "over the batch gathered from every rank, say): it combines this shard with other ranks' shards "
                "where one process combines none, so the bits would depend on the number of processes; compute "
                "each shard's loss from its own samples and call collectives after the shard loop, or train "
                "without micro_shards (a loss over the gathered batch then runs as under torchrun)"
            )

    def _refuse_changed_buffers(self) -> None:
        """Refuse a step whose shards' forwards changed a buffer of the model's own in place.

        Each process keeps what its own shards' forwards did to such a buffer (a running mean of the
        inputs, a step counter): the ranks would part from each other and from one process, which
        ran every shard's forward. BatchNorm's running statistics are the ones micro-shards take over
        every shard, in shard order.

        Raises:
            UsageError: naming the buffer.
        """
        before, self._buffer_versions = self._buffer_versions, None
        if before is None:
            return
        for (name, buffer), version in zip(self.own_buffers, before):
            if _torch.version_of(buffer) != version:
                raise UsageError(
                    f"micro_shards: the forward of the shards changed the model's buffer {name!r} in place (a "
                    "running statistic of its own): each process would keep only its own shards' updates, and "
                    "the ranks and one process would part; micro_shards take BatchNorm's running statistics "
                    "over every shard and no other buffer's. Update it outside the `for shard in rt.shards(...)` "
                    "loop from every rank's values (rt.all_reduce), or train without micro_shards"
                )

    def _subtrees(self) -> int:
        """How many subtrees a fault-tolerant step's quorum shares out: the least power of two that gives every
        replica in it one (at most M), so each is a node of the one-process tree."""
        participants = self.quorum.participants if self.quorum is not None else 1
        return min(self.micro_shards, 1 << (max(1, participants) - 1).bit_length())

    def _computes(self, s: int) -> bool:
        """Whether this process computes global shard ``s`` (a fault-tolerant replica: the shards of its
        subtrees in this step's quorum, those of a dead replica included; otherwise: its own)."""
        if self.quorum is None:
            return True
        return (s % self._subtrees()) % max(1, self.quorum.participants) == self.quorum.rank

    def _slot(self, rank: int) -> int:
        """Which strided part of the global batch ``rank``'s loader read (:attr:`GlobalBatchSampler.slot`)."""
        return reversed_bits(rank, self.world_size) if self.reversed_slots else rank

    def _global(self, j: int) -> int:
        """The global shard of this rank's local shard ``j``."""
        return self.rank * self.local_shards + j if self.halves else self._slot(self.rank) + j * self.world_size

    def _owner(self, s: int) -> tuple[int, int]:
        """(rank, local shard) of global shard ``s``: the inverse of :meth:`_global` (reversing bits is its own inverse)."""
        if self.halves:
            return divmod(s, self.local_shards)
        return self._slot(s % self.world_size), s // self.world_size

    def _each(
        self,
        mine: list[int],
        sizes: list[int],
        step: int,
        in_group: int,
        batch: tuple[Any, ...],
        rows: int | None,
        collated: list[Any] | None = None,
    ) -> Iterator[Any]:
        for j in mine:
            s = self._global(j)
            if collated is not None and collated[j] is not None:
                parts = collated[j]  # the shard as the script's collate_fn made it from its samples alone
            else:
                parts = tuple(_take(item, j, self.local_shards, rows) for item in batch)
            self.current = (j, s, sizes[s])
            before = collectives.script_collectives()
            try:
                with self._random_stream(step, s, in_group):
                    yield parts[0] if len(parts) == 1 else parts
            finally:
                self.current = None
            if j not in self.done:
                raise UsageError(
                    "rt.shards: a shard went by without rt.backward; call rt.backward(loss) "
                    "once for every shard it hands out"
                )
            self._refuse_script_collectives(before)

    def key_batch(self, loader: Any) -> None:
        """Key torch's, numpy's and ``random``'s global generators by the batch ``loader`` just handed out
        (the run's seed, the loader's name, its epoch and place in it), the same on every rank.

        What a loop draws between a batch and its shards (mixup's ``lam = np.random.beta(a, a)`` for
        the batch, ``random.random() < p`` to pick a transform) is then one process's draw on any world
        size, and a draw whose size follows the rank's rows (dropout in a validation pass outside the
        shards, ``torch.randperm(len(x))``) parts the ranks' streams for that batch only. A shard's
        stream is keyed again inside it (:meth:`_random_stream`); after the shards the loop goes on
        from the batch's.
        """
        if self.seed is None:  # unseeded: nothing to make equal
            return
        rng.key_globals(f"{self.seed}:batch:{_identity(loader)}:{loader.epoch}:{loader.position}")

    @contextlib.contextmanager
    def _random_stream(self, step: int, shard: int, in_group: int = 0) -> Iterator[None]:
        """The shard's random stream: the run's seed, the step, the batch's place in an accumulation group, the shard."""
        if self.seed is None:  # unseeded: nothing to make equal
            yield
            return
        devices = [self.device] if self.device.type == "cuda" else []
        key = (self.seed * 1_000_003 + step * 65_537 + shard + in_group * 1_000_000_007) % (2**63)
        with torch.random.fork_rng(devices=devices, device_type=self.device.type), rng.keyed_globals(key):
            rng.seed_torch(key)  # numpy's and random's too: mixup's np.random.beta drew per rank
            yield

    def weight(self) -> float:
        """What the shard's mean loss is multiplied by: its share of the global batch's samples."""
        if self.current is None:
            raise UsageError(
                "with micro_shards, call rt.backward inside `for shard in rt.shards(*batch)`, once per shard"
            )
        if self.current[0] in self.done:
            raise UsageError("rt.backward ran twice on one shard; micro_shards takes one backward per shard")
        last_batch = self.group is None or self.group[1]
        # the last shard of the rank's (last) batch: its backward hands finished buckets to the exchange
        self._overlap = (
            self.exchange is not None and last_batch and self.current[0] == self.expected[-1] and not self._probing
        )
        self._ready = {}
        # a share of the step's samples: the batch's, or (rt.accumulate) the whole group's
        return self.current[2] / (self.batch_count if self.group is None else self.group[0])

    def accumulating(self, group: tuple[int, bool] | None) -> None:
        """``rt.accumulate`` opens a micro-step: (samples of its group, whether it is the group's last); None after it."""
        self.group = group

    def after_backward(self) -> None:
        """Keep the shard's gradients as a leaf of the tree and clear them for the next shard."""
        current = self.current
        assert current is not None  # rt.backward's weight() came first and refused one outside a shard
        if self._overlap:  # the step's last shard: the buckets the backward never reached go now
            self._overlap = False  # (the exchange sums this shard's gradients; no leaf is kept)
            self._submit_rest(current[0])
            # autograd's gradients, kept until the optimizer has stepped, as a plain step keeps them:
            # freed here, mid-step, glibc gave their pages back and the next step faulted 45 MB of
            # ResNet-18's in anew (13,000 page faults a step, a tenth of its time on this CPU)
            self._held = [p.grad for p in self.params]
        else:
            grads = [p.grad for p in self.params]
            earlier = self.leaves.get(current[0])  # the shard's gradient from the group's earlier batches
            self.leaves[current[0]] = grads if earlier is None else _add_grads(earlier, grads)
        self.done.add(current[0])
        for p in self.params:
            p.grad = None

    def after_step(self) -> None:
        """The optimizer has stepped: let autograd's gradients of the last shard go."""
        self._held = []
        self.reduced, self.carried = False, []
        self.batches = 0  # (not at the sum: batches accumulated by hand each draw a random stream of their own)

    def _ready_hook(self, param: torch.Tensor) -> None:
        """A parameter's gradient is ready in the last shard's backward: its bucket goes once full."""
        index = self._index.get(id(param))
        if not self._overlap or self.current is None or index is None:
            return
        exchange = self.exchange
        assert exchange is not None  # _overlap is only set with an exchange
        bucket = exchange.bucket_of[index]
        self._ready[bucket] = self._ready.get(bucket, 0) + 1
        if self._ready[bucket] == len(exchange.buckets[bucket]):
            self._submit(bucket, self._shard_grads(exchange.buckets[bucket], self.current[0]))

    def _shard_grads(self, members: list[int], current: int | None) -> list[list[Any]]:
        """For each parameter of a bucket, its gradient in each local shard (the shard in hand: ``.grad``)."""
        rows = []
        for i in members:
            row = []
            for j in range(self.local_shards):
                leaf = self.leaves.get(j)
                earlier = None if leaf is None else leaf[i]
                if j == current:  # the shard in hand, after its earlier batches' (as after_backward adds them)
                    grad = self.params[i].grad
                    row.append(grad if earlier is None else earlier if grad is None else earlier + grad)
                else:
                    row.append(earlier)
            rows.append(row)
        return rows

    def _submit_rest(self, current: int | None = None) -> None:
        """Hand the exchange every bucket the backward pass did not (all of them on a rank without samples);
        ``current``: the shard whose gradients are still in ``.grad``."""
        exchange = self.exchange
        assert exchange is not None
        for bucket, members in enumerate(exchange.buckets):
            if not exchange.submitted(bucket):
                self._submit(bucket, self._shard_grads(members, current))

    def _submit(self, bucket: int, grads: list[list[Any]]) -> None:
        """Hand the exchange a bucket; the step's first one starts the BatchNorm statistics' gather ahead of
        it (the forwards are done), behind the backward pass."""
        exchange = self.exchange
        assert exchange is not None
        if self.norms and not exchange.gathering:
            exchange.start_gather(self._stats_head(self._step_stats()))
        # the ranks whose shards the tree adds first are neighbours in both layouts but the plain interleaved one
        exchange.submit(bucket, grads, self.halves, neighbours_first=self.halves or self.reversed_slots)

    def _step_stats(self) -> list[list[Any]]:
        """Each batch's shard statistics (local shard order), in the order the batches came."""
        return [[batch.get(j) for j in range(self.local_shards)] for batch in [*self.group_stats, self.stats]]

    # -- the step --------------------------------------------------------------------------------
    def reduce(self) -> None:
        """Before the optimizer steps (or the gradients are clipped): the tree's sum of every shard's gradients into ``.grad`` and
        every shard's BatchNorm statistics into the running ones, in shard order (a collective)."""
        if self.current is not None or self.done != set(self.expected):
            raise UsageError(
                "rt.step came before every shard of the batch ran rt.backward; finish the "
                "`for shard in rt.shards(...)` loop first"
            )
        self._refuse_changed_buffers()
        stats = self._step_stats()
        if self.quorum is not None:  # a fault-tolerant replica: the quorum's subtrees, summed at its top
            total, gathered_stats = self._share(stats)
            self._forget_step()
        elif self.exchange is None:  # one process: the whole tree is here
            tree = tree_sum_halves if self.halves else tree_sum
            total = tree([self.leaves.get(j) for j in range(self.local_shards)], _add_grads)
            self._forget_step()
            gathered_stats = [stats]
        else:
            import time

            self._submit_rest()  # a rank whose shards were all empty hands over absent gradients
            self._forget_step()
            start = time.perf_counter()
            with counted_wait("micro_shards_exchange"):  # a call of every rank's, for the mismatch watchdog
                # started with the step's first bucket (nothing to gather without BatchNorm)
                gathered = self.exchange.gathered() if self.exchange.gathering else None
                gathered_stats = [] if gathered is None else self._unpack_stats(gathered, len(stats))
                total = self.exchange.wait()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            self.exchange_seconds += time.perf_counter() - start
            self.exchange_calls = self.exchange.calls_per_step + (1 if self.norms else 0)
        carried = {id(p): grad for p, grad in self.carried}
        self.carried = []
        for p, grad in zip(self.params, total if total is not None else [None] * len(self.params)):
            before = carried.get(id(p))
            p.grad = before if grad is None else grad if before is None else before + grad
        self.reduced = True
        self._update_running(gathered_stats)

    def _carry(self) -> None:
        """Keep the gradients the last batch's sum left in ``.grad`` (a copy: the exchange's buffer holds
        them, and the next exchange writes it), and clear ``.grad`` for this batch's shards."""
        self.carried = [(p, p.grad.detach().clone()) for p in self.params if p.grad is not None]
        for p in self.params:
            p.grad = None
        self.reduced = False

    def _forget_step(self) -> None:
        self.leaves, self.stats, self.group_stats, self.expected, self.done = {}, {}, [], [], set()
        self.cut = False

    def _share(self, stats: list[list[Any]]) -> tuple[list[Any] | None, list[Any]]:
        """A fault-tolerant step: each subtree's sum and each shard's statistics from the replica that
        computed them, bit for bit, then the tree's top here: (the gradients, the statistics by shard).

        The quorum changes from step to step and need not be a power of two (3 replicas of 4, one
        dead), so its subtrees travel whole: each replica writes the raw bits of the subtrees it
        computed into its rows of one int64 table, zero elsewhere, and the quorum sums the table.
        Exactly one replica writes each row, so the sum is that replica's bits (``x + 0`` in integers
        loses nothing, where ``-0.0 + 0.0`` in floats would). A failed sum shows at commit, which
        drops the step."""
        assert self.quorum is not None
        subtrees, rank, participants = self._subtrees(), self.quorum.rank, max(1, self.quorum.participants)
        layout = _Layout(self.params)
        rows = []
        for k in range(subtrees):
            mine = k % participants == rank
            part = (
                tree_sum([self.leaves.get(s) for s in range(k, self.micro_shards, subtrees)], _add_grads)
                if mine
                else None
            )
            rows.append(layout.pack(part, self.device))
        shard_stats = [stats[-1][s] if self._computes(s) else None for s in range(self.micro_shards)]
        stat_rows = self._stat_bits(shard_stats)
        table = torch.cat([*rows, stat_rows])
        self.quorum.all_reduce_sum(table, call="the exact exchange")
        self.exchange_calls = 1
        width = layout.width
        parts = [layout.unpack(table[k * width : (k + 1) * width]) for k in range(subtrees)]
        total = tree_sum(parts, _add_grads)
        return total, self._stats_from_bits(table[subtrees * width :])

    def _stat_bits(self, shard_stats: list[Any]) -> torch.Tensor:
        """The shards' BatchNorm statistics as int64 bits: a flag and a float64 row a shard (nothing without BatchNorm)."""
        if not self.norms:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        return _pack_table(shard_stats, self.norms).view(torch.int64).to(self.device)

    def _stats_from_bits(self, bits: torch.Tensor) -> list[Any]:
        """What :meth:`_stat_bits` wrote, summed over the quorum: one process's view (rank 0, one batch)."""
        if not self.norms:
            return []
        return [[_unpack_table(bits.cpu().view(torch.float64), self.micro_shards, self.norms)]]

    def _stats_head(self, stats: list[list[Any]]) -> torch.Tensor:
        """This rank's shard statistics of every batch as one float64 row (:func:`_pack_table`)."""
        return _pack_table([s for batch in stats for s in batch], self.norms).to(self.device)

    def _unpack_stats(self, heads: list[torch.Tensor], batches: int) -> list[Any]:
        """Every rank's row of :meth:`_stats_head`, back into statistics: rank, batch, local shard."""
        gathered = []
        for h in (h.cpu() for h in heads):
            unpacked = _unpack_table(h, batches * self.local_shards, self.norms)
            gathered.append([unpacked[b * self.local_shards : (b + 1) * self.local_shards] for b in range(batches)])
        return gathered

    def _update_running(self, gathered: list[list[Any]]) -> None:
        """Each shard's statistics, in shard order, as one process's forwards would have applied them."""
        if not self.norms:
            return
        batches = len(gathered[0]) if gathered else 0
        with torch.no_grad():
            for b, s in ((b, s) for b in range(batches) for s in range(self.micro_shards)):
                rank, j = self._owner(s)
                shard = gathered[rank][b][j]
                if shard is None:
                    continue
                # layers of one momentum in one call a list (a cumulative average's alpha is a layer's own)
                lists: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
                for index, norm in enumerate(self.norms):
                    if index not in shard or not norm.track_running_stats:
                        continue
                    mean, var = shard[index]
                    tracked, running_mean, running_var = norm.num_batches_tracked, norm.running_mean, norm.running_var
                    assert tracked is not None and running_mean is not None and running_var is not None  # tracked stats
                    tracked.add_(1)
                    if norm.momentum is None:
                        average = 1.0 / float(tracked)
                        running_mean.mul_(1 - average).add_(mean.to(running_mean), alpha=average)
                        running_var.mul_(1 - average).add_(var.to(running_var), alpha=average)
                        continue
                    targets, sources = lists.setdefault(norm.momentum, ([], []))
                    targets += [running_mean, running_var]
                    sources += [mean.to(running_mean), var.to(running_var)]
                for momentum, (targets, sources) in lists.items():
                    _torch.scale_add_(targets, sources, 1 - momentum, momentum)

    threads_before: int | None = None
    """The process's intra-op thread count before :func:`setup` fixed the shards' (``rt.close`` restores it)."""

    deterministic_before: tuple[bool, bool, bool, bool] | None = None
    """torch's deterministic algorithms (and their ``warn_only``), cuDNN's ``deterministic`` and ``benchmark``
    before :func:`setup` set them for CUDA (None: not CUDA)."""

    def restore_threads(self) -> None:
        """Give the process back the thread count and deterministic setting it had before the run, and stop the exchange's thread."""
        if self.exchange is not None:
            self.exchange.close()
        if self.deterministic_before is not None:  # (a notebook's next cells run as before the run)
            algorithms, warn_only, torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = (
                self.deterministic_before
            )
            torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
            self.deterministic_before = None
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
            if module is not self.norms[index]:  # a copy's layer: copy.deepcopy shares the closure
                raise UsageError(
                    "micro_shards keeps the BatchNorm statistics of the model rt.setup returned; a copy of it "
                    "(AveragedModel, copy.deepcopy) ran in training mode (torch.optim.swa_utils.update_bn?), which "
                    "would give it statistics that depend on the number of processes: average the statistics "
                    "with the weights (AveragedModel(model, use_buffers=True)), or call .eval() on the copy"
                )
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
            buffers = _torch.module_buffers(module)  # not through Module.__setattr__: 20 layers a shard
            running_mean, running_var, tracked = (
                buffers["running_mean"],
                buffers["running_var"],
                buffers["num_batches_tracked"],
            )
            assert running_mean is not None and running_var is not None and tracked is not None  # tracked stats
            self._saved[index] = (running_mean, running_var, tracked, module.momentum)
            # momentum 1 on zeroed buffers: the kernel leaves exactly this shard's mean and unbiased variance;
            # the count the forward adds 1 to is a scratch one (momentum 1 does not read it)
            buffers["running_mean"] = torch.zeros_like(running_mean)
            buffers["running_var"] = torch.zeros_like(running_var)
            buffers["num_batches_tracked"] = torch.zeros_like(tracked)
            object.__setattr__(module, "momentum", 1.0)

        return pre_hook

    def _make_post_hook(self, index: int) -> Any:
        def post_hook(module: _BatchNorm, args: Any, output: Any) -> None:
            if index not in self._saved:
                return
            mean, var, tracked, momentum = self._saved.pop(index)
            buffers = _torch.module_buffers(module)
            current = self.current
            assert current is not None  # the pre-hook saved this layer: inside a shard, with its statistics tracked
            self.stats.setdefault(current[0], {})[index] = (
                buffers["running_mean"].detach(),
                buffers["running_var"].detach(),
            )
            buffers["running_mean"], buffers["running_var"], buffers["num_batches_tracked"] = mean, var, tracked
            object.__setattr__(module, "momentum", momentum)

        return post_hook


def _identity(loader: Any) -> str:
    """What tells ``loader`` from the run's others in every attempt and on every world size: its key (less
    the ``#2`` an unnamed loader rebuilt may take in one attempt and not another), its global batch,
    and its dataset's length as the loader measured it when built (a stream's: none)."""
    name = str(loader.name)
    if re.fullmatch(rf"{re.escape(type(loader.dataset).__name__)}#\d+", name):  # an unnamed loader's key
        name = name.split("#")[0]
    sampler = loader.sampler
    return f"{name}:{getattr(sampler, 'global_batch_size', None)}:{getattr(sampler, 'dataset_length', None)}"


def setup(
    model: torch.nn.Module,
    optimizer: Any,
    micro_shards: int,
    *,
    device: torch.device,
    world_size: int,
    rank: int,
    seed: int | None,
    quorum: Any = None,
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
        quorum: a fault-tolerant replica's :class:`~ddpkit.distributed.ft.Replica` (None: not one).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads_for(micro_shards))
    model.to(device)
    deterministic_before = None
    if device.type == "cuda":
        deterministic_before = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
        )
        deterministic_cuda()
    if world_size > 1:
        broadcast_from_rank0(model)
    exact = Exact(
        model,
        optimizer,
        micro_shards=micro_shards,
        world_size=world_size,
        rank=rank,
        seed=seed,
        device=device,
        quorum=quorum,
    )
    exact.threads_before, exact.deterministic_before = previous, deterministic_before
    return exact


def deterministic_cuda() -> None:
    """CUDA kernels that give the same bits every run: cuDNN's deterministic algorithms, no autotuning,
    ``torch.use_deterministic_algorithms`` with cuBLAS's fixed workspace, and an op that has no
    deterministic kernel reported in one line (exit 2) rather than torch's traceback."""
    # cuBLAS reads it when it creates its handle (the first matrix product on the device)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)
    translate_uncaught(no_deterministic_kernel)


# torch names the op, sometimes with its input: "_histc_cuda with floating point input does not ..."
_NO_KERNEL = re.compile(r"^(\S+(?: [^,.']+?)?) does not have a deterministic implementation")


def no_deterministic_kernel(exc: BaseException) -> UsageError | None:
    """torch's error for an op without a deterministic CUDA kernel, as one line that says what to do.

    >>> no_deterministic_kernel(RuntimeError("index_add_cuda_ does not have a deterministic implementation, but you set ..."))
    UsageError('micro_shards runs deterministic CUDA kernels only, and index_add_cuda_ has none; train this model with micro_shards on the CPU, replace that op, or drop micro_shards')
    """
    found = _NO_KERNEL.match(str(exc)) if isinstance(exc, RuntimeError) else None
    if found is None:
        return None
    instead = (
        "flatten per-position scores (N, C, T) to rows for F.cross_entropy (logits.movedim(1, -1).reshape(-1, C), "
        "targets.reshape(-1)), whose kernel is deterministic"
        if found.group(1).startswith("nll_loss2d")
        else "replace that op"
    )
    return UsageError(
        f"micro_shards runs deterministic CUDA kernels only, and {found.group(1)} has none; train this model "
        f"with micro_shards on the CPU, {instead}, or drop micro_shards"
    )


class _Layout:
    """The parameters' gradients as one int64 row of raw bits: a present flag a parameter, then each
    gradient's bytes in 8-byte slots (any dtype travels unchanged, and a sum with zeros keeps it)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = params
        self.slots = [-(-(p.numel() * p.element_size()) // 8) for p in params]
        self.starts = [len(params) + sum(self.slots[:i]) for i in range(len(params))]
        self.width = len(params) + sum(self.slots)

    def pack(self, grads: list[Any] | None, device: torch.device) -> torch.Tensor:
        """``grads`` (one a parameter, None where absent; None: nothing) as a row."""
        row = torch.zeros(self.width, dtype=torch.int64, device=device)
        for i, grad in enumerate(grads or []):
            if grad is None:
                continue
            row[i] = 1
            raw = grad.detach().contiguous().reshape(-1).view(torch.uint8)
            row[self.starts[i] : self.starts[i] + self.slots[i]].view(torch.uint8)[: raw.numel()] = raw
        return row

    def unpack(self, row: torch.Tensor) -> list[Any] | None:
        """What :meth:`pack` wrote (None where every parameter is absent)."""
        grads: list[Any] = []
        present = row[: len(self.params)].tolist()  # one read of the flags (one device sync on CUDA)
        for i, p in enumerate(self.params):
            if present[i] == 0:
                grads.append(None)
                continue
            raw = row[self.starts[i] : self.starts[i] + self.slots[i]].view(torch.uint8)[: p.numel() * p.element_size()]
            grads.append(raw.view(p.dtype).view(p.shape).clone())
        return grads if any(g is not None for g in grads) else None
