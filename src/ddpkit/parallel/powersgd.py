"""PowerSGD as a DDP communication hook, laid out for speed and ordered for gloo.

The algorithm is PowerSGD's (Vogels et al., 2019, as in torch's ``powerSGD_hook``): each weight
matrix ``M`` (n x m; conv kernels as out x rest) of a bucket, with this rank's error feedback
added, is sent as two rank-``r`` factors in two allreduces,

1. ``P = M Q`` (``Q`` from the previous step: warm start), summed over ranks; vectors (biases,
   norms) and matrices too small to gain travel whole beside it;
2. ``P`` orthogonalised, ``Q = M^T P``, summed over ranks;

and the bucket receives ``P Q^T / world``, while ``M - P Q^T / world`` stays behind as this
rank's error feedback. Three things differ from torch's hook, for speed on CPUs and slow links:

- **Layout.** Factors are kept transposed (``r x n`` and ``r x m``, rows contiguous) and the
  feedback in one buffer per bucket. Then every product is one matrix multiply that reads each
  gradient once: on one core, MKL takes 2-3 ms for a 9.4M-element matrix this way, and 12 ms
  (``M Q``) and 42 ms (``M^T P``) with torch's ``m x r`` layout. No full-size copy or
  allocation per step.
- **One allreduce less per bucket**: the whole tensors travel with ``P``.
- **Overlap with a fixed issue order.** gloo pairs collectives by the order ranks issue them
  on a process group. ``P`` goes out on DDP's group from the backward thread, bucket after
  bucket; ``Q`` goes out on a group of its own, from the callback that sees bucket ``b``'s ``P``
  arrive, once bucket ``b-1``'s ``Q`` is out. So each bucket's round trips start as soon as
  its data is there and overlap the rest of the backward pass, in the same order on every rank
  (torch's hook issues ``Q`` from callbacks on the one group, where two buckets in flight can
  go out in different orders on different ranks).

The state (iteration, each rank's error feedback, the warm-start factors, the random stream
that starts them) is plain tensors, so checkpoints hold it and a resumed run is bitwise equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

FORMAT = 4
"""The layout of saved factors and feedback: 4 since matrices under :data:`SMALL_MATRIX` elements
travel whole (3: compressed at twice the rank; 2: at one rank, where factors were at most half of
a matrix). Checkpoints of another format (or none: torch's hook's layout) resume with fresh
feedback and a warning."""
MIN_COMPRESSION = 8
"""A matrix is compressed when its factors are at most an eighth of its size. torch's hook takes
half: then the small matrices of small models are compressed too, where a low-rank gradient costs
accuracy (the digits ConvNet lost 2.4 points at rank 2) for bytes that do not matter (its largest
matrix is 51 KB)."""
SMALL_MATRIX = 1 << 16
"""Matrices under 64K elements (256 KB of fp32) travel whole. At twice ``powersgd_rank`` (the rule
before) MLPs on digits it was not tuned on lost up to 1.85 points in 40 steps (3 seeds); whole,
0.83 at most (BENCHMARKS.md). They are a small share of a big model's bytes: ResNet-18 sends
1.11 MB a step instead of 0.37 (of 44.7), a tiny-lm 0.59 instead of 0.34 (of 22.4)."""


@dataclass
class _Group:
    """The matrices of one shape in a bucket: indices among the bucket's gradients, and offsets."""

    n: int
    m: int
    members: list[int]
    r: int = 1  # the rank of this shape's factors (:func:`matrix_rank`)
    p_at: int = 0  # offset of this group's (k, r, n) block in the P buffer
    q_at: int = 0  # offset of its (k, r, m) block in the Q buffer
    e_at: int = 0  # offset of its (k, n, m) block in the feedback buffer


@dataclass
class _Bucket:
    """One DDP bucket's layout and buffers (built at its first compressed step)."""

    shapes: list[torch.Size]
    groups: list[_Group]
    plain: list[int]  # gradients sent whole
    send: torch.Tensor  # [P blocks..., whole tensors]
    q: torch.Tensor  # [Q blocks...], kept between steps (warm start)
    error: torch.Tensor  # [feedback blocks...], this rank's own
    p_numel: int = 0
    result: Any = None  # this step: the future DDP waits on for this bucket
    sent: Any = None  # this step: the P allreduce's future
    buffer: Any = None  # this step: the bucket's flat gradients
    grads: list[torch.Tensor] = field(default_factory=list)  # this step: views into ``buffer``


def matrix_rank(shape: torch.Size, rank: int) -> int:
    """The rank of a matrix's factors: ``rank`` (a matrix under :data:`SMALL_MATRIX` elements is
    not compressed at all)."""
    return rank


def _is_matrix(shape: torch.Size, rank: int) -> bool:
    """Whether a gradient of ``shape`` is compressed: a matrix (a conv kernel as out x rest) of at
    least :data:`SMALL_MATRIX` elements whose factors are at most 1/:data:`MIN_COMPRESSION` of it."""
    if len(shape) < 2 or shape.numel() < SMALL_MATRIX:
        return False
    n, m = shape[0], shape.numel() // shape[0]
    return (n + m) * matrix_rank(shape, rank) * MIN_COMPRESSION < n * m


def payload_elements(shapes: list[torch.Size], rank: int) -> int:
    """Elements a rank hands to allreduce per compressed step for gradients of ``shapes``:
    ``P`` and ``Q`` (``(n + m) x`` :func:`matrix_rank`) of each matrix worth compressing, the rest whole.

    What ``ddpkit bench`` predicts a PowerSGD row sends before measuring it.
    """
    return sum((s[0] + s.numel() // s[0]) * matrix_rank(s, rank) if _is_matrix(s, rank) else s.numel() for s in shapes)


class PowerSGD:
    """The hook's state and work; :class:`ddpkit.parallel.compression.PowerSGDCompressor` wraps it."""

    def __init__(self, rank: int, start: int, device: torch.device, seed: int = 0) -> None:
        self.rank = rank
        self.start = start
        self.device = device
        self.iter = 0
        import numpy as np  # (here: ddpkit imports where numpy is missing, make gpu-check's image)

        self.rng = np.random.RandomState(seed)  # as torch's PowerSGD hook draws its Q
        self.buckets: dict[int, _Bucket] = {}
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # loaded, not yet adopted
        self.payload_elements = 0
        self.group: Any = None  # the process group for Q (P's is the default one)
        self._queue: torch.futures.Future[Any] = torch.futures.Future()  # done once the last bucket's Q is issued
        self._queue.set_result(None)

    # -- the hook -------------------------------------------------------------------------------

    def hook(self, bucket: Any) -> Any:
        """Reduce ``bucket``: plain before ``start`` steps, then as P and Q factors; a future of it."""
        buffer = bucket.buffer()
        last = bucket.is_last()
        if self.iter < self.start:
            self.payload_elements += buffer.numel()
            buffer.div_(dist.get_world_size())
            future = dist.all_reduce(buffer, async_op=True).get_future().then(lambda done: done.value()[0])
            if last:
                self.iter += 1
            return future
        if self.group is None:
            raise RuntimeError(
                "PowerSGD needs its own process group for Q; ddpkit.parallel.compression.attach makes it"
            )
        grads = bucket.gradients()
        state = self._bucket(bucket.index(), grads, buffer)
        state.buffer, state.grads = buffer, grads
        state.result = torch.futures.Future(devices=[buffer.device] if buffer.device.type == "cuda" else None)
        try:
            self._send_p(state)
        except BaseException as error:
            state.result.set_exception(error)
            raise
        if last:
            self.iter += 1
        # Q waits for its P and for the previous bucket's Q to be issued: Qs go out in bucket
        # order on every rank, from whichever thread completes them.
        ready = torch.futures.collect_all([state.sent, self._queue])
        self._queue = ready.then(lambda _: self._send_q(state))
        return state.result

    def _send_p(self, state: _Bucket) -> None:
        """Feedback in, ``P = M Q`` for every matrix, whole tensors beside, allreduce issued."""
        grads = state.grads
        for group in state.groups:
            k, r = len(group.members), group.r
            error = state.error[group.e_at : group.e_at + k * group.n * group.m].view(k, group.n, group.m)
            q = state.q[group.q_at : group.q_at + k * r * group.m].view(k, r, group.m)
            p = state.send[group.p_at : group.p_at + k * r * group.n].view(k, r, group.n)
            for j, index in enumerate(group.members):
                error[j].add_(grads[index].view(group.n, group.m))  # M = G + feedback
                torch.mm(q[j], error[j].t(), out=p[j])  # (M Q)^T
        at = state.p_numel
        for index in state.plain:
            size = grads[index].numel()
            state.send[at : at + size].copy_(grads[index].view(-1))
            at += size
        self.payload_elements += state.send.numel() + state.q.numel()
        state.sent = dist.all_reduce(state.send, async_op=True).get_future()

    def _send_q(self, state: _Bucket) -> None:
        """``P`` summed: whole tensors back, ``P`` orthogonalised, ``Q = M^T P`` allreduce issued.

        Runs as a future's callback; what goes wrong is handed to DDP through the bucket's future.
        """
        try:
            self._orthogonalise_and_send(state)
        except BaseException as error:  # noqa: BLE001 — DDP raises it from the backward pass
            if not state.result.done():
                state.result.set_exception(error)

    def _orthogonalise_and_send(self, state: _Bucket) -> None:
        state.sent.wait()
        world, grads, buffer = dist.get_world_size(), state.grads, state.buffer
        at = state.p_numel
        for index in state.plain:
            size = grads[index].numel()
            grads[index].view(-1).copy_(state.send[at : at + size]).div_(world)
            at += size
        for group in state.groups:
            k, r = len(group.members), group.r
            p = state.send[group.p_at : group.p_at + k * r * group.n].view(k, r, group.n)
            _orthonormal_rows(p)
            error = state.error[group.e_at : group.e_at + k * group.n * group.m].view(k, group.n, group.m)
            q = state.q[group.q_at : group.q_at + k * r * group.m].view(k, r, group.m)
            for j in range(k):
                torch.mm(p[j], error[j], out=q[j])  # (M^T P)^T
        result = state.result

        def decompress(done: Any) -> None:
            try:
                done.wait()
                state.q.div_(world)
                for group in state.groups:
                    k, r = len(group.members), group.r
                    p = state.send[group.p_at : group.p_at + k * r * group.n].view(k, r, group.n)
                    q = state.q[group.q_at : group.q_at + k * r * group.m].view(k, r, group.m)
                    error = state.error[group.e_at : group.e_at + k * group.n * group.m].view(k, group.n, group.m)
                    for j, index in enumerate(group.members):
                        out = grads[index].view(group.n, group.m)
                        torch.mm(p[j].t(), q[j], out=out)  # P Q^T / world: the same on every rank
                        error[j].sub_(out)  # what stays behind
                result.set_result(buffer)
            except BaseException as error:  # noqa: BLE001 — handed to DDP, which raises it
                if not result.done():
                    result.set_exception(error)

        if state.groups:
            dist.all_reduce(state.q, group=self.group, async_op=True).get_future().then(decompress)
        else:  # nothing worth compressing in this bucket
            result.set_result(buffer)

    # -- layout ---------------------------------------------------------------------------------

    def _bucket(self, index: int, grads: list[torch.Tensor], buffer: torch.Tensor) -> _Bucket:
        shapes = [g.shape for g in grads]
        state = self.buckets.get(index)
        if state is not None:
            if state.shapes != shapes:
                raise RuntimeError(
                    f"DDP's gradient bucket {index} changed its layout under PowerSGD "
                    "(its error feedback no longer fits); report this to ddpkit"
                )
            return state
        by_shape: dict[tuple[int, int], _Group] = {}
        plain = []
        for i, shape in enumerate(shapes):
            if _is_matrix(shape, self.rank):
                n, m = shape[0], shape.numel() // shape[0]
                by_shape.setdefault((n, m), _Group(n, m, [], matrix_rank(shape, self.rank))).members.append(i)
            else:
                plain.append(i)
        groups = list(by_shape.values())
        p_numel = q_numel = e_numel = 0
        for group in groups:
            k = len(group.members)
            group.p_at, group.q_at, group.e_at = p_numel, q_numel, e_numel
            p_numel += k * group.r * group.n
            q_numel += k * group.r * group.m
            e_numel += k * group.n * group.m
        plain_numel = sum(shapes[i].numel() for i in plain)
        saved = self.saved.pop(index, None)
        if saved is not None and (saved[0].numel() != e_numel or saved[1].numel() != q_numel):
            raise RuntimeError(
                f"the checkpoint's PowerSGD state for bucket {index} does not fit this model's "
                "buckets; resume with the model and DDP options it was saved with"
            )
        if saved is not None:
            error, q = (t.to(buffer.device, buffer.dtype).clone() for t in saved)
        else:
            error = buffer.new_zeros(e_numel)
            q = self._random(q_numel).to(buffer.device, buffer.dtype)
        state = _Bucket(shapes, groups, plain, buffer.new_empty(p_numel + plain_numel), q, error, p_numel)
        self.buckets[index] = state
        return state

    def _random(self, numel: int) -> torch.Tensor:
        """Starting factors, the same on every rank: drawn from the state's own random stream."""
        generator = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
        return torch.randn(numel, generator=generator)


def _orthonormal_rows(p: torch.Tensor) -> None:
    """Gram-Schmidt on the ``r`` rows of each of the ``k`` matrices in ``p`` (k, r, n), in place.

    A zero row stays zero (a gradient that is zero everywhere sends nothing, not NaN).
    """
    r = p.shape[1]
    for i in range(r):
        row = p[:, i : i + 1, :]
        row.div_(torch.linalg.vector_norm(row, dim=2, keepdim=True).clamp_min_(torch.finfo(p.dtype).tiny))
        if i + 1 < r:
            rest = p[:, i + 1 :, :]
            rest.sub_(torch.sum(rest * row, dim=2, keepdim=True) * row)
