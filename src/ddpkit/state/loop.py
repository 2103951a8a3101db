"""Where the training loop stands, in one object: what a restart needs to continue exactly.

:class:`LoopState` owns the epoch, the optimizer-step count, the position of every loader that
feeds training (keyed by a stable name, not by the order loaders were built in), the open
gradient-accumulation group and whether this run is bitwise resumable. ``rt.save`` writes
:meth:`LoopState.state_dict` (with the RNG and scaler states) and ``rt.load`` hands it to
:meth:`LoopState.restore`; restoring does not depend on whether the script built its loaders
before or after ``load``: a loader made later picks up its saved position when it registers.

Only loaders that fed a backward are saved: a validation loader read halfway, or not at all,
never makes an end-of-epoch checkpoint look mid-epoch.

``rt.epochs`` sets the epochs (:attr:`LoopState.driven`); a loop without it (``for epoch in
range(n)``, a step-based loop) lets each loader's pass after a trained one read the next epoch, and
its checkpoints keep each training loader's epoch and position, ended or not.
"""

from __future__ import annotations

import weakref
from typing import Any

from ddpkit.errors import DdpkitError, warn


class LoopState:
    """Epoch, step, loader positions, accumulation position and resumability of one run."""

    def __init__(self) -> None:
        self.epoch = 0  # the epoch being trained (or to be trained next)
        self.step = 0  # optimizer steps taken
        self.micro_step = 0  # batches into the open accumulation group
        self.group: tuple[int, float] = (1, 1.0)  # (batches, divisor) of that group
        self.resumed_from: str | None = None
        self.resumed_step: int | None = None  # the step the loaded checkpoint was saved at
        self.resumed_mid_epoch = False  # the loaded checkpoint was saved inside its epoch
        self.resumed_epochs = True  # ... under rt.epochs (else its epochs were each loader's own)
        self.not_bitwise: str | None = None  # why a resume of this run is not bitwise
        self.driven = False  # rt.epochs sets the epochs (else each loader's passes move on by themselves)
        self.stage = 0  # which rt.epochs loop of the script the run is in (a warm-up's, then a fine-tuning's)
        self.stage_start = 0  # the epoch that loop began at: its first yields start + 0
        self.stages_called = 0  # rt.epochs loops this process began (a resumed run's first are skipped)
        self.epoch_begun = False  # the epoch was handed out and not run to its end (left by break)
        self.stage_left = False  # that loop ran to its end or was left by break: a resume skips it too
        self._loaders: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self._made: weakref.WeakSet[Any] = weakref.WeakSet()  # every live loader, whichever holds its key
        self._pending: dict[str, dict[str, Any]] = {}  # saved positions waiting for their loader
        self._last_pass: dict[str, int] = {}  # each key's epoch of its latest trained pass (a loader rebuilt goes on)
        self._strict = True

    # -- loaders --------------------------------------------------------------------------
    def register(self, loader: Any, name: str | None) -> str:
        """Give ``loader`` its key and, if a checkpoint saved a position under it, that position.

        The key is ``name`` when given, else the dataset's type name (``#2``, ``#3`` for further
        live loaders of the same type, in the order the script builds them), so the same script
        finds the same key in every attempt, whatever the order of ``rt.load`` and ``rt.loader``.
        A loader rebuilt (each epoch, say) takes the key of the one it replaces once that one's pass
        is over, and without ``rt.epochs`` its first pass reads the epoch after that one's last
        trained pass. A saved position whose length, batch size or seed differ from the loader's is
        refused.
        """
        base = name or type(loader.dataset).__name__
        key, count = base, 1
        while not self._free(key, loader, named=name is not None):  # a second live loader of the same kind
            if name is not None:
                raise DdpkitError(f"two live loaders are named {name!r}; give each its own name=")
            count += 1
            key = f"{base}#{count}"
        loader.name = key
        self._loaders[key] = loader
        self._made.add(loader)
        loader.epochs_driven = self._driven
        loader.on_trained = self._trained
        loader.set_epoch(self.epoch)
        self._go_on(key, loader)
        saved = self._pending.pop(key, None)
        if saved is None and name is None:
            # A loader rebuilt every epoch can be "#2" in one attempt and the first in another.
            kin = [k for k in self._pending if k.split("#")[0] == base]
            saved = self._pending.pop(kin[0]) if len(kin) == 1 else None
        if saved is not None:
            self._apply(loader, saved)
        return key

    def _driven(self) -> bool:
        return self.driven

    def _trained(self, loader: Any) -> None:
        """``loader`` fed a backward: it holds its key again where a loader built after its pass took it (a
        look at the training data with the same settings), so a checkpoint keeps the position that trains."""
        held = self._loaders.get(loader.name)
        if held is not loader:
            if held is not None and held.live and held._pass_trained:
                raise DdpkitError(
                    f"two loaders under the name {loader.name!r} feed training in one pass; give each its own name="
                )
            self._loaders[loader.name] = loader
        self._last_pass[loader.name] = loader.epoch

    def _free(self, key: str, loader: Any, *, named: bool) -> bool:
        """Whether ``loader`` may take ``key``: nobody holds it, or it replaces the one holding it, whose pass
        is over: under a name, whatever it reads (a curriculum's larger part); under none, when rebuilt from
        it (the same dataset, sizes, seed and flags)."""
        held = self._loaders.get(key)
        if held is None:
            return True
        over = held._passes > 0 and not held.live
        return over and (named or (held.signature() == loader.signature() and held.dataset is loader.dataset))

    def _go_on(self, key: str, loader: Any) -> None:
        """Without ``rt.epochs``, a loader whose key trained a pass reads the epoch after it next."""
        if not self.driven and key in self._last_pass:
            loader.resume_at(self._last_pass[key], 0, ended=True, trained=True)

    def set_epochs(self) -> None:
        """Set every live loader's epoch to this one (``rt.epochs``; a no-op for a loader already there),
        those whose key a loader built after them took included."""
        for made in list(self._made):
            made.set_epoch(self.epoch)

    def _apply(self, loader: Any, saved: dict[str, Any]) -> None:
        if saved["signature"] != loader.signature():
            self._complain(
                f"the checkpoint's position for loader {loader.name!r} was saved for "
                f"{_describe(saved['signature'])}, but this loader has {_describe(loader.signature())}",
                "build the loader as it was saved, or give it another name=",
            )
            return
        loader.resume_at(
            int(saved["epoch"]),
            int(saved["position"]),
            ended=bool(saved.get("ran_out", saved["finished"])),  # at its last batch, still read: resumed there
            trained=bool(saved.get("pass_trained", True)),
        )

    def check_pending(self) -> None:
        """Called when training resumes: a saved mid-epoch position nobody claimed is an error."""
        # a pass that was over when saved (a loop without rt.epochs keeps those too) need not be rebuilt
        mid = {key: rec for key, rec in self._pending.items() if not rec.get("finished")}
        self._pending = {}
        if not mid:
            return
        left = ", ".join(
            f"{key!r} ({_describe(rec['signature'])}, batch {rec['position']})" for key, rec in mid.items()
        )
        self._complain(
            f"checkpoint {self.resumed_from} continues the epoch of loader(s) {left}, but no "
            "loader with that identity was built before training went on",
            "build it before the first step, pass the name= it was saved under",
        )

    def _complain(self, problem: str, fix: str) -> None:
        if self._strict:
            raise DdpkitError(f"{problem}; {fix}, or load with strict=False to start its epoch over")
        warn(f"{problem}; its epoch starts over (strict=False)")

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data: where the loop stands and where each training loader's pass is (under ``rt.epochs``
        the passes of its epoch not yet over; without it, every training loader's, ended or not, as
        each loader's passes then move on by themselves)."""
        training = {key: made.position_record() for key, made in self._loaders.items() if made.trained}
        if not self.driven:  # each loader's passes move on by themselves: where each stands, ended or not
            return self._state(epoch_done=False, loaders=training)
        # the epoch is over when the pass that began it is: of the passes begun in this epoch that fed a
        # step, the first (zip's first loader; not a validation iterator begun later, or kept from an
        # epoch before); where none was begun so (a resumed pass), when every pass of this epoch is
        current = [rec for rec in training.values() if rec["epoch"] == self.epoch]
        begun = [rec for rec in current if rec.get("began") is not None and rec["pass_epoch"] == self.epoch]
        first = min(begun, key=lambda rec: rec["began"]) if begun else None
        epoch_done = first["finished"] if first is not None else bool(current) and all(r["finished"] for r in current)
        # the passes of this epoch that go on, those at their last batch and still read included; not a
        # loader that read nothing of it (one an earlier epoch's pass left behind: a curriculum's loader
        # built anew each epoch over another part), which any loader built for this epoch reads afresh
        mid = {
            key: rec
            for key, rec in training.items()
            if rec["epoch"] == self.epoch
            and not rec["ran_out"]
            and (rec["position"] > 0 or rec["pass_epoch"] == self.epoch)
        }
        return self._state(epoch_done=epoch_done, loaders=mid)

    def _state(self, *, epoch_done: bool, loaders: dict[str, Any]) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "epoch_done": epoch_done,
            "loaders": loaders,
            "micro_step": self.micro_step,
            "group": list(self.group),
            "not_bitwise": self.not_bitwise,
            "passes": dict(self._last_pass),
            "driven": self.driven,
            "stage": self.stage,
            "stage_start": self.stage_start,
            "stage_left": self.stage_left,
            "epoch_begun": self.epoch_begun,
        }

    def resumed_at(self) -> str:
        """Where a restored run goes on, for the line that says so: ``step 12, inside epoch 2`` (``step 12``
        where ``rt.epochs`` did not set the epochs: a step-based loop's)."""
        if not self.resumed_epochs:
            return f"step {self.step}"
        where = "inside" if self.resumed_mid_epoch else "at the start of"
        return f"step {self.step}, {where} epoch {self.epoch}"

    def restore(self, saved: dict[str, Any], *, source: str, strict: bool = True) -> None:
        """Continue from ``saved``: the next epoch if it ended, else mid-epoch where it stood."""
        self.resumed_from, self._strict = source, strict
        self.step = self.resumed_step = int(saved["step"])
        self.epoch = int(saved["epoch"]) + (1 if saved["epoch_done"] else 0)
        self.resumed_mid_epoch = not saved["epoch_done"]
        self.resumed_epochs = bool(saved.get("driven", True))
        self.stage, self.stage_start = int(saved.get("stage", 0)), int(saved.get("stage_start", 0))
        self.stage_left = bool(saved.get("stage_left", False))
        # an epoch a break left: the next loop begins after it (an epoch over is counted in self.epoch)
        self.epoch_begun = bool(saved.get("epoch_begun", False)) and not saved["epoch_done"]
        self.micro_step = int(saved.get("micro_step", 0))
        self.group = (int(saved["group"][0]), float(saved["group"][1])) if saved.get("group") else (1, 1.0)
        self._pending = {} if saved["epoch_done"] else {k: dict(v) for k, v in saved["loaders"].items()}
        self._last_pass = {str(k): int(v) for k, v in saved.get("passes", {}).items()}
        for key, made in list(self._loaders.items()):
            made.set_epoch(self.epoch)
            self._go_on(key, made)
            if key in self._pending:
                self._apply(made, self._pending.pop(key))
        if saved.get("not_bitwise"):
            warn(f"checkpoint {source} resumes, but not bitwise: {saved['not_bitwise']}")


def _describe(sig: dict[str, Any]) -> str:
    if sig.get("stream") and sig.get("length") is None:
        text = f"a {sig['stream']} stream in global batches of {sig['global_batch_size']}"
    else:
        text = f"{sig['length']} samples in global batches of {sig['global_batch_size']}"
    flags = [f"seed {sig['seed']}"] + [flag for flag in ("shuffle", "drop_last", "weighted") if sig.get(flag)]
    flags += [f"lengths= {str(sig['by_length'])[:8]}"] if sig.get("by_length") else []  # (any type: a crafted file)
    return f"{text} ({', '.join(flags)})"
