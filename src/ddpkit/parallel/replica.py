"""A replica of ``ddpkit run --fault-tolerant`` as a mode: how its processes meet, step by step.

Each replica is a one-process group; the replicas of a step are torchft's quorum
(:class:`~ddpkit.distributed.ft.Replica`). :class:`FaultTolerant` is what the step, the save and
the set-up see of it: BatchNorm over the quorum, gradients averaged over it and a step applied
only where every participant finished it (otherwise what the forward changed is put back and the
batch comes again), the replica ranked first in the quorum saving, and the calls it cannot run
refused in one line. ``grad_compression="bf16"`` or ``"fp16"`` casts what the replica sends to the
quorum (divided by the quorum's size first, as the DDP hook does); PowerSGD, whose error feedback is
each replica's own, is refused. A model that trains apart (``sync="diloco"``/``"local-sgd"``) keeps its gradients and BatchNorm
to itself, and its sync exchanges over the quorum
(:meth:`ddpkit.parallel.periodic.PeriodicSync.meet_over`); without ``sync_every`` the period is chosen
inside a quorum, from the link its sums take and the slowest replica's step, behind one step at most.
"""

from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping, Sequence
from typing import Any

import torch

from ddpkit import rng
from ddpkit.errors import UsageError
from ddpkit.parallel.modes import Mode, refuse_sparse
from ddpkit.parallel.sync_batchnorm import convert_over


class FaultTolerant(Mode):
    """This process's part in a fault-tolerant job (see the module's text)."""

    name = "fault-tolerant"

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        """torchft's manager and what ddpkit asks of it (:class:`~ddpkit.distributed.ft.Replica`)."""
        self.quorum = manager
        self.state: MutableMapping[str, Any] | None = None
        """The mapping given to ``rt.resume`` or a save: what a healing peer gets (None: the set-up
        models and optimizers)."""
        self.waiting_resume: tuple[Any, bool] | None = None
        """``rt.resume``'s (state, strict), done at the first quorum unless a peer's state heals this replica."""
        self._undo: tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[str, Any]] | None = None
        self.micro_shards = False
        """The model trains with ``micro_shards``: its tree sums the gradients over the quorum, not :meth:`commit`."""
        self.models = 0
        """Models set up under this replica (their gradients share one cast)."""
        self.apart: set[int] = set()
        """The parameters of models that train apart (``sync="diloco"``/``"local-sgd"``), by ``id``:
        their gradients stay the replica's own, and their sync meets over the quorum."""
        self.cast: torch.dtype | None = None
        """``grad_compression="bf16"``/``"fp16"``: the dtype the averaged gradients travel in (None: their own)."""
        self.averaged_models = 0
        """Models set up under this replica whose gradients :meth:`commit` averages (not trained apart)."""
        self.early: set[int] = set()
        """Parameters (by ``id``) whose gradients :meth:`complete` averaged before ``rt.step`` this step
        (``rt.clip_grad_norm_``, ``rt.unscale_gradients``): the commit does not average them again."""

    @property
    def replica(self) -> int:
        """Which replica this is, 0 to :attr:`replicas` - 1 (kept across its restarts)."""
        return int(self.manager.index)

    @property
    def replicas(self) -> int:
        """Replicas the job started."""
        return int(self.manager.replicas)

    def prepare(self, model: torch.nn.Module, options: Any) -> torch.nn.Module:
        """BatchNorm over the step's quorum, so no statistic depends on how many replicas are alive."""
        if options.strategy != "ddp":
            raise UsageError(
                f"--fault-tolerant does not take rt.setup(strategy={options.strategy!r}) yet; "
                "leave strategy at its default ('ddp')"
            )
        refuse_sparse(model, options, None, fault_tolerant=True)
        apart = options.sync != "every-step"
        if apart and options.sync_delay > 1:
            raise UsageError(
                f"--fault-tolerant: rt.setup(sync={options.sync!r}) takes sync_delay=0 or 1 (an exchange runs "
                "inside one step's quorum, behind that step at most, and cannot run on into the next)"
            )
        if options.grad_compression in ("powersgd", "auto"):
            raise UsageError(
                f"--fault-tolerant does not take rt.setup(grad_compression={options.grad_compression!r}) yet "
                "(PowerSGD's error feedback is each replica's own, and a healed replica has none); "
                "use 'bf16' or 'fp16', or leave it out"
            )
        cast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(options.grad_compression or "")
        if self.models and cast != self.cast:  # one commit averages every model's gradients
            raise UsageError(
                f"--fault-tolerant: rt.setup(grad_compression={options.grad_compression!r}) differs from the "
                "first model's; one step averages every model's gradients together, so give each the same"
            )
        self.cast, self.models = cast, self.models + 1
        if apart:  # trains apart: BatchNorm is the replica's own, its statistics averaged at each sync
            self.apart.update(id(p) for p in model.parameters())
            return model
        self.averaged_models += 1
        return convert_over(model, self.manager)

    def takes(self, mode: Mode) -> None:
        """An infrequent sync (DiLoCo, local SGD) exchanges over this replica's quorum."""
        mode.meet_over(self.manager)

    def left_to_wrap(self, options: Any) -> Any:
        """The replica casts the gradients it averages itself (:meth:`_average`): no DDP hook to register."""
        return dataclasses.replace(options, grad_compression=None)

    def take_micro_shards(self) -> None:
        """Each replica reads the step's whole global batch and computes the micro-shards the quorum
        gives it (a dead replica's too); their fixed tree, not an average, makes the gradients."""
        self.micro_shards = True
        self.manager.whole_batches = True

    def refuse(self, call: str) -> None:
        """``rt.accumulate``, and the script's own collectives over ranks (a replica's quorum changes):
        an all-reduce is taken inside a step, over its quorum (:meth:`reduces_over`)."""
        if call == "optimizer.step()":
            raise UsageError(
                "optimizer.step() under --fault-tolerant: a step applies only once the replicas' quorum commits "
                "it, which rt.step asks; call rt.step(optimizer) instead of optimizer.step()"
            )
        if call == "rt.accumulate":
            raise UsageError(
                "rt.accumulate under --fault-tolerant is not built yet (a quorum forms each "
                "batch); raise global_batch_size instead"
            )
        if call == "rt.backward(count=...)":
            raise UsageError(
                "rt.backward(count=...) under --fault-tolerant is not built yet (the step's units would be summed "
                "over its quorum); pass the loss alone, or train without --fault-tolerant"
            )
        name = call.rpartition(".")[2]
        if name == "all_reduce" and not self.manager.in_quorum():
            raise UsageError(
                f"{call} under --fault-tolerant reduces over a step's quorum: call it between a batch of "
                "rt.loader and rt.step (here it would reduce over this replica alone, as the replicas change "
                "from step to step); evaluate with ddpkit.evaluate, which counts every sample in each replica"
            )
        if name in ("all_gather", "all_gather_object", "broadcast_object"):
            raise UsageError(
                f"{call} under --fault-tolerant would gather this replica alone (the replicas change "
                "from step to step); sum over a step's quorum with rt.all_reduce between a batch of "
                "rt.loader and rt.step, or evaluate with ddpkit.evaluate, which counts every sample in each replica"
            )

    def reduces_over(self) -> Any:
        """Inside a step (from its batch to ``rt.step``), the step's quorum: ``rt.all_reduce`` sums what
        each replica holds of the step's global batch, as ranks do. Outside one, None (refused)."""
        return self.manager if self.manager.in_quorum() else None

    def on_batch(self, models: Sequence[torch.nn.Module], loader: Any) -> None:
        """The step may not commit: keep what its forward changes besides the gradients (BatchNorm's
        running statistics, torch's random state), to put it back."""
        self._undo = ([(b, b.detach().clone()) for model in models for b in model.buffers()], rng.torch_state())

    def finishes_at_step(self) -> str | None:
        """The gradients' average over the step's quorum, until :meth:`complete` made it (micro-shards: their tree did)."""
        if self.micro_shards or not self.averaged_models or self.early:
            return None
        return "the average over the step's replicas (--fault-tolerant)"

    def complete(self, params: Sequence[torch.Tensor], *, stepping: bool = False) -> None:
        """The gradients averaged over the step's quorum now, for the script to clip or read before
        ``rt.step`` (``rt.clip_grad_norm_``, ``rt.unscale_gradients``): each replica's own would be
        clipped otherwise, not their average. ``rt.step``'s own (``stepping``) is left to :meth:`commit`,
        right before its question."""
        if stepping or self.micro_shards:
            return
        rest = [p for p in params if id(p) not in self.apart and id(p) not in self.early]
        if rest:
            if not self.manager.in_quorum():
                raise UsageError(
                    "the gradients of a fault-tolerant replica are averaged over a step's quorum: clip them "
                    "between a batch of rt.loader and rt.step"
                )
            self._average(rest)
            self.early.update(id(p) for p in rest)

    def commit(self, params: Sequence[torch.Tensor], active: Any) -> bool:
        """Average the gradients over the quorum's replicas, then ask whether every one finished.

        False (a replica died during the step): nothing is applied, the gradients are dropped, what
        the forward changed is put back and the loader hands out the same global batch again, split
        over the next quorum."""
        if not self.manager.in_quorum():
            raise UsageError(
                "rt.step under --fault-tolerant needs the step's batch from rt.loader, where each step's "
                "quorum of replicas forms (without it every replica would train alone); load the data "
                "with rt.loader(dataset, global_batch_size=...)"
            )
        averaged = False
        if not self.micro_shards:  # (micro-shards: their tree summed them over the quorum already)
            averaged = self._average([p for p in params if id(p) not in self.apart and id(p) not in self.early])
        self.early = set()
        # right after the average's check, no other call can come between: the commit needs none
        # (averaged before rt.step, by rt.clip_grad_norm_: the script's calls since, so it is checked)
        if self.manager.should_commit(checked=averaged):
            return True
        for p in params:
            p.grad = None
        if self._undo is not None:
            buffers, rng_state = self._undo
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
            rng.set_torch_state(rng_state)  # (the CUDA device's too: dropout on a GPU draws there)
        if active is not None:
            active.step_back()
        return False

    def exchanges_every_stepped(self) -> bool:
        """The commit averages every stepped parameter's gradient over the quorum (micro-shards' tree: its own)."""
        return not self.micro_shards

    def _average(self, params: Sequence[torch.Tensor]) -> bool:
        """The gradients averaged over the quorum, one flat allreduce a dtype (in :attr:`cast` where set:
        divided by the quorum's size, summed in 16 bits, cast back); whether there were any."""
        for dtype in sorted({p.dtype for p in params}, key=str):
            same = [p for p in params if p.dtype == dtype]
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in same])
            if self.cast is not None and dtype.is_floating_point and dtype.itemsize > self.cast.itemsize:
                sent = flat.div(self.manager.size()).to(self.cast)  # divide first: fp16 overflows later
                self.manager.all_reduce_sum(sent, call="the gradient average")
                flat = sent.to(dtype)
            else:
                self.manager.average(flat, call="the gradient average")
            offset = 0
            for p in same:
                p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        return bool(params)

    def is_main(self, rank: int) -> bool:
        """The replica ranked first in the latest step's quorum: exactly one live replica logs and saves."""
        return bool(self.manager.rank == 0)

    def writes(self, state: Any) -> bool:
        """Remember ``state`` for a healing peer; one replica writes (they all hold the same state)."""
        self.state = state
        return self.is_main(0)

    def after_backward(self) -> None:
        """The step's gradients wait for its commit: a batch before it would form another quorum (refused)."""
        self.manager.note_backward()

    def begin_epochs(self) -> None:
        """Join the first quorum before ``rt.epochs`` yields (healing from a peer ahead, or resuming the
        checkpoint ``rt.resume`` deferred): a replica restarted mid-job trains the epoch the loop names."""
        self.manager.join_first()

    def defer_resume(self, state: Any, strict: bool) -> bool:
        """Resume at the first quorum: from a live peer that is ahead, else from the checkpoint."""
        self.state, self.waiting_resume = state, (state, strict)
        return True

    def close(self, *, finished: bool) -> None:
        """Tell the quorum this replica is done (when it finished) and shut its manager down."""
        if finished and not self.manager.in_quorum():
            self.manager.finished()  # a replica still behind has nothing left to do
        self.manager.shutdown()


__all__ = ["FaultTolerant"]
