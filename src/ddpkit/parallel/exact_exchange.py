"""The ranks' exchange of micro-shard gradients: the fixed tree's top, as recursive halving then doubling, in the background.

Rank ``r`` holds the partial sum ``P[r]`` of its own shards. The fixed tree sums the ranks' partial
sums as ``tree(P) = tree(P[0::2]) + tree(P[1::2])``, so its innermost additions pair ranks
``W / 2`` apart and its last one pairs neighbours. Recursive halving walks that tree bottom-up:

- **Halving (a reduce-scatter).** At distance ``d = W/2, W/4, ..., 1`` rank ``r`` swaps half of the
  range it still holds with rank ``r ^ d`` (the lower half stays with the rank whose bit ``d`` is
  clear), and adds what it receives to what it keeps. After ``log2 W`` rounds each rank holds
  ``1/W`` of the gradients, summed by exactly the additions one process makes (``a + b`` is
  ``b + a`` bit for bit; only the grouping matters, and it is the tree's).
- **Doubling (an all-gather).** The same pairs in reverse order swap what they hold, until every
  rank holds every sum.

Each rank sends and receives ``N (W - 1) / W`` elements in each phase: ``2 N (W - 1) / W`` in all,
what a ring allreduce moves, over ``2 log2 W`` rounds of ``torch.distributed``'s own ``isend`` and
``irecv`` (a process group of the exchange's own, so it runs beside the step's other collectives).

**Two ranks.** The tree's top is then one addition, ``a + b``, which any allreduce makes alike on
both ranks. A rank that never reached a parameter sends ``-0.0`` in its place (``x + -0.0`` is ``x``
to the bit, ``-0.0`` included) and a count of who reached it in the same message, so a bucket is
one of torch's own allreduces, started from the backward pass's hook in a fixed order as DDP's
reducer starts its buckets, with no thread of ours and no round of flags first.

**Buckets, in the background.** Parameters are grouped into buckets in reverse order (the order a
backward pass finishes their gradients, as DDP's buckets). During the last micro-shard's backward
each bucket whose gradients are all there is handed to a thread that sums the rank's shards and
exchanges it, while the backward pass goes on; buckets start in one fixed order on every rank, two
at a time over gloo (each with tags of its own), so a slow link is not idle while one bucket's rounds
run on a node. A parameter a rank's shards never reached is "absent" (not zero) and travels as a flag:
the tree skips it as it skips an empty shard, so no ``-0.0 + 0.0`` can change a bit.

Example (one process: the bucket plan only):
    >>> import torch
    >>> params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 5, 2)]
    >>> plan_buckets(params, bucket_bytes=32, first_bucket_bytes=8)
    [[2], [1], [0]]
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from ddpkit.parallel.exact_tree import tree_sum, tree_sum_halves

__all__ = ["TreeExchange", "plan_buckets"]

BUCKET_BYTES = 25 * 2**20
"""A bucket's size once the first is sent: DDP's ``bucket_cap_mb`` default."""
IN_FLIGHT = 2
"""Buckets summed at once by three or more ranks over gloo."""
FIRST_BUCKET_BYTES = 2**20
"""The first bucket's size (DDP's first bucket is 1 MiB too): the exchange starts early in the backward pass."""


def plan_buckets(
    params: Sequence[torch.Tensor], *, bucket_bytes: int = BUCKET_BYTES, first_bucket_bytes: int = FIRST_BUCKET_BYTES
) -> list[list[int]]:
    """Parameter indices in buckets: reverse order, one dtype and device a bucket, each closed once it holds ``bucket_bytes``.

    Args:
        params: the parameters whose gradients are summed, in the model's order.
        bucket_bytes: a bucket's size after the first.
        first_bucket_bytes: the first bucket's size.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size, limit, kind = 0, first_bucket_bytes, None
    for i in reversed(range(len(params))):
        p = params[i]
        if current and ((p.dtype, p.device) != kind or size >= limit):
            buckets.append(current)
            current, size, limit = [], 0, bucket_bytes
        current.append(i)
        size += p.numel() * p.element_size()
        kind = (p.dtype, p.device)
    if current:
        buckets.append(current)
    return buckets


class TreeExchange:
    """The background exchange of one run's micro-shard gradients (world size ≥ 2, a power of two).

    Args:
        params: the parameters whose gradients are summed.
        world_size: processes of the job.
        rank: this process's rank.
        device: where the gradients live.
        bucket_bytes, first_bucket_bytes: the buckets' sizes (:func:`plan_buckets`; None: the module's).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        world_size: int,
        rank: int,
        device: torch.device,
        bucket_bytes: int | None = None,
        first_bucket_bytes: int | None = None,
    ) -> None:
        import torch.distributed as dist

        self.world_size, self.rank, self.device = world_size, rank, device
        self._sizes = (
            BUCKET_BYTES if bucket_bytes is None else bucket_bytes,
            FIRST_BUCKET_BYTES if first_bucket_bytes is None else first_bucket_bytes,
        )
        self.retarget(params)
        # the exchange's own group (every rank creates it, in setup): its sends run beside the
        # step's other collectives (BatchNorm statistics, metrics) without being ordered with them
        backend = dist.get_backend()
        self.group = dist.new_group(backend=backend)
        # the step's BatchNorm statistics: ahead of the buckets on two ranks (all from the main thread);
        # beside the thread's sends on more, in a group of their own (one gather a step, so one order)
        self._stats_group = self.group if world_size == 2 else dist.new_group(backend=backend)
        # gloo sends and receives CPU tensors only: CUDA gradients (processes sharing a GPU) go through the host
        self._through_host = device.type == "cuda" and backend == "gloo"
        self.rounds = world_size.bit_length() - 1  # log2 W
        self.direct = world_size == 2
        """Two ranks: each bucket is one allreduce started from the main thread (no thread of ours)."""
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._done: queue.Queue[Any] = queue.Queue()
        self._submitted: set[int] = set()
        self._ready: dict[int, tuple[torch.Tensor, list[int]]] = {}  # direct: bucket -> (flat, offsets), not started
        self._started: list[
            tuple[Any, torch.Tensor, torch.Tensor, list[int]]
        ] = []  # direct: (work, flat, sent, offsets)
        self._gather: tuple[Any, list[torch.Tensor]] | None = None  # direct: the step's gather (start_gather)
        self._thread: threading.Thread | None = None
        self._jobs: queue.Queue[Any] = queue.Queue()  # buckets to sum, in bucket order, for the workers
        self._workers: list[threading.Thread] = []
        if not self.direct:
            self._thread = threading.Thread(target=self._serve, name="ddpkit-micro-shard-exchange", daemon=True)
            self._thread.start()
            # two buckets at a time, as gloo's two worker threads run two of DDP's allreduces, so the link
            # is not idle while one bucket's rounds add or wait (gloo matches messages by tag, a bucket its
            # own; nccl ignores tags and wants one order a communicator: one bucket at a time there)
            for k in range(IN_FLIGHT if backend == "gloo" else 1):
                worker = threading.Thread(target=self._work, name=f"ddpkit-micro-shard-bucket-{k}", daemon=True)
                worker.start()
                self._workers.append(worker)

    # -- the main thread's side -------------------------------------------------------------------

    def retarget(self, params: Sequence[torch.Tensor]) -> None:
        """Exchange the gradients of ``params`` (the ones that train now), in buckets planned for them;
        every rank calls it at the same step, between exchanges."""
        self.params = list(params)
        self.buckets = plan_buckets(self.params, bucket_bytes=self._sizes[0], first_bucket_bytes=self._sizes[1])
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self._buffers: dict[Any, torch.Tensor] = {}  # see _buffer (planned anew with the buckets)

    @property
    def calls_per_step(self) -> int:
        """Collective or point-to-point rounds of one step's exchange (``ddpkit bench`` reads it)."""
        return len(self.buckets) if self.direct else 2 * self.rounds * len(self.buckets)

    def submit(
        self,
        bucket: int,
        grads: list[list[torch.Tensor | None]],
        halves: bool = False,
        *,
        neighbours_first: bool | None = None,
    ) -> None:
        """Hand over one bucket of this rank's shard gradients.

        Args:
            bucket: its index in :attr:`buckets`.
            grads: for each of its parameters, this rank's shard gradients in local shard order (None: a
                shard that did not reach it).
            halves: the shards lie end to end (:func:`~ddpkit.parallel.exact_tree.tree_sum_halves`, ranks
                holding contiguous runs), not interleaved.
            neighbours_first: the tree adds neighbouring ranks' sums first and those ``W/2`` apart last
                (None: as ``halves`` says; interleaved shards read by reversed-bits slots do too,
                :attr:`~ddpkit.loop.sampler.GlobalBatchSampler.slot`).
        """
        self._submitted.add(bucket)
        if not self.direct:
            first = halves if neighbours_first is None else neighbours_first
            self._inbox.put((bucket, (grads, halves, first)))
            return
        flat, offsets, _ = self._flat(bucket, grads, halves, counts=True)
        self._ready[bucket] = (flat, offsets)
        # buckets start in one order on both ranks, whatever order the backward pass finished them in
        while len(self._started) in self._ready:
            flat, offsets = self._ready.pop(len(self._started))
            sent = flat.cpu() if self._through_host else flat
            self._started.append((self._all_reduce(sent), flat, sent, offsets))

    def start_gather(self, tensor: torch.Tensor) -> None:
        """Start gathering ``tensor`` (the same size on every rank) from every rank, behind the backward pass,
        before this step's first bucket; :meth:`gathered` returns it."""
        import torch.distributed as dist

        assert self._gather is None and not self._started  # on two ranks, the step's first call on the group
        sent = tensor.cpu() if self._through_host else tensor
        into = [torch.empty_like(sent) for _ in range(self.world_size)]
        self._gather = (dist.all_gather(into, sent, group=self._stats_group, async_op=True), into)

    @property
    def gathering(self) -> bool:
        """Whether this step's :meth:`start_gather` ran."""
        return self._gather is not None

    def gathered(self) -> list[torch.Tensor]:
        """What :meth:`start_gather` gathered, in rank order."""
        assert self._gather is not None
        work, into = self._gather
        self._gather = None
        work.wait()
        return into

    def _buffer(self, key: Any, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat tensor of ``numel`` elements of ``like``'s dtype and device, the same one every step.

        A fresh one of tens of megabytes a step costs more than the copy into it (the kernel hands out
        and zeroes every page anew: 17 ms against 2 ms for ResNet-18's 44 MB on this project's CPU),
        which is why DDP's buckets persist too. The gradients handed back are views of it, dropped by
        the step's ``zero_grad`` before the next step writes it."""
        held = self._buffers.get(key)
        if held is None or held.numel() != numel or held.dtype != like.dtype or held.device != like.device:
            held = self._buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return held

    def _all_reduce(self, tensor: torch.Tensor) -> Any:
        import torch.distributed as dist

        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def _flat(
        self, bucket: int, grads: list[list[torch.Tensor | None]], halves: bool, *, counts: bool
    ) -> tuple[torch.Tensor, list[int], list[bool]]:
        """One bucket's local sums (the tree over this rank's shards) in its flat buffer, ``-0.0`` where this
        rank has none (``x + -0.0`` is ``x`` for every x, ``-0.0`` included, so such a place adds nothing);
        ``counts``: then one element a parameter, 1 where this rank reached it (two ranks sum them in
        the same allreduce). Returns the buffer, the parameters' offsets in it, and what this rank reached."""
        params = [self.params[i] for i in self.buckets[bucket]]
        local = [(tree_sum_halves if halves else tree_sum)(shards) for shards in grads]
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        reached = [g is not None for g in local]
        parts = [(torch.zeros_like(p).neg_() if g is None else g).reshape(-1) for p, g in zip(params, local)]
        if counts:
            parts.append(torch.tensor(reached, dtype=params[0].dtype, device=params[0].device))
        size = offsets[-1] + (len(params) if counts else 0)
        return torch.cat(parts, out=self._buffer(bucket, size, params[0])), offsets, reached

    def submitted(self, bucket: int) -> bool:
        """Whether ``bucket`` was handed over this step."""
        return bucket in self._submitted

    def wait(self) -> list[torch.Tensor | None]:
        """Every parameter's sum over all ranks' shards (None where no shard of any rank reached it).

        Raises:
            RuntimeError: what the exchange thread raised (a peer gone, for example).
        """
        if len(self._submitted) != len(self.buckets):
            raise AssertionError("TreeExchange.wait before every bucket was submitted")  # a bug of ddpkit
        self._submitted = set()
        if self.direct:
            return self._wait_direct()
        outcome = self._done.get()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _wait_direct(self) -> list[torch.Tensor | None]:
        started, self._started = self._started, []
        total: list[torch.Tensor | None] = [None] * len(self.params)
        for (work, flat, sent, offsets), members in zip(started, self.buckets):
            work.wait()
            if sent is not flat:
                flat.copy_(sent)
            reached = (flat[offsets[-1] :] > 0).tolist()  # some rank reached the parameter
            for k, i in enumerate(members):
                if reached[k]:
                    total[i] = flat[offsets[k] : offsets[k + 1]].view_as(self.params[i])
        return total

    def close(self) -> None:
        """Stop the thread (between steps)."""
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(None)
            self._thread.join(timeout=2)
        for _ in self._workers:
            self._jobs.put(None)
        for worker in self._workers:
            worker.join(timeout=2)
        self._workers = []

    # -- the thread's side ------------------------------------------------------------------------
    def _serve(self) -> None:
        early: dict[int, Any] = {}
        while True:
            total: list[torch.Tensor | None] = [None] * len(self.params)
            sums: list[Future[list[torch.Tensor | None]]] = []
            try:
                # buckets start in one order on every rank, two at a time: the lowest bucket that some rank
                # has not finished can always run everywhere, so no bucket waits on a peer that waits on it
                for b in range(len(self.buckets)):
                    while b not in early:
                        item = self._inbox.get()
                        if item is None:
                            return
                        early[item[0]] = item[1]
                    sums.append(Future())
                    self._jobs.put((sums[-1], b, *early.pop(b)))
                for members, bucket_sum in zip(self.buckets, sums):
                    for i, grad in zip(members, bucket_sum.result()):
                        total[i] = grad
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
                early.clear()
                self._done.put(exc)
                continue
            self._done.put(total)

    def _work(self) -> None:
        if self.device.type == "cuda":  # a thread starts on GPU 0: NCCL's sends and receives want this rank's
            torch.cuda.set_device(self.device)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            bucket_sum, bucket, grads, halves, first = job
            try:
                bucket_sum.set_result(self._bucket(bucket, grads, halves, first))
            except BaseException as exc:  # noqa: BLE001 - the serving thread hands it to the main thread
                bucket_sum.set_exception(exc)

    def _bucket(
        self, bucket: int, grads: list[list[torch.Tensor | None]], halves: bool, neighbours_first: bool
    ) -> list[torch.Tensor | None]:
        """One bucket: the local tree over shards, then halving and doubling across the ranks."""
        params = [self.params[i] for i in self.buckets[bucket]]
        flat, offsets, reached = self._flat(bucket, grads, halves, counts=False)
        present = self._halve_then_double(
            bucket, flat, torch.tensor(reached, dtype=torch.bool), offsets, neighbours_first
        )
        return [flat[offsets[k] : offsets[k + 1]].view_as(p) if present[k] else None for k, p in enumerate(params)]

    def _swap(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], partner: int, bucket: int = 0) -> None:
        """For each ``(send, recv)``: send ``send`` to ``partner`` while receiving its message into ``recv``
        (in order, one tag each, the bucket's own: two buckets run at once; ``recv`` may be a slice of a
        larger tensor).

        One batch (``batch_isend_irecv``): NCCL runs it as one group, where a send larger than its
        buffers waits for the partner's receive; posted one by one, both partners' sends would wait
        for receives queued behind them. gloo posts them one by one, as before.
        """
        import torch.distributed as dist

        ops, landed = [], []
        for index, (send, recv) in enumerate(pairs):
            tag = 2 * bucket + index  # a bucket's rounds run one after another, so they share its tags
            # an empty half is empty on both sides (the partner's recv is this send's size): nothing travels
            if send.numel():
                sent = send.cpu() if self._through_host else send
                ops.append(dist.P2POp(dist.isend, sent, partner, group=self.group, tag=tag))
            if recv.numel():
                into = torch.empty(recv.shape, dtype=recv.dtype) if self._through_host else recv
                ops.append(dist.P2POp(dist.irecv, into, partner, group=self.group, tag=tag))
                landed.append((into, recv))
        requests = dist.batch_isend_irecv(ops) if ops else []
        for request in requests:
            assert request is not None  # None only for a rank outside the group; every rank is in it
            request.wait()
        for into, recv in landed:
            if into is not recv:
                recv.copy_(into)

    def _halve_then_double(
        self,
        bucket: int,
        flat: torch.Tensor,
        present: torch.Tensor,
        offsets: list[int],
        neighbours_first: bool = False,
    ) -> torch.Tensor:
        """Sum ``flat`` over the ranks along the tree, in place; returns the parameters any rank had.

        Interleaved shards, rank ``r`` reading slot ``r``, pair ranks ``W/2`` apart first and neighbours
        last; shards laid end to end, and interleaved ones read by reversed-bits slots, pair neighbours
        first and ranks ``W/2`` apart last (``neighbours_first``): the tree's innermost additions first."""
        lo, hi = 0, flat.numel()
        rounds: list[tuple[int, tuple[int, int], tuple[int, int]]] = []
        distances = [self.world_size >> k for k in range(1, self.rounds + 1)]
        for distance in reversed(distances) if neighbours_first else distances:
            partner = self.rank ^ distance
            mid = lo + (hi - lo) // 2
            keep, give = ((lo, mid), (mid, hi)) if not self.rank & distance else ((mid, hi), (lo, mid))
            theirs = self._buffer((bucket, len(rounds)), keep[1] - keep[0], flat)
            theirs_present = torch.empty(len(present), dtype=torch.uint8)
            mine_present = present.to(torch.uint8)
            if flat.device.type == "cuda" and not self._through_host:  # nccl sends device tensors only
                mine_present, theirs_present = mine_present.to(flat.device), theirs_present.to(flat.device)
            self._swap([(mine_present, theirs_present), (flat[give[0] : give[1]], theirs)], partner, bucket)
            they_had = theirs_present.cpu() > 0
            self._combine(flat, keep, theirs, present, they_had, offsets)
            present = present | they_had
            rounds.append((partner, keep, give))
            lo, hi = keep
        for partner, keep, give in reversed(rounds):  # doubling: received straight into place
            self._swap([(flat[keep[0] : keep[1]], flat[give[0] : give[1]])], partner, bucket)
        return present

    @staticmethod
    def _combine(
        flat: torch.Tensor,
        keep: tuple[int, int],
        theirs: torch.Tensor,
        mine_present: torch.Tensor,
        theirs_present: torch.Tensor,
        offsets: list[int],
    ) -> None:
        """``flat[keep] = mine + theirs`` where both subtrees reached a parameter, the one that did elsewhere."""
        lo, hi = keep
        if hi <= lo:
            return
        if bool(mine_present.all()) and bool(theirs_present.all()):
            flat[lo:hi].add_(theirs)
            return
        for k in range(len(offsets) - 1):
            start, end = max(offsets[k], lo), min(offsets[k + 1], hi)
            if start >= end:
                continue
            mine_part, their_part = flat[start:end], theirs[start - lo : end - lo]
            if mine_present[k] and theirs_present[k]:
                mine_part.add_(their_part)
            elif theirs_present[k]:
                mine_part.copy_(their_part)
