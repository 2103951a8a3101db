"""Functions run by ddpkit.launch (or in-process for a world of one) in tests/test_fsdp.py."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

import ddpkit

GLOBAL_BATCH = 12


class Toy(Dataset):
    def __init__(self, length: int, offset: int = 0):
        self.length, self.offset = length, offset

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(index + self.offset)
        x = torch.randn(8, generator=g)
        return x, int(x.sum() > 0) + int(x[0] > 0.5)


class Net(torch.nn.Module):
    def __init__(self, checkpointed: bool = False):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU()
        )
        self.head = torch.nn.Linear(32, 3)
        self.checkpointed = checkpointed  # the body's activations recomputed in the backward

    def forward(self, x):
        if self.checkpointed:
            return self.head(torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False))
        return self.head(self.body(x))


def _train(
    rt,
    strategy: str,
    name: str,
    *,
    optimizer_first: bool = True,
    accumulate: int = 1,
    clip: float | None = None,
    epochs: int = 2,
    cpu_offload: bool = False,
    checkpointed: str | None = None,
) -> dict:
    torch.manual_seed(0)
    net = Net(checkpointed == "function")
    if checkpointed == "wrapper":  # torchtitan's way: each layer wrapped before it is sharded
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(net, check_fn=lambda module: isinstance(module, torch.nn.Linear))
    kwargs = {"strategy": strategy}
    if strategy == "fsdp":
        kwargs.update(fsdp_units=[torch.nn.Linear], cpu_offload=cpu_offload)
    if optimizer_first:
        model, opt = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2), **kwargs)
    else:
        model = rt.setup(net, **kwargs)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = rt.loader(Toy(100), global_batch_size=GLOBAL_BATCH, shuffle=True, name=name)
    norms = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            with rt.accumulate(model, accumulate) if accumulate > 1 else _nothing():
                with rt.autocast():
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                rt.backward(loss)
                if clip is not None:
                    norm = rt.clip_grad_norm_(model, clip)
                    if norm is not None:
                        norms.append(float(norm))
                rt.step(opt)
    test = Toy(101, offset=10_000)  # 101 samples in batches of 10: uneven shards per rank
    metrics = ddpkit.evaluate(model, test, num_classes=3, batch_size=10)
    predicted = ddpkit.predict(model, test, batch_size=10, to="all")
    weights = rt.full_state_dict(model)
    return {"weights": weights, "metrics": metrics, "predicted": predicted, "norms": norms}


class _nothing:
    def __enter__(self):
        return True

    def __exit__(self, *exc):
        return False


def compare(
    variants: tuple[str, ...] = (
        "ddp",
        "fsdp",
        "fsdp-after",
        "ddp-acc",
        "fsdp-acc",
        "fsdp-offload-acc",
        "fsdp-checkpointed-function",
        "fsdp-checkpointed-wrapper",
    ),
) -> dict:
    """Several trainings in one world: DDP and FSDP, optimizer before/after, accumulate + clip, offload,
    activation checkpointing (``torch.utils.checkpoint`` in the forward, or each layer wrapped)."""
    rt = ddpkit.init(seed=0)
    out = {}
    for variant in variants:
        strategy = variant.split("-")[0]
        options = {}
        if variant.endswith("-after"):
            options["optimizer_first"] = False
        if "-offload" in variant:
            options["cpu_offload"] = True
        if variant.endswith("-acc"):
            options.update(accumulate=2, clip=0.5)
        if "-checkpointed" in variant:
            options["checkpointed"] = variant.rsplit("-", 1)[1]
        out[variant] = _train(rt, strategy, variant, **options)
    return out


def scaled(strategy: str) -> dict:
    """fp16 with loss scaling, accumulate and clip; under fsdp, then an inf in one rank's shard only."""
    rt = ddpkit.init(seed=0, precision="fp16")
    out = _train(rt, strategy, "fp16", accumulate=2, clip=0.5)
    out["scale"] = rt.precision.scaler.get_scale()
    if strategy == "fsdp":
        torch.manual_seed(0)
        net = Net()
        model, opt = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy="fsdp")
        x = torch.randn(4, 8)
        with rt.autocast():
            loss = model(x).float().pow(2).mean()
        rt.backward(loss)
        if rt.rank == rt.world_size - 1:  # a shard the other ranks do not hold
            shard = next(p.grad.to_local() for p in model.parameters() if p.grad.to_local().numel())
            shard.view(-1)[0] = float("inf")
        before = rt.full_state_dict(model)
        out["inf_stepped"] = rt.step(opt)
        after = rt.full_state_dict(model)  # a collective: every rank calls it
        out["inf_unchanged"] = before is None or all(torch.equal(before[k], after[k]) for k in before)
    return out


def refusals() -> dict:
    """What strategy='fsdp' refuses, in one line each (a world of one, in this process)."""
    import ddpkit.errors

    rt = ddpkit.current() or ddpkit.init(seed=0)
    said = {}
    cases = {
        "strategy": lambda: rt.setup(Net(), strategy="zero"),
        "compression": lambda: rt.setup(Net(), strategy="fsdp", grad_compression="fp16"),
        "batchnorm": lambda: rt.setup(
            torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4)), strategy="fsdp"
        ),
        "ddp-option": lambda: rt.setup(Net(), strategy="fsdp", find_unused_parameters=True),
        "offload": lambda: rt.setup(Net(), cpu_offload=True),
        "units": lambda: rt.setup(Net(), strategy="fsdp", fsdp_units=[torch.nn.Conv2d]),
    }
    for name, call in cases.items():
        try:
            call()
        except ddpkit.errors.UsageError as exc:
            said[name] = str(exc)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net(torch.randn(2, 8)).sum().backward()
    opt.step()
    try:
        rt.setup(net, opt, strategy="fsdp")
    except ddpkit.errors.UsageError as exc:
        said["stepped-optimizer"] = str(exc)
    model = rt.setup(Net(), strategy="fsdp")
    try:
        rt.save("/nonexistent/ckpt.pt", {"model": model})
    except ddpkit.errors.UsageError as exc:
        said["save"] = str(exc)
    return said


def resumable(mode: str, checkpoint_dir: str, strategy: str = "fsdp", stop_at: int = 17, epochs: int = 3) -> dict:
    """AdamW + a scheduler, global batch 12: ``full``, ``stop`` (save after ``stop_at``), ``resume``."""
    rt = ddpkit.init(seed=0)
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model, opt = rt.setup(net, opt, strategy=strategy)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    state = {"model": model, "opt": opt, "sched": sched}
    if mode == "resume":
        rt.load(checkpoint_dir, state)
    loader = rt.loader(Toy(100), global_batch_size=GLOBAL_BATCH, shuffle=True)
    for _ in rt.epochs(epochs):
        for x, y in loader:
            rt.backward(torch.nn.functional.cross_entropy(model(x), y))
            if rt.step(opt):
                sched.step()
            if mode == "stop" and rt.global_step == stop_at:
                saved = rt.save(checkpoint_dir, state)
                return {"stopped": rt.global_step, "path": str(saved)}
    return {"weights": rt.full_state_dict(model), "steps": rt.global_step, "lr": sched.get_last_lr()}


def second_optimizer(strategy: str, how: str = "rt.step", saves: str | None = None, stop_at: int | None = None) -> dict:
    """Two optimizers built before ``rt.setup`` on parts of one model: the head's given to it, the
    body's not (a discriminative fine-tune's). ``how`` the body's steps: ``"rt.step"`` (``rt.step(head,
    body)``), ``"own"`` (``body.step()`` by hand after ``rt.step(head)``), ``"given"`` (given to
    ``rt.setup`` too) or ``"stepped"`` (it stepped once before ``rt.setup``: the refusal's text). ``saves``:
    a checkpoint there after step ``stop_at``, where it stops; without ``stop_at``, resumed from it. The
    full weights (rank 0) and the initial ones."""
    import ddpkit.errors

    rt = ddpkit.init(seed=0)
    torch.manual_seed(0)
    net = Net().double()
    first = {k: v.detach().clone() for k, v in net.state_dict().items()}
    head = torch.optim.SGD(net.head.parameters(), lr=0.1)
    body = torch.optim.SGD(net.body.parameters(), lr=0.1, momentum=0.9)
    if how == "stepped":
        net(torch.randn(2, 8, dtype=torch.float64)).sum().backward()
        body.step()
    options = {"strategy": strategy} if strategy != "ddp" else {}
    try:
        if how == "given":
            model, head, body = rt.setup(net, head, body, **options)
        else:
            model, head = rt.setup(net, head, **options)
        state = {"model": model, "head": head, "body": body}
        if saves is not None and stop_at is None:
            rt.load(saves, state)  # before the body's first step, which rebinds it
        for x, y in rt.loader(Toy(48), global_batch_size=GLOBAL_BATCH):
            rt.backward(torch.nn.functional.cross_entropy(model(x.double()), y))
            if how == "own":
                rt.step(head)
                body.step()
                body.zero_grad()
            else:
                rt.step(head, body)
            if saves is not None and rt.global_step == stop_at:
                rt.save(saves, state)
                rt.close()
                return {"stopped": stop_at}
    except ddpkit.errors.UsageError as refused:
        rt.close()
        return {"refused": str(refused)}
    weights = rt.full_state_dict(model)
    rt.close()
    return {"weights": weights, "first": first}
