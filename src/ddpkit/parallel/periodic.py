"""Infrequent synchronisation: each rank trains on its own, and every H steps the ranks meet.

For links too slow to exchange gradients every step (10 Mbit/s between hosts, cross-region links),
``rt.setup(model, optimizer, sync=..., sync_every=H)`` trains without DDP's per-step allreduce:

- ``sync="local-sgd"``: every ``H`` optimizer steps the ranks average their weights (what
  Accelerate's ``LocalSGD`` and torch's ``PeriodicModelAverager`` do).
- ``sync="diloco"`` (Douillard et al., 2023, "DiLoCo"): each rank's optimizer is the inner one;
  every ``H`` steps the ranks average the change since the last sync, ``synced - local``, and an
  outer Nesterov SGD step (``outer_lr``, ``outer_momentum``) applies it to the synced weights, from
  which every rank continues. With ``outer_lr=1`` and no momentum it is local SGD.

BatchNorm statistics are averaged at each sync. :func:`synced_weights` puts the synced weights in
place for evaluation and prediction (``ddpkit.evaluate``/``predict`` use it), and a checkpoint's
model entry holds them (:func:`exported`), so what is evaluated, exported or predicted is never
one rank's local weights. Each rank's local weights, its inner optimizer's state and where the
period stands are per-rank state (:meth:`PeriodicSync.state_dict`), so a run stopped mid-period
resumes bitwise on the same world size; on another one it continues from the synced weights.

The exchange is one allreduce of each rank's change since the last sync, every parameter and
floating buffer flattened: in bfloat16 by default (half the bytes; the changes, not the weights,
are rounded to 8 bits of mantissa), or ``sync_dtype="fp32"``, or ``sync_dtype="int8"`` (a quarter of
fp32's bytes): each rank's change plus its error feedback (what rounding kept back at the last
exchange of the fragment) is divided by the ranks' largest magnitude (one small allreduce) and
rounded to ``127 // world`` levels, so the sum of every rank's int8 values fits in int8 on the
wire; what the rounding kept back is this rank's next feedback, kept in checkpoints. Or
``sync_dtype="sparse"`` (SparseLoCo's top-k with error feedback): each rank sends the largest
:data:`~ddpkit.parallel.periodic_parts.SPARSE_DENSITY` of its change plus feedback (a 16-bit word
each: a 12-bit offset within blocks of 4,096 elements and a 4-bit value of its own scale, 2 bytes an
element sent) in one all-gather, and keeps the rest, rounding included, as its next feedback.

Streaming (Douillard et al., 2025, "Streaming DiLoCo"): ``sync_fragments=F`` splits the model into
F fragments of consecutive parameters, each exchanged once a period at its own point of it (so the
link carries a F-th of the model at a time), and ``sync_delay=T`` lets a fragment's allreduce run
in the background for T inner steps before its outer step is applied. The rank keeps what it
trained during those T steps: its fragment becomes the new synced weights plus its own change
since the exchange was sent. With F=1 and T=0 it is the plain sync above, bitwise.

Under ``ddpkit run --fault-tolerant`` (:meth:`PeriodicSync.meet_over`) the exchanges go to the replicas of
torchft's quorum: an exchange due after a step is made inside the next step's quorum (or one of its own
at the end of a loader's pass and after the last step), and taken back where that step does not commit.
With ``sync_delay=1`` it runs behind that step and is waited for before the step's commit.

Results depend on the world size under infrequent sync (each rank's inner steps see only its own
share of each global batch); the run says so once.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ddpkit._torch import unwrap
from ddpkit.distributed.probe import link, slowest_step
from ddpkit.errors import DdpkitError, UsageError, warn
from ddpkit.parallel import periodic_parts
from ddpkit.parallel.periodic_parts import (
    _DTYPES,
    BLOCKS,
    LEVELS,
    MEASURE_STEPS,
    PACK_BLOCK,
    PACKED,
    POSITION_BLOCK,
    _fragments,
    choose_exchange,
    chosen_outer_lr,
    pack_blocks,
    position_blocks,
    position_dtype,
    sparse_count,
    sparse_packet_bytes,
)

MEASURING = 1 << 30
"""The period while it is being chosen: no exchange before the choice."""


class PeriodicSync:
    """One model's infrequent sync: the synced weights, the outer optimizer, the period's position.

    Kept in the run's per-model communication slot (beside gradient compressors), so checkpoints
    gather its per-rank :meth:`state_dict` and hand it back with :meth:`load_state_dict`.

    Args:
        model: the model as each rank trains it (on its device, not DDP-wrapped).
        optimizer: its inner optimizer, whose per-rank state a checkpoint keeps.
        kind: ``"local-sgd"`` or ``"diloco"``.
        every: optimizer steps between syncs (None: chosen from the link and the step, :meth:`_choose`).
        outer_lr: DiLoCo's outer learning rate (None: 0.7 with ``every``; where the period is chosen, the
            ranks' average, times ``sqrt(world)`` for an adaptive inner optimizer: :func:`~ddpkit.parallel.periodic_parts.chosen_outer_lr`).
        outer_momentum: DiLoCo's outer Nesterov momentum (0: plain SGD; None: 0.9 with ``every``, 0 where it is chosen).
        sync_dtype: the exchange's dtype, ``"bf16"`` (None: the default), ``"fp32"``, ``"int8"`` or
            ``"sparse"`` (both with error feedback).
        fragments: fragments of the model, each exchanged at its own point of the period.
        delay: inner steps a fragment's exchange runs in the background before it is applied.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        *,
        kind: str,
        every: int | None,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        sync_dtype: str | None = None,
        fragments: int = 1,
        delay: int = 0,
    ) -> None:
        self.name = kind
        self.model = model
        self.optimizer = optimizer
        _refuse_outside(model, optimizer, kind)
        self.decision: dict[str, Any] | None = None
        """How the period was chosen (``sync_every`` left out): the measured link and step, the
        period, delay and fragments; None where the user gave ``sync_every`` or it is not chosen yet."""
        self.choosing = every is None
        """The period is still to be chosen: steps are timed, and nothing is exchanged until it is."""
        self._link: tuple[float, float | None] | None = None
        self._step_ends: list[float] = []
        self._windows: list[float] = []
        """Over a fault-tolerant quorum, while choosing: each step's time from its quorum to its commit
        (its forward and backward), the only time an exchange can run behind it."""
        self._window_start: float | None = None
        self.every = MEASURING if every is None else every
        self.exchange = sync_dtype or "bf16"
        """The exchange's kind by ``sync_dtype``'s name: ``"fp32"``, ``"bf16"``, ``"int8"`` or ``"sparse"``."""
        self.density: float | None = None
        """A sparse exchange's share of each fragment (None: :data:`~ddpkit.parallel.periodic_parts.SPARSE_DENSITY`;
        a period chosen from the link chooses it too)."""
        self.dtype_given = sync_dtype is not None
        """The exchange's dtype was the user's: a period chosen from the link keeps it."""
        self.steps = 0  # optimizer steps into the period
        self.total = 0  # optimizer steps in all (when a delayed exchange lands)
        self.delay = delay
        self.pending: list[dict[str, Any]] = []  # exchanges sent and not yet applied
        self.syncs = 0  # syncs made (fragments applied)
        self.sent_bytes = 0  # bytes handed to allreduce by syncs, in all
        self.sync_seconds = 0.0  # seconds spent in syncs, in all
        self.finished = False  # the final exchange was made, and no step was taken since
        self.sent_at: list[int] = []  # each fragment's ``total`` when it was last sent
        self._announce: str | None = None
        """The choice made in a quorum whose step may not commit: said once it does."""
        self.meet: Any = None
        """Whom the exchanges go to: a fault-tolerant replica's quorum (:class:`QuorumMeet`, set by
        :meth:`meet_over`), or None: torch.distributed's default group."""
        self.due: list[int] = []
        """Fragments whose exchange waits for the next step's quorum (a fault-tolerant replica only)."""
        self._before: dict[str, Any] | None = None
        """What a quorum's exchange changed, as it was before (put back when that step is not committed)."""
        self.params = [p for p in model.parameters()]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.synced = [p.detach().clone() for p in self.params]
        self.synced_buffers = [b.detach().clone() for b in self.buffers]
        self._layout(fragments)
        self.feedback: dict[int, torch.Tensor] = {}
        """int8 and sparse exchanges: by fragment, what this rank's last exchange kept back (fp32)."""
        self.outer = None
        self.outer_chosen = False
        """DiLoCo's outer learning rate is :func:`~ddpkit.parallel.periodic_parts.chosen_outer_lr`'s."""
        if kind == "diloco":
            # DiLoCo's settings (tuned at H = 500) where the user gives the period; no momentum at the short
            # periods a link chooses, where an outer Nesterov step multiplies each period's aligned progress
            # (the digits ConvNet at H = 2: 46% test accuracy with them, 98% averaged, DDP's 97.5%), and
            # the average of the ranks' changes, times sqrt(world) for adaptive inner steps (chosen_outer_lr)
            self.outer_chosen = outer_lr is None and every is None
            lr = (
                outer_lr if outer_lr is not None else 0.7 if every is not None else chosen_outer_lr(optimizer, _world())
            )
            momentum = outer_momentum if outer_momentum is not None else 0.9 if every is not None else 0.0
            self.outer = torch.optim.SGD(self.synced, lr=lr, momentum=momentum, nesterov=momentum > 0)
        model.__dict__["_ddpkit_periodic"] = self

    def _layout(self, fragments: int) -> None:
        """The fragments, and the step of the period each is sent at: fragment f at (f + 1) * every / F
        (the last one holds the buffers)."""
        self.fragments = _fragments([p.numel() for p in self.params], fragments)
        self.sent_at = [0] * len(self.fragments)
        self.offsets = [(f + 1) * self.every // len(self.fragments) for f in range(len(self.fragments))]

    # -- the period, chosen from the link --------------------------------------------------------
    def probe_link(self, device: torch.device) -> None:
        """Time the link the ranks share, at set-up (a collective: every rank calls it), for :meth:`_choose`."""
        from ddpkit.parallel.auto import PROBE_BYTES  # the link timed as grad_compression="auto" times it

        if self.choosing and _world() > 1:
            self._link = link(min(self._exchange_bytes(), PROBE_BYTES), device)

    def _members(self) -> int:
        """Ranks (or a fault-tolerant quorum's replicas) that the next exchange is summed over."""
        return self.meet.size() if self.meet is not None else _world()

    def _exchange_elements(self) -> int:
        """Elements of one whole exchange: every parameter's and floating buffer's change."""
        return sum(p.numel() for p in self.params) + sum(b.numel() for b in self.buffers)

    @property
    def dtype(self) -> torch.dtype:
        """The exchange's dtype on the wire (a sparse exchange's values are int8)."""
        return _DTYPES[self.exchange]

    def _exchange_bytes(self) -> int:
        """Bytes of one whole dense exchange, in the exchange's dtype (what the link is timed on)."""
        return self._exchange_elements() * self.dtype.itemsize

    def _time_step(self) -> None:
        """While choosing: time the inner steps; after :data:`MEASURE_STEPS` of them, choose."""
        if self.params and self.params[0].is_cuda:
            torch.cuda.synchronize(self.params[0].device)  # the step's kernels, not only their launch
        self._step_ends.append(time.perf_counter())
        if len(self._step_ends) > MEASURE_STEPS:
            self._choose()

    def _choose(self) -> None:
        """Every rank takes the same period from the slowest rank's step and the link: the shortest
        whose exchange hides behind the inner steps (:func:`~ddpkit.parallel.periodic_parts.choose_period`)."""
        slowest = slowest_step(self._step_ends)
        latency, speed = self._link or (0.0, None)
        decision = self._decision(slowest, _world(), speed, latency, periodic_parts.MAX_DELAY)
        self._adopt(decision)
        self.steps = self.every  # the steps timed were the first period: exchange now
        if not _world() > 1 or dist.get_rank() == 0:
            warn(self._notice(decision, latency, speed))

    def _decision(
        self, step_s: float, world: int, speed: float | None, latency: float, max_delay: int | None
    ) -> dict[str, Any]:
        """:func:`~ddpkit.parallel.periodic_parts.choose_exchange` for this model, with DiLoCo's outer settings."""
        decision = choose_exchange(
            step_s=step_s,
            elements=self._exchange_elements(),
            dtype=self.exchange,
            dtype_given=self.dtype_given,
            world=world,
            link_bytes_per_s=speed,
            latency_s=latency,
            max_delay=max_delay,
        )
        if self.outer is not None:
            group = self.outer.param_groups[0]
            decision.update(outer_lr=group["lr"], outer_momentum=group["momentum"])
        return decision

    def _notice(self, decision: dict[str, Any], latency: float, speed: float | None) -> str:
        """The one line that says what was chosen, and from what."""
        shown = (
            "unmeasured (one process, or a link faster than the probe sees)"
            if speed is None
            else f"{speed / 1e6:.2f} MB/s"
        )
        fragments = int(decision.get("fragments", 1))
        return (
            f"sync={self.name!r} chose sync_every={self.every}, sync_delay={self.delay}, sync_dtype="
            f"{decision['dtype']!r}"
            + (f" (the largest 1/{round(1 / decision['density'])})" if decision.get("density") else "")
            + (f", sync_fragments={fragments}" if fragments > 1 else "")
            + f": link {shown}, "
            f"latency {latency * 1e3:.2f} ms, "
            + ("forward and backward" if self.meet is not None else "inner step")
            + f" {decision['step_s'] * 1e3:.1f} ms, one exchange of "
            f"{decision['exchange_bytes'] / 1e6:.2f} MB takes {decision['exchange_s'] * 1e3:.1f} ms "
            + (
                f"and runs behind the next {self.delay} step(s)"
                if fragments == 1
                else f"in {fragments} fragments, each behind the next {self.delay} step(s)"
            )
            + (
                f", which do not hide it: a call's latency alone outlasts the {self.delay} step(s) an exchange "
                "may run behind, so the steps wait for each"
                if decision.get("waits")
                else ""
            )
            + (
                f"; outer step {decision['outer_lr']:.3g}x the ranks' average change (sqrt of "
                f"{self._choice_world()} {'replicas' if self.meet is not None else 'ranks'}' adaptive inner steps)"
                if self.outer_chosen and decision.get("outer_lr", 1.0) != 1.0
                else ""
            )
        )

    def _choice_world(self) -> int:
        """Whom the period is chosen for: the job's replicas under a fault-tolerant quorum (the most a
        quorum holds), else the processes."""
        return self.meet.replicas() if self.meet is not None else _world()

    def choice_due(self) -> bool:
        """Over a fault-tolerant quorum: the steps are timed, and the period is to be chosen inside the
        next step's quorum (keyed on the steps the replicas committed, which every replica in a quorum shares)."""
        return self.choosing and self.meet is not None and self.total > MEASURE_STEPS

    def _choose_in_quorum(self) -> None:
        """Choose the period inside this step's quorum, as :meth:`_choose` does over a process group:
        the link timed by the quorum's own sums, the slowest replica's forward and backward (from its
        quorum to its commit: what an exchange behind a step can hide behind), for the job's replicas,
        and an exchange behind one step at most (fragments where a whole one would need more). Every replica
        in the quorum takes the same choice; a replica alone in it, or with no step timed in the quorum,
        waits for the next quorum. Raises :class:`QuorumLost` where a replica died during it (the step
        is then dropped, and the choice made again in the next quorum)."""
        from ddpkit.distributed.probe import bus_bytes
        from ddpkit.parallel.auto import PROBE_BYTES

        assert self.meet is not None
        members, replicas = self.meet.size(), self.meet.replicas()
        if replicas > 1 and members < 2:
            return  # no link to time alone
        device = self.params[0].device if self.params else torch.device("cpu")
        # an exchange runs between the step's quorum and its commit: the forward and backward, not the step
        windows = self._windows[1:]  # (the first step is set-up)
        nbytes = max(4, min(self._exchange_bytes(), PROBE_BYTES)) // 4 * 4
        latency, big, nbytes = self.meet.timed_sums(nbytes, device) if members > 1 else (0.0, 0.0, nbytes)
        agreed = torch.tensor([statistics.median(windows) if windows else 0.0, latency, big], dtype=torch.float64)
        self.meet.max_(agreed)
        step_s, latency, big = agreed.tolist()
        if step_s <= 0:
            return  # every replica here healed since the steps were timed: time more
        speed = bus_bytes(nbytes, members) / (big - latency) if members > 1 and big > latency else None
        decision = self._decision(step_s, replicas, speed, latency, 1)
        self._before = self._kept()  # every collective of the choice is done: what it changes from here
        self._adopt(decision)
        self.steps = 0  # the steps timed were the first period, which ended at the last commit
        self.due = [f for f, offset in enumerate(self.offsets) if offset == self.every]
        self._announce = self._notice(decision, latency, speed) if self.meet.first() else None

    def _adopt(self, decision: dict[str, Any]) -> None:
        self.decision, self.choosing = decision, False
        self.every, self.delay = int(decision["every"]), int(decision["delay"])
        if decision.get("dtype") in _DTYPES:  # chosen with the period (a checkpoint's choice stands)
            self.exchange = decision["dtype"]
            self.density = decision.get("density")
        self._layout(int(decision["fragments"]))
        made = len(self.fragments)
        if made < int(decision["fragments"]):  # fewer tensors than fragments: each is larger, and given longer
            decision["fragments"] = made
            if self.meet is None:  # (a quorum's exchange lands after one step whatever its size)
                self.delay = decision["delay"] = min(self.every - 1, -(-self.every // made))

    # -- training --------------------------------------------------------------------------
    def after_step(self) -> None:
        """Count an optimizer step; apply the exchanges due now, send the fragments due now."""
        self.steps += 1
        self.total += 1
        self.finished = False
        self._before = None  # the step committed: what its quorum changed stands
        if self.choosing:
            if self.meet is None:  # (a quorum times its steps' windows, and chooses in exchange_due)
                self._time_step()
            if self.choosing:
                return
        for exchange in [e for e in self.pending if e["apply_at"] <= self.total]:
            self._land(exchange)
        if self._announce is not None:  # so is a choice made in it: said once
            warn(self._announce)
            self._announce = None
        for fragment, offset in enumerate(self.offsets):
            if self.steps == offset:
                if self.meet is not None:  # inside the next step's quorum, before its forward
                    self.due.append(fragment)
                else:
                    self._send(fragment, self.delay)
        if self.steps >= self.every:
            self.steps = 0

    # -- over a fault-tolerant quorum ----------------------------------------------------------
    def meet_over(self, replica: Any) -> None:
        """Exchange over a fault-tolerant replica's quorum (:class:`~ddpkit.distributed.ft.Replica`)
        rather than a process group: each exchange is made inside a step's quorum, before its forward
        (:meth:`exchange_due`), and taken back where that step is not committed (:meth:`step_dropped`)."""
        self.meet = QuorumMeet(replica)
        replica.at_pass_end.append(self.exchange_between_steps)
        if self.outer_chosen and self.outer is not None:  # sqrt of the replicas, not of this replica's one process
            self.outer.param_groups[0]["lr"] = chosen_outer_lr(self.optimizer, self.meet.replicas())

    @torch.no_grad()
    def exchange_due(self, delay: int | None = None, *, choose: bool = True) -> None:
        """The exchanges due, inside this step's quorum (a fault-tolerant replica): what they change is
        kept first, since the step may not commit (a replica died during it). ``delay`` (None: the
        sync's, 0 or 1): 1 runs the exchange behind this step's forward and backward, waited for
        before its commit (:meth:`wait_in_flight`) and applied after its optimizer step. The period,
        where it is to be chosen, is chosen first (:meth:`_choose_in_quorum`; not in a quorum of its own,
        ``choose=False``, where the exchange is the final one or one between steps)."""
        if choose and self.choice_due():
            try:
                self._choose_in_quorum()  # (what it changes is kept first, for a step that does not commit)
            except QuorumLost:  # the step will not commit: chosen in the next quorum
                return
        if self.choosing and self.meet is not None:  # an exchange behind this step would start here
            self._window_start = time.perf_counter()
        if self.due:
            if self._before is None:
                self._before = self._kept()
            try:
                for fragment in self.due:
                    self._send(fragment, self.delay if delay is None else delay)
            except QuorumLost:  # a replica died during it: the step will not commit, and is redone
                return
            self.due = []

    def wait_in_flight(self) -> None:
        """Over a fault-tolerant quorum: wait for the exchanges running behind this step, before the
        step's commit (torchft reports a failed one there, and the commit then drops the step)."""
        if self.meet is None:
            return
        if self._window_start is not None:  # choosing: how long an exchange behind this step could run
            if self.params and self.params[0].is_cuda:
                torch.cuda.synchronize(self.params[0].device)
            self._windows.append(time.perf_counter() - self._window_start)
            self._window_start = None
        for exchange in self.pending:
            if exchange["work"] is not None:
                exchange["work"].wait()
                exchange["work"] = None

    @torch.no_grad()
    def step_dropped(self) -> None:
        """The step was not committed: put back what its quorum's exchange changed; the exchange is
        made again in the next quorum (of the replicas alive then)."""
        if self._before is None:
            return
        before, self._before = self._before, None
        self._announce = None
        self.decision, self.choosing, self.every, self.delay, self.exchange, self.density, self.steps = before["choice"]
        self._layout(before["fragments"])  # (the offsets follow from the restored period; sent_at is restored below)
        _copy(self.params, before["local"])
        _copy(self.buffers, before["local_buffers"])
        _copy(self.synced, before["synced"])
        _copy(self.synced_buffers, before["synced_buffers"])
        if self.outer is not None:
            self.outer.load_state_dict(before["outer"])
        self.feedback = before["feedback"]
        self.sent_at, self.due, self.pending = before["sent_at"], before["due"], before["pending"]
        self.syncs, self.sent_bytes = before["syncs"], before["sent_bytes"]

    def _kept(self) -> dict[str, Any]:
        """Copies of what an exchange changes (for :meth:`step_dropped`)."""
        return {
            "local": [p.detach().clone() for p in self.params],
            "local_buffers": [b.detach().clone() for b in self.buffers],
            "synced": [s.detach().clone() for s in self.synced],
            "synced_buffers": [s.detach().clone() for s in self.synced_buffers],
            "outer": None if self.outer is None else copy.deepcopy(self.outer.state_dict()),
            "feedback": {f: t.clone() for f, t in self.feedback.items()},
            "sent_at": list(self.sent_at),
            "due": list(self.due),
            "pending": list(self.pending),
            "syncs": self.syncs,
            "sent_bytes": self.sent_bytes,
            "choice": (self.decision, self.choosing, self.every, self.delay, self.exchange, self.density, self.steps),
            "fragments": len(self.fragments),
        }

    @torch.no_grad()
    def sync(self) -> None:
        """Meet the other ranks now, every fragment, nothing left in the background: average (local
        SGD) or take an outer step (DiLoCo); every rank continues from it."""
        for exchange in list(self.pending):
            self._land(exchange)
        for fragment in range(len(self.fragments)):
            self._send(fragment, 0)
        self.steps = 0

    @torch.no_grad()
    def finish(self) -> None:
        """The final exchange, once the last step is taken: every rank at the replicas' common model
        (the synced weights). What is in flight lands, and each fragment trained since it was last
        sent is sent once more (a fragment sent at the last step is not: an outer step on a zero
        change would still move it by its momentum). Every rank calls it at the same point."""
        if self.finished:
            return
        if self.meet is not None:
            self._finish_in_quorum()
        for exchange in list(self.pending):
            self._land(exchange)
        for fragment in range(len(self.fragments)):
            if self.sent_at[fragment] != self.total:  # trained since it was last sent
                self._send(fragment, 0)
        # a delayed exchange sent at the last step landed as "synced plus what was trained since",
        # nothing, which is the synced weights up to rounding: take them exactly
        _copy(self.params, self.synced)
        _copy(self.buffers, self.synced_buffers)
        self.steps, self.finished = 0, True

    def exchange_between_steps(self) -> None:
        """The exchanges due, in a quorum that no step follows (the end of a loader's pass), so what
        is evaluated or saved after it holds them; made again in the next quorum until one commits."""
        assert self.meet is not None
        if self.delay == 0:  # (sent with a delay it runs behind the next step, as over a process group)
            self._exchange_in_own_quorum()

    def _exchange_in_own_quorum(self) -> None:
        assert self.meet is not None
        while self.due:
            self.meet.begin()
            self.exchange_due(0, choose=False)
            if self.meet.commit():
                self._before = None
                return
            self.step_dropped()

    def _finish_in_quorum(self) -> None:
        """A fault-tolerant replica's final exchange: every fragment trained since it was last sent, in
        a quorum (made again in the next one until every replica in it commits)."""
        self.due = [f for f in range(len(self.fragments)) if self.sent_at[f] != self.total]
        self._exchange_in_own_quorum()

    @torch.no_grad()
    def flush(self) -> None:
        """Apply every exchange still in flight now (waiting for it): after the last inner step, so the
        synced weights hold every exchange that was sent. Every rank calls it at the same step."""
        for exchange in list(self.pending):
            self._land(exchange)

    def _dense(self, with_buffers: bool) -> int:
        """Elements a sparse exchange sends whole: the BatchNorm statistics, in the fragment that has them."""
        return sum(b.numel() for b in self.buffers) if with_buffers else 0

    def _parts(self, fragment: int) -> tuple[list[int], bool]:
        """The parameter indices of ``fragment`` and whether it carries the buffers (the last one does)."""
        return self.fragments[fragment], fragment == len(self.fragments) - 1

    @torch.no_grad()
    def _send(self, fragment: int, delay: int) -> None:
        """Start ``fragment``'s exchange: each rank's change since the last sync, synced - local."""
        started = time.perf_counter()
        indices, with_buffers = self._parts(fragment)
        self.sent_at[fragment] = self.total
        # small numbers travel, so bfloat16 rounds the changes, never the weights themselves
        own = [self.synced[i] - self.params[i] for i in indices]
        if with_buffers:
            own += [s - b for s, b in zip(self.synced_buffers, self.buffers)]
        world = self._members()
        scale: float | str | None = None  # int8: the levels' unit; "sparse": every rank's packet gathered
        work: Any = None
        if self.exchange == "sparse":
            packet = self._sparsified(fragment, own, self._dense(with_buffers))
            self.sent_bytes += packet.numel()
            flat = packet
            if world > 1 and self.meet is not None:
                flat, work = self.meet.gather(packet, wait=delay == 0)
            elif world > 1:  # into views of one buffer: the pending exchange's one tensor (checkpoints keep it)
                flat = torch.empty(world * packet.numel(), dtype=torch.uint8, device=packet.device)
                work = dist.all_gather(list(flat.chunk(world)), packet, async_op=delay > 0)
            scale = PACKED
        else:
            if self.exchange == "int8":
                flat, scale = self._quantised(fragment, own, world)
            else:
                flat = (
                    torch.cat([t.reshape(-1).to(self.dtype) for t in own]) if own else torch.zeros(0, dtype=self.dtype)
                )
            self.sent_bytes += flat.numel() * flat.element_size()
            if world > 1 and self.meet is not None:
                work = self.meet.sum_(flat, wait=delay == 0)
            elif world > 1:
                work = dist.all_reduce(flat, async_op=delay > 0)
        exchange = {
            "fragment": fragment,
            "flat": flat,
            "work": work,
            "apply_at": self.total + delay,
            "own": [t for t in own] if delay > 0 else None,
            "world": world,
            "scale": scale,
        }
        self.sync_seconds += time.perf_counter() - started
        if delay > 0:
            self.pending.append(exchange)
        else:
            self._land(exchange)

    def _with_feedback(self, fragment: int, own: list[torch.Tensor]) -> torch.Tensor:
        """``own`` (this rank's change) as one flat fp32 vector, plus what the fragment's last exchange kept back."""
        device = own[0].device if own else torch.device("cpu")
        change = torch.cat([t.reshape(-1).float() for t in own]) if own else torch.zeros(0, device=device)
        kept = self.feedback.get(fragment)
        if kept is not None and kept.numel() == change.numel():
            change += kept.to(change.device)
        return change

    def _quantised(self, fragment: int, own: list[torch.Tensor], world: int) -> tuple[torch.Tensor, float]:
        """``own`` (this rank's change) plus the fragment's feedback as int8 levels of the ranks' common
        scale, and that scale (a unit of the levels); what rounding kept back is the next feedback."""
        change = self._with_feedback(fragment, own)
        device = change.device
        largest = change.abs().max().reshape(1) if change.numel() else torch.zeros(1, device=device)
        if not bool(torch.isfinite(largest).all()):  # NaN: the ranks' largest becomes inf, on every rank
            largest.fill_(math.inf)
        if world > 1 and self.meet is not None:
            self.meet.max_(largest)
        elif world > 1:
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # one scale on every rank: the sum stays exact
        if not math.isfinite(float(largest.item())):
            raise _diverged(f"sync={self.name!r} (int8)")
        levels = 127 // world
        unit = float(largest.item()) / levels if float(largest.item()) > 0 else 1.0
        quantised = torch.round(change / unit).clamp_(-levels, levels)
        self.feedback[fragment] = change - quantised * unit
        return quantised.to(torch.int8), unit

    def _sparsified(self, fragment: int, own: list[torch.Tensor], dense: int) -> torch.Tensor:
        """``own`` plus the fragment's feedback as one byte packet: a float32 scale, each block's count,
        a 16-bit word for each of the largest elements (its offset in its block, its 4-bit value of
        that scale), then the last ``dense`` elements (the BatchNorm statistics' changes, averaged
        whole at each sync) as float32. Everything of the others not sent is the next feedback."""
        change = self._with_feedback(fragment, own)
        device = change.device
        finite = bool(torch.isfinite(change).all())
        if not finite:  # sent with an infinite scale, which every rank sees where it lands
            change = torch.zeros_like(change)
        sparse = change.numel() - dense
        positions = _largest(change[:sparse], sparse_count(sparse, self.density)).sort().values
        values = change[positions]
        largest = float(values.abs().max()) if positions.numel() else 0.0
        unit = (largest / LEVELS if largest > 0 else 1.0) if finite else math.inf
        levels = torch.round(values / unit).clamp_(-LEVELS, LEVELS)
        whole = change[sparse:].clone()
        change[positions] -= levels * unit  # what rounding kept back of the sent ones stays too
        change[sparse:] = 0.0
        self.feedback[fragment] = change
        counts = torch.bincount(positions // PACK_BLOCK, minlength=pack_blocks(sparse))
        words = (positions % PACK_BLOCK) * 16 + (levels.long() + LEVELS + 1)  # 1..15 in the low 4 bits
        return torch.cat(
            [
                torch.tensor([unit], dtype=torch.float32, device=device).view(torch.uint8),
                counts.to(torch.int16).view(torch.uint8),
                (words - 32768).to(torch.int16).view(torch.uint8),
                whole.view(torch.uint8),
            ]
        )

    def _densified(self, gathered: torch.Tensor, world: int, elements: int, dense: int, layout: str) -> torch.Tensor:
        """The sum of every rank's sparse packet in ``gathered`` (of ``elements``, the last ``dense``
        of them sent whole), as a dense fp32 vector. ``layout``: :data:`PACKED`, or an earlier layout
        of an exchange in flight in a checkpoint (:data:`BLOCKS`, ``"sparse"``)."""
        total = torch.zeros(elements, dtype=torch.float32, device=gathered.device)
        sparse = elements - dense
        count = sparse_count(sparse, self.density)
        if gathered.numel() != world * sparse_packet_bytes(sparse, dense, self.density, layout):
            raise _malformed(sparse, count)
        for packet in gathered.chunk(world):
            unit = packet[:4].clone().view(torch.float32)
            if not bool(torch.isfinite(unit).all()):
                raise _diverged("a sparse exchange")
            positions, levels, ends = _entries(packet, sparse, count, layout)
            total.index_add_(0, positions, levels.float() * unit)
            total[sparse:] += packet[ends:].clone().view(torch.float32)
        return total

    @torch.no_grad()
    def _land(self, exchange: dict[str, Any]) -> None:
        """Apply a finished exchange: the outer step (or the average) on the fragment's synced weights,
        and the fragment's local weights from them (plus what the rank trained since it was sent)."""
        started = time.perf_counter()
        if exchange["work"] is not None:
            exchange["work"].wait()
            exchange["work"] = None
        self.pending = [e for e in self.pending if e is not exchange]  # by identity: dicts of tensors
        indices, with_buffers = self._parts(exchange["fragment"])
        tensors = [self.params[i] for i in indices] + (self.buffers if with_buffers else [])
        if exchange.get("scale") in (PACKED, BLOCKS, "sparse"):  # every rank's largest elements, summed
            elements = sum(t.numel() for t in tensors)
            flat = self._densified(
                exchange["flat"], exchange["world"], elements, self._dense(with_buffers), exchange["scale"]
            )
        else:
            flat = exchange["flat"].to(tensors[0].dtype if tensors else torch.float32)
        if isinstance(exchange.get("scale"), float):  # int8: levels of the ranks' common unit
            flat = flat * exchange["scale"]
        flat = flat / exchange["world"]
        moved, at = [], 0
        for t in tensors:
            moved.append(flat[at : at + t.numel()].view_as(t).to(t.dtype))
            at += t.numel()
        deltas, stats = moved[: len(indices)], moved[len(indices) :]
        synced = [self.synced[i] for i in indices]
        before = [s.clone() for s in synced] if exchange["own"] is not None else None
        if self.outer is not None:  # DiLoCo: the average change is the outer step's gradient
            for s, gradient in zip(synced, deltas):
                s.grad = gradient
            self.outer.step()  # parameters without a gradient (other fragments) are left alone
            for s in synced:
                s.grad = None
        else:  # local SGD: the weights' average, synced - average change
            for s, delta in zip(synced, deltas):
                s.sub_(delta)
        if with_buffers:
            for s, delta in zip(self.synced_buffers, stats):  # BatchNorm statistics: their average
                s.sub_(delta)
        local = [self.params[i] for i in indices]
        if exchange["own"] is None:  # applied where it was sent: every rank continues from the synced weights
            _copy(local, synced)
            if with_buffers:
                _copy(self.buffers, self.synced_buffers)
        else:  # sent ``delay`` steps ago: keep what this rank trained since
            own = exchange["own"]
            assert before is not None  # taken above whenever "own" is kept
            for p, new, old, mine in zip(local, synced, before, own):
                p.add_(new - old + mine)
            if with_buffers:
                for b, s in zip(self.buffers, self.synced_buffers):
                    b.copy_(s)
        self.syncs += 1
        self.sync_seconds += time.perf_counter() - started

    # -- the synced weights --------------------------------------------------------------------
    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The synced weights and statistics in the model for the block; the local ones after."""
        with torch.no_grad():
            local = [p.detach().clone() for p in self.params]
            local_buffers = [b.detach().clone() for b in self.buffers]
            _copy(self.params, self.synced)
            _copy(self.buffers, self.synced_buffers)
        try:
            yield
        finally:
            with torch.no_grad():
                _copy(self.params, local)
                _copy(self.buffers, local_buffers)

    def exported(self, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``saved`` (the model's state dict) with the synced weights and statistics in it."""
        names = {id(t): n for n, t in self.model.state_dict(keep_vars=True).items()}
        synced = {names[id(p)]: s for p, s in zip(self.params, self.synced) if id(p) in names}
        synced.update({names[id(b)]: s for b, s in zip(self.buffers, self.synced_buffers) if id(b) in names})
        out = type(saved)({k: synced[k].detach().cpu().clone() if k in synced else v for k, v in saved.items()})
        if hasattr(saved, "_metadata"):  # torch's state dicts carry their version metadata as an attribute
            out._metadata = saved._metadata  # type: ignore[attr-defined]  # set dynamically, as torch does
        return out

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state, plain tensors: local weights, inner optimizer, synced weights, outer optimizer."""
        for exchange in self.pending:  # a checkpoint waits for what is in flight
            if exchange["work"] is not None:
                exchange["work"].wait()
                exchange["work"] = None
        return {
            "name": self.name,
            "every": self.every,
            "decision": self.decision,
            "choosing": self.choosing,
            "finished": self.finished,
            "sent_at": list(self.sent_at),
            "steps": self.steps,
            "syncs": self.syncs,
            "sent_bytes": self.sent_bytes,
            "total": self.total,
            "fragments": len(self.fragments),
            "delay": self.delay,
            "due": list(self.due),
            "pending": [
                {
                    "fragment": e["fragment"],
                    "flat": e["flat"].detach().cpu().clone(),
                    "apply_at": e["apply_at"],
                    "world": e["world"],
                    "own": [t.detach().cpu().clone() for t in e["own"]],
                    "scale": e.get("scale"),
                }
                for e in self.pending
            ],
            "feedback": {f: t.detach().cpu().clone() for f, t in self.feedback.items()},
            "local": [p.detach().cpu().clone() for p in self.params],
            "local_buffers": [b.detach().cpu().clone() for b in self.buffers],
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "synced": [s.detach().cpu().clone() for s in self.synced],
            "synced_buffers": [s.detach().cpu().clone() for s in self.synced_buffers],
            "outer": None if self.outer is None else self.outer.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(
        self, saved: dict[str, Any], *, same_world: bool, source: str, one_replicas: bool = False
    ) -> None:
        """Resume: this rank's own state on the same world size; else the synced weights, with a warning.

        Args:
            saved: what :meth:`state_dict` returned (in a checkpoint, or from a healing replica's peer).
            same_world: written on as many processes as this run has.
            source: where it comes from, for the warnings.
            one_replicas: a fault-tolerant job's checkpoint, written by one replica and read by every one:
                its local weights and feedback are that replica's alone, so each continues from the synced weights.
        """
        if saved.get("name") != self.name:
            warn(
                f"checkpoint {source} was trained with "
                f"{'sync=' + repr(saved['name']) if saved.get('name') else 'a sync every step'} and resumes "
                f"with sync={self.name!r}: the period starts at the loaded weights"
            )
            self.synced = [p.detach().clone() for p in self.params]
            self.synced_buffers = [b.detach().clone() for b in self.buffers]
            if self.outer is not None:
                self.outer.param_groups[0]["params"] = self.synced
                self.outer.state.clear()
            return
        if len(saved["synced"]) != len(self.params):
            raise UsageError(
                f"checkpoint {source} holds the synced weights of {len(saved['synced'])} tensors; "
                f"this model has {len(self.params)}"
            )
        if self.choosing or self.decision is not None:  # the period was to be chosen: the saved choice stands
            if saved.get("decision") is not None:
                self._adopt(_checked_decision(saved["decision"], source))
            elif not saved.get("choosing"):  # saved by a run that gave sync_every: keep its layout
                self._adopt(
                    {"every": saved["every"], "delay": saved.get("delay", 0), "fragments": saved.get("fragments", 1)}
                )
        _copy(self.synced, saved["synced"])
        _copy(self.synced_buffers, saved["synced_buffers"])
        if self.outer is not None and saved.get("outer") is not None:
            self.outer.load_state_dict(saved["outer"])
        self.syncs, self.sent_bytes = int(saved["syncs"]), int(saved.get("sent_bytes", 0))
        same_layout = (int(saved.get("fragments", 1)), int(saved.get("delay", 0))) == (len(self.fragments), self.delay)
        if same_world and same_layout and not one_replicas:
            _copy(self.params, saved["local"])
            _copy(self.buffers, saved["local_buffers"])
            if self.optimizer is not None and saved.get("optimizer") is not None:
                self.optimizer.load_state_dict(saved["optimizer"])
            self.steps = int(saved["steps"])
            self.total = int(saved.get("total", 0))
            self.finished = bool(saved.get("finished", False))
            if len(saved.get("sent_at", [])) == len(self.fragments):
                self.sent_at = [int(t) for t in saved["sent_at"]]
            self.due = [int(f) for f in saved.get("due", []) if 0 <= int(f) < len(self.fragments)]
            device = self.params[0].device if self.params else torch.device("cpu")
            self.pending = [
                {
                    "fragment": int(e["fragment"]),
                    "flat": e["flat"].to(device),
                    "work": None,
                    "apply_at": int(e["apply_at"]),
                    "world": int(e["world"]),
                    "own": [t.to(device) for t in e["own"]],
                    "scale": e.get("scale"),
                }
                for e in saved.get("pending", [])
            ]
            self.feedback = {int(f): t.to(device) for f, t in saved.get("feedback", {}).items()}
            return
        if one_replicas:
            warn(
                f"checkpoint {source} was written by one replica of a fault-tolerant job, {saved['steps']} step(s) "
                "into a sync period: each replica's own weights since the last sync are not in it, so every "
                "replica continues from the synced weights, and the period starts over"
            )
            _copy(self.params, self.synced)
            _copy(self.buffers, self.synced_buffers)
            self.steps, self.pending, self.feedback, self.due = 0, [], {}, []
            return
        if same_world:
            warn(
                f"checkpoint {source} was saved with sync_fragments={saved.get('fragments', 1)}, "
                f"sync_delay={saved.get('delay', 0)}; this run streams with sync_fragments={len(self.fragments)}, "
                f"sync_delay={self.delay}: every rank continues from the synced weights, and the period starts over"
            )
            _copy(self.params, self.synced)
            _copy(self.buffers, self.synced_buffers)
            self.steps, self.pending, self.feedback = 0, [], {}
            return
        warn(
            f"checkpoint {source} was saved {saved['steps']} step(s) into a sync period on another world size: "
            "every rank continues from the synced weights, and the period starts over"
        )
        _copy(self.params, self.synced)
        _copy(self.buffers, self.synced_buffers)
        self.steps, self.pending, self.feedback = 0, [], {}


def _refuse_outside(model: torch.nn.Module, optimizer: Any, kind: str) -> None:
    """Refuse an optimizer holding parameters outside ``model`` (a learned loss weight): the sync meets
    over the model's, so each rank would train its own copy of those apart for good."""
    if optimizer is None:
        return
    mine = {id(p) for p in model.parameters()}
    outside = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in mine]
    if outside:
        raise UsageError(
            f"sync={kind!r}: the optimizer holds {len(outside)} parameter(s) outside the model (of shape "
            f"{tuple(outside[0].shape)}), which the sync never meets over, so each process would train its own; "
            "make them the model's (an attribute of one of its modules), or train with sync='every-step'"
        )


def _checked_decision(decision: Any, source: str) -> dict[str, Any]:
    """A loaded choice of the period, refused in one line where it cannot be one (a damaged or forged file)."""
    try:
        every, delay, fragments = (int(decision[k]) for k in ("every", "delay", "fragments"))
    except (KeyError, TypeError, ValueError):
        every = delay = fragments = -1
    if not (every >= 1 and 0 <= delay < every and 1 <= fragments <= every):
        raise DdpkitError(
            f"checkpoint {source} holds a sync period that no choice makes ({decision!r:.200}); it is damaged or "
            "was not written by ddpkit: resume from another checkpoint"
        )
    return decision


def _diverged(kind: str) -> DdpkitError:
    """What every rank raises where a rank's change held NaN or inf: rounded, it would be lost unseen.
    The rank that found it tells the others through the exchange itself (an infinite scale), so they
    all stop at the same point."""
    return DdpkitError(
        f"{kind}: a rank's change since the last sync holds NaN or inf (its inner steps diverged); "
        "lower the learning rate, or clip the gradients"
    )


def _largest(values: torch.Tensor, count: int) -> torch.Tensor:
    """The positions of the ``count`` largest magnitudes of ``values`` (a flat vector), in no order.

    A full ``topk`` of a few million elements takes about 90 ms of a core, as long as half an inner step
    of a small model; so the candidates are those above a threshold read off a strided sample (a tenth
    more than ``count`` on average), and ``topk`` picks among them. Fewer candidates than ``count``
    (a sample unlike the whole): the largest of all, the slow way."""
    magnitude = values.abs()
    if count == 0:
        return torch.zeros(0, dtype=torch.long, device=values.device)
    stride = max(1, magnitude.numel() // 65536)
    share = min(1.0, 1.1 * count / magnitude.numel())
    threshold = torch.quantile(magnitude[::stride], 1.0 - share)
    candidates = (magnitude >= threshold).nonzero().squeeze(1)
    if candidates.numel() < count:
        return torch.topk(magnitude, count, sorted=False).indices
    return candidates[torch.topk(magnitude[candidates], count, sorted=False).indices]


def _entries(packet: torch.Tensor, sparse: int, count: int, layout: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The ``count`` positions (of ``sparse`` elements) a packet sends, their levels (of its scale), and
    where the values sent whole start.

    A packet that does not add up (its blocks' counts, a value outside its levels, a position past the
    end: a checkpoint written by hand) is refused in one line rather than summed somewhere else."""
    if layout in (PACKED, BLOCKS):
        block, width = (PACK_BLOCK, 2) if layout == PACKED else (POSITION_BLOCK, 4)
        blocks = pack_blocks(sparse) if layout == PACKED else position_blocks(sparse)
        start = 4 + width * blocks
        counts = packet[4:start].clone().view(torch.int16 if width == 2 else torch.int32).long()
        if not bool((counts >= 0).all()) or int(counts.sum()) != count:
            raise _malformed(sparse, count)
        words = packet[start : start + 2 * count].clone().view(torch.int16).long() + 32768
        ends = start + 2 * count
        if layout == PACKED:
            offsets, levels = words >> 4, (words & 15) - (LEVELS + 1)
            if count and int(levels.min()) < -LEVELS:  # a low nibble of 0: no value this layout writes
                raise _malformed(sparse, count)
        else:  # 16-bit offsets, then int8 values
            offsets, levels = words, packet[ends : ends + count].clone().view(torch.int8).long()
            ends += count
        starts = torch.arange(blocks, device=packet.device) * block
        positions = torch.repeat_interleave(starts, counts) + offsets
    else:  # the first layout: whole positions, then int8 values
        kind = position_dtype(sparse)
        ends = 4 + kind.itemsize * count
        positions = packet[4:ends].clone().view(kind).long()
        levels = packet[ends : ends + count].clone().view(torch.int8).long()
        ends += count
    if count and not (0 <= int(positions.min()) and int(positions.max()) < sparse):
        raise _malformed(sparse, count)
    return positions, levels, ends


def _malformed(sparse: int, count: int) -> DdpkitError:
    """A sparse packet of another size than its exchange's, or whose positions do not add up."""
    return DdpkitError(
        f"a sparse exchange's packet does not add up (its {count} positions, of {sparse} elements); "
        "it was not written by this run: resume from another checkpoint"
    )


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class QuorumLost(Exception):
    """A collective of a fault-tolerant quorum failed (a replica died): its result is not to be used."""


_EXCHANGE = "the sync's exchange"  # what a fault-tolerant replica's check names (ft_calls)


class QuorumMeet:
    """A fault-tolerant replica's quorum as the ranks an exchange meets: its sums and gathers go through
    torchft's manager (:class:`~ddpkit.distributed.ft.Replica`), whose participants are the world.

    A collective that fails raises :class:`QuorumLost` (torchft leaves its tensor undefined); the step
    then does not commit, and the exchange is made again in the next quorum."""

    def __init__(self, replica: Any) -> None:
        self.replica = replica

    def size(self) -> int:
        """Replicas in this step's quorum."""
        return int(self.replica.size())

    def replicas(self) -> int:
        """Replicas the job started (the most a quorum holds)."""
        return int(self.replica.replicas)

    def first(self) -> bool:
        """This replica is ranked first in the step's quorum (it says what the quorum chose)."""
        return int(getattr(self.replica, "rank", 0)) == 0

    def timed_sums(self, nbytes: int, device: torch.device, repeats: int = 5) -> tuple[float, float, int]:
        """``(latency_s, seconds, bytes)``: a one-element sum over the quorum and one of up to ``nbytes``,
        timed as :func:`~ddpkit.distributed.probe.link` times a process group
        (:func:`~ddpkit.distributed.probe.timed_link`: on a slow link the larger sum is cut to what a
        quarter of the probe's budget sends, and repeated fewer times, at least 3)."""
        from ddpkit.distributed.probe import timed_link

        with self.replica.as_one("the link probe"):  # its calls are agreed: checked once
            return timed_link(self.sum_, self.max_, nbytes, device, repeats=repeats)

    def _check(self) -> None:
        if self.replica.failed():
            raise QuorumLost

    def sum_(self, tensor: torch.Tensor, *, wait: bool = True) -> Any:
        """Sum ``tensor`` in place over the quorum; ``wait=False``: started, the work returned (waited
        for before the step's commit, :meth:`PeriodicSync.wait_in_flight`)."""
        if not wait:
            return self.replica.all_reduce_sum_started(tensor, call=_EXCHANGE)
        self.replica.all_reduce_sum(tensor, call=_EXCHANGE)
        self._check()
        return None

    def max_(self, tensor: torch.Tensor) -> None:
        """The quorum's largest of ``tensor``, in place (a host tensor, such as the period's agreement,
        travels through the replica's device: NCCL reduces no CPU tensor)."""
        rows = self.replica.all_gather_rows(tensor.to(self.replica.device), call="a maximum over the quorum")
        self._check()
        tensor.copy_(rows.amax(0))

    def gather(self, packet: torch.Tensor, *, wait: bool = True) -> tuple[torch.Tensor, Any]:
        """Every replica's ``packet`` (bytes), one after another in quorum order, and the work to wait
        on (None: waited for already)."""
        if not wait:  # the table fills in the background
            table, work = self.replica.all_gather_rows_started(packet, call=_EXCHANGE)
            return table.view(-1), work
        rows = self.replica.all_gather_rows(packet, call=_EXCHANGE)
        self._check()
        return rows.reshape(-1), None

    def begin(self) -> None:
        """Join a quorum, unless this replica is in one already."""
        if not self.replica.in_quorum():
            self.replica.quorum()

    def commit(self) -> bool:
        """Whether every replica of the quorum finished (False: what it did is to be taken back)."""
        return bool(self.replica.should_commit())


def _copy(targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """``target.copy_(value)`` for each pair: the tensors keep their identity (optimizers hold them)."""
    for target, value in zip(targets, values):
        target.copy_(value)


def of(model: Any) -> PeriodicSync | None:
    """The :class:`PeriodicSync` of a set-up model (wrapped or compiled), or None."""
    for candidate in (model, unwrap(model)):
        found = getattr(candidate, "__dict__", {}).get("_ddpkit_periodic")
        if found is not None:
            return found
    return None


@contextlib.contextmanager
def synced_weights(model: Any) -> Iterator[None]:
    """The synced weights in ``model`` for the block where it syncs infrequently; else nothing changes."""
    found = of(model)
    if found is None:
        yield
        return
    with found.swapped_in():
        yield


def exported(model: Any, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of ``model``: its synced weights where it syncs infrequently, else ``saved``."""
    found = of(model)
    return saved if found is None else found.exported(saved)
