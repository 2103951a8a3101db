"""Functions run in CUDA child processes by tests/test_gpu.py (module level so spawned children import them).

They return plain lists, not tensors: nothing of a GPU run has to cross processes as shared memory.
"""

from __future__ import annotations

import torch

import ddpkit
import ddpkit._torch
from workers import _toy_data


def gpu_ddp_steps(steps: int = 4) -> dict:
    """A few DDP steps on this rank's GPU: backend, device, where batches arrive, losses, weights."""
    import os

    import torch.distributed as dist
    import torch.nn.functional as F

    rt = ddpkit.init(seed=0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 10),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    losses, batch_devices = [], set()
    for images, labels, _ in rt.loader(_toy_data(64), global_batch_size=16, shuffle=True):
        batch_devices.update({str(images.device), str(labels.device)})
        loss = F.cross_entropy(model(images), labels)
        rt.backward(loss)
        rt.step(optimizer)
        losses.append(loss.item())
        if rt.global_step == steps:
            break
    # Parameters only: BatchNorm's running statistics are each rank's own after the last forward.
    weights = {k: v.detach().cpu().tolist() for k, v in ddpkit._torch.unwrap(model).named_parameters()}
    return {
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "device": str(rt.device),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "rank_sum": int(rt.all_reduce(rt.rank)),
        "batch_devices": sorted(batch_devices),
        "losses": losses,
        "weights": weights,
        "param_devices": sorted({str(p.device) for p in model.parameters()}),
        "returned_on_gpu": {"first": next(model.parameters()), "loss": loss.detach()},  # comes back on the host
    }


def gpu_sync_bn_stats() -> dict:
    """One training-mode forward of a sync-BN model on rank-dependent data: the running mean."""
    rt = ddpkit.init(seed=0)
    model = rt.setup(torch.nn.Sequential(torch.nn.BatchNorm1d(3)), sync_batchnorm=True)
    generator = torch.Generator().manual_seed(100 + rt.rank)
    data = torch.randn(4 + 2 * rt.rank, 3, generator=generator) + 10.0 * rt.rank  # uneven, shifted
    model(data.to(rt.device)).sum().backward()
    bn = ddpkit._torch.unwrap(model)[0]
    return {
        "data": data.tolist(),
        "running_mean": bn.running_mean.detach().cpu().tolist(),
        "type": f"{type(bn).__module__}.{type(bn).__name__}",
    }


def gpu_fsdp_steps(checkpoint_dir: str, precision: str, cpu_offload: bool) -> dict:
    """fsdp on nccl: a few steps (fp16: through the sharded scaler), where the shards live, a DCP
    save and a load into a fresh model that must give back the same weights."""
    import torch.nn.functional as F

    rt = ddpkit.init(seed=0, precision=precision)

    def build():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        return rt.setup(
            net,
            torch.optim.AdamW(net.parameters(), lr=1e-3),
            strategy="fsdp",
            fsdp_units=[torch.nn.Linear],
            cpu_offload=cpu_offload,
        )

    model, opt = build()
    losses, stepped = [], []
    for x, y, _ in rt.loader(_toy_data(64), global_batch_size=16, shuffle=True):
        with rt.autocast():
            loss = F.cross_entropy(model(x.flatten(1)), y)
        rt.backward(loss)
        stepped.append(rt.step(opt))
        losses.append(loss.item())
    g = torch.Generator().manual_seed(1)  # the same held-out set on every rank
    held_out = torch.utils.data.TensorDataset(
        torch.randn(30, 64, generator=g), torch.randint(0, 10, (30,), generator=g)
    )
    evaluated = ddpkit.evaluate(model, held_out, num_classes=10, batch_size=8)  # offloaded: inputs on the host
    shard_devices = sorted({str(p.to_local().device) for p in model.parameters()})
    state_devices = sorted(
        {
            str(v.to_local().device if hasattr(v, "to_local") else v.device)
            for s in opt.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.dim()
        }
    )
    saved = rt.save(checkpoint_dir, {"model": model, "opt": opt})
    weights = rt.full_state_dict(model)
    fresh, fresh_opt = build()
    rt.load(saved, {"model": fresh, "opt": fresh_opt})
    again = rt.full_state_dict(fresh)
    same = weights is None or all(torch.equal(weights[k], again[k]) for k in weights)
    return {
        "losses": losses,
        "stepped": stepped,
        "shard_devices": shard_devices,
        "state_devices": state_devices,
        "same_after_load": same,
        "evaluated": evaluated["count"],
        "scaler": type(rt.precision.scaler).__name__ if rt.precision.scaler else None,
    }


def gpu_micro_shards(steps: int = 6) -> dict:
    """``micro_shards=2`` on CUDA GPU 0, over gloo (so two processes can share one GPU): a conv net
    with BatchNorm and dropout on fixed random data; returns rank 0's final state on the CPU and
    whether torch's deterministic algorithms were on during the run."""
    import torch
    import torch.nn.functional as F

    rt = ddpkit.init(seed=5, backend="gloo", device="cuda:0")
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(96, 3, 16, 16, generator=g), torch.randint(0, 10, (96,), generator=g)
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * 16 * 16, 10),
    )
    torch.backends.cudnn.benchmark = True  # the script's own setting: back after close
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), micro_shards=2)
    deterministic = torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
    for x, y in rt.loader(data, global_batch_size=32):
        for xs, ys in rt.shards(x, y):
            rt.backward(F.cross_entropy(model(xs), ys))
        rt.step(optimizer)
        if rt.global_step == steps:
            break
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    out = {"state": state, "deterministic": deterministic, "device": str(next(model.parameters()).device)}
    rt.close()
    out["deterministic_after_close"] = torch.are_deterministic_algorithms_enabled()
    out["cudnn_after_close"] = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    return out


def fsdp_offload_setup_peak() -> tuple[int, int]:
    """The GPU memory that fsdp's set-up with cpu_offload peaks at, above where it began, and one unit's bytes."""
    rt = ddpkit.init(seed=0)
    net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # 8 units of 4 MiB
    unit = sum(p.numel() * p.element_size() for p in net[0].parameters())
    torch.cuda.reset_peak_memory_stats(rt.device)
    before = torch.cuda.memory_allocated(rt.device)
    rt.setup(
        net,
        torch.optim.SGD(net.parameters(), lr=0.1),
        strategy="fsdp",
        fsdp_units=[torch.nn.Linear],
        cpu_offload=True,
    )
    return torch.cuda.max_memory_allocated(rt.device) - before, unit
