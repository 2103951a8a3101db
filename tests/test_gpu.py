"""CUDA and NCCL: placement, DDP on nccl, autocast, DataParallel, sync BN, pinned loading, bench memory.

`make test-gpu` runs these (marker ``gpu``); without CUDA each skips and says why. With one GPU
the nccl tests run a group of one; tests that need two GPUs skip with that reason on one.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn.functional as F

import ddpkit
import gpu_workers
import workers
from helpers import ddpkit as ddpkit_cli

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU: torch.cuda.is_available() is False here"),
]
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs, {GPUS} visible")


@pytest.mark.timeout(300)
def test_ddp_on_nccl_trains_on_each_ranks_own_gpu():
    """Two processes on two GPUs when there are two, else an nccl group of one."""
    nprocs = min(2, GPUS)
    runs = ddpkit.launch(gpu_workers.gpu_ddp_steps, nprocs=nprocs)
    for _rank, run in runs.items():
        own = f"cuda:{run['local_rank']}"
        assert run["backend"] == "nccl" and run["device"] == own, run
        assert run["param_devices"] == [own] and run["batch_devices"] == [own], run
        assert len(run["losses"]) == 4 and all(torch.isfinite(torch.tensor(run["losses"]))), run["losses"]
        assert run["rank_sum"] == sum(range(nprocs))
        returned = run["returned_on_gpu"]
        assert returned["first"].device.type == "cpu" and isinstance(returned["first"], torch.nn.Parameter)
        assert returned["loss"].device.type == "cpu" and returned["loss"].item() == run["losses"][-1]
    for name, value in runs[0]["weights"].items():  # DDP keeps the replicas identical
        assert all(runs[r]["weights"][name] == value for r in runs), name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_training_steps_on_cuda(precision, dtype, tmp_path):
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16 support")
    rt = ddpkit.init(seed=0, precision=precision)
    assert rt.device.type == "cuda"
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    x = torch.randn(16, 32, device=rt.device)
    y = torch.randint(0, 10, (16,), device=rt.device)
    start = [p.detach().clone() for p in model.parameters()]
    stepped = []
    for _ in range(6):
        with rt.autocast():
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        assert logits.dtype == dtype and torch.isfinite(loss), (logits.dtype, loss)
        rt.backward(loss)
        stepped.append(rt.step(optimizer))
    assert any(stepped), stepped
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), start))
    if precision == "fp16":
        # The GradScaler skips an overflowing step instead of writing inf into the weights.
        kept = [p.detach().clone() for p in model.parameters()]
        with rt.autocast():
            loss = F.cross_entropy(model(x), y) * 1e38
        rt.backward(loss)
        assert rt.step(optimizer) is False
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), kept))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision, cpu_offload", [("fp16", False), ("bf16", False), ("fp16", True)])
def test_fsdp_on_nccl_shards_on_the_gpu_or_offloads_and_reloads(precision, cpu_offload, tmp_path):
    """fsdp on each rank's GPU (two when there are two), with fp16's sharded scaler or bf16, and
    cpu_offload: shards and optimizer state then sit in (pinned) CPU memory."""
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16 support")
    runs = ddpkit.launch(gpu_workers.gpu_fsdp_steps, nprocs=min(2, GPUS), args=(str(tmp_path), precision, cpu_offload))
    for run in runs.values():
        assert len(run["losses"]) == 4 and all(torch.isfinite(torch.tensor(run["losses"]))), run
        assert any(run["stepped"]), run
        where = "cpu" if cpu_offload else "cuda"
        assert [d.split(":")[0] for d in run["shard_devices"] + run["state_devices"]] == [where, where], run
        assert run["same_after_load"], run
        assert run["evaluated"] == 30, run  # every held-out sample once, the shards offloaded or not
        assert run["scaler"] == ("ShardedGradScaler" if precision == "fp16" else None)


@pytest.mark.timeout(120)
def test_fsdp_with_cpu_offload_never_holds_the_whole_model_on_the_gpu_while_it_shards():
    """A model larger than the GPU is what cpu_offload is for: set-up moves a unit at a time."""
    peak, unit = ddpkit.launch(gpu_workers.fsdp_offload_setup_peak, nprocs=1)[0]
    assert peak < 4 * unit, (peak, unit)  # the whole model is 8 units


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_pins_memory_and_hands_out_cuda_batches(monkeypatch, num_workers):
    pinned = []
    real_init = torch.utils.data.DataLoader.__init__

    def spy(self, *args, **kwargs):
        pinned.append(kwargs.get("pin_memory", False))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(torch.utils.data.DataLoader, "__init__", spy)
    rt = ddpkit.init(seed=0)
    data = workers.indexed_dataset(40)
    seen = []
    for features, labels in rt.loader(data, batch_size=8, num_workers=num_workers):
        assert features.device == labels.device == rt.device and rt.device.type == "cuda"
        seen.append(features.cpu())
    assert pinned and all(pinned), f"DataLoader pin_memory per loader built: {pinned}"
    assert torch.equal(torch.cat(seen), data.tensors[0])  # pinned, copied, unchanged


@two_gpus
@pytest.mark.timeout(300)
def test_sync_batchnorm_on_cuda_spans_both_ranks():
    runs = ddpkit.launch(gpu_workers.gpu_sync_bn_stats, nprocs=2)
    everything = torch.tensor(runs[0]["data"] + runs[1]["data"], dtype=torch.float64)
    expected = 0.1 * everything.mean(dim=0)  # momentum 0.1 from zero
    for rank, run in runs.items():
        assert run["type"] == "torch.nn.modules.batchnorm.SyncBatchNorm", run["type"]
        assert torch.allclose(torch.tensor(run["running_mean"], dtype=torch.float64), expected, atol=1e-4), (
            rank,
            run["running_mean"],
        )


def test_convert_sync_batchnorm_on_cuda_uses_torchs_own():
    from ddpkit.parallel.sync_batchnorm import convert_sync_batchnorm

    net = convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(4)), torch.device("cuda", 0))
    assert type(net[0]) is torch.nn.SyncBatchNorm


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-bench") / "out"
    modes = "single,dp,ddp-amp" if GPUS >= 2 else "single,ddp-amp"
    result = ddpkit_cli(
        "bench",
        "--model",
        "mlp",
        "--data",
        "synthetic",
        "--modes",
        modes,
        "--nproc",
        str(min(2, GPUS)),
        "--batch",
        "8",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--out",
        str(out),
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return out, json.loads((out / "bench.json").read_text())


@pytest.mark.timeout(300)
def test_bench_reports_cuda_memory(bench):
    out, report = bench
    assert report["gpus"] == GPUS
    rows = report["configurations"]
    assert rows and all(r["applicable"] and r["peak_cuda_mb"] > 0 for r in rows), rows
    assert [r["precision"] for r in rows if r["mode"] == "ddp-amp"] == ["fp16"]
    assert "peak CUDA MB" in (out / "bench.md").read_text()


@two_gpus
@pytest.mark.timeout(300)
def test_bench_data_parallel_drives_every_gpu(bench):
    _, report = bench
    dp = next(r for r in report["configurations"] if r["mode"] == "dp")
    assert dp["applicable"] is True and dp["devices"] == GPUS and dp["nproc"] == 1
    assert dp["samples_per_second"] > 0 and dp["peak_cuda_mb"] > 0


@two_gpus
@pytest.mark.timeout(120)
def test_data_parallels_replicas_run_under_the_callers_bf16_not_their_threads_float16():
    from ddpkit.recipes.models import DataParallel

    seen = []

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.linear(x)
            seen.append(out.dtype)
            return out

    model = DataParallel(Probe().cuda())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(torch.randn(8, 4, device="cuda"))
    assert len(seen) == min(GPUS, 8) and set(seen) == {torch.bfloat16}, seen


@pytest.mark.timeout(300)
def test_micro_shards_on_one_gpu_end_at_the_same_bits_on_one_process_and_two_sharing_it():
    """Deterministic CUDA kernels (cuDNN, cuBLAS's workspace, torch's switch): one process and two
    processes sharing GPU 0 over gloo end at the same bits; close turns the switch back off."""
    one = ddpkit.launch(gpu_workers.gpu_micro_shards, nprocs=1)[0]
    two = ddpkit.launch(gpu_workers.gpu_micro_shards, nprocs=2)[0]
    assert one["device"] == two["device"] == "cuda:0"
    assert one["deterministic"] and two["deterministic"]
    assert not one["deterministic_after_close"] and one["cudnn_after_close"] == (False, True)  # as the script had them
    differ = [k for k in one["state"] if not torch.equal(one["state"][k], two["state"][k])]
    assert differ == []


NO_DETERMINISTIC_KERNEL = """
import torch, ddpkit
rt = ddpkit.init(seed=0)
model = torch.nn.Linear(4, 2)
model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_shards=2)
x = torch.randn(8, 4, device=rt.device)
torch.histc(model(x), bins=4)  # no deterministic CUDA kernel
"""


@pytest.mark.timeout(120)
def test_an_op_without_a_deterministic_cuda_kernel_is_one_line_under_micro_shards(tmp_path):
    script = tmp_path / "histc.py"
    script.write_text(NO_DETERMINISTIC_KERNEL)
    result = ddpkit_cli("run", "-n", "1", str(script), timeout=100)
    assert result.returncode == 2, result.stderr
    assert "ddpkit: error: micro_shards runs deterministic CUDA kernels only, and _histc_cuda" in result.stderr
    assert "Traceback" not in result.stderr


NCCL_MISMATCH = """
import torch, torch.distributed as dist, ddpkit
rt = ddpkit.init(seed=0)
t = torch.zeros(4, device=rt.device)
if rt.rank == 0:
    dist.all_reduce(t)
else:
    dist.broadcast(t, src=0)
t.sum().item()  # NCCL returns once queued: wait here with the collective in flight, as a real script's next step does
"""


@two_gpus
@pytest.mark.timeout(180)
def test_a_collective_mismatch_on_nccl_is_named_with_nccls_flight_recorder(tmp_path):
    from ddpkit.errors import EXIT_MISMATCH

    script = tmp_path / "nccl_mismatch.py"
    script.write_text(NCCL_MISMATCH)
    result = ddpkit_cli("run", "-n", "2", str(script), timeout=150)
    assert result.returncode == EXIT_MISMATCH, result.stderr[-3000:]
    assert "ddpkit: collective mismatch: " in result.stderr
    assert "; flight recorder: in flight #" in result.stderr and "nccl:" in result.stderr, result.stderr[-3000:]


@pytest.mark.timeout(120)
def test_the_flight_recorder_records_nccl_collectives_on_one_gpu(tmp_path, monkeypatch):
    """What the hang and mismatch reports quote on NCCL: torch's flight recorder, read in-process."""
    import torch.distributed as dist

    from ddpkit import _torch
    from ddpkit.observe import collectives

    monkeypatch.setenv(_torch.flight_recorder_buffer_variable(), "100")  # read when the group is made
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    try:
        dist.all_reduce(torch.ones(3, device="cuda"))
        torch.cuda.synchronize()
        entries = _torch.flight_recorder_dump()["entries"]
        assert any(e["profiling_name"] == "nccl:all_reduce" and e["input_sizes"] == [[3]] for e in entries), entries
        assert "nccl:all_reduce [[3]]" in collectives.flight_line()
        # what the default watchdog reads on NCCL, whose calls return once queued: a collective queued
        # behind seconds of compute is in flight (the group's number and call), then retired when done
        busy = torch.randn(8192, 8192, device="cuda")
        for _ in range(100):
            busy = busy @ busy / 8192
        dist.all_reduce(torch.ones(5, device="cuda"))
        seen = collectives.flight()
        assert seen.pending_call == "nccl:all_reduce [[5]] Float", seen
        assert seen.pending_seq == seen.last >= 2 and seen.pending.startswith(f"#{seen.last} nccl:all_reduce [[5]]")
        # the counters the watchdog reads each second (the entries only when they change): NCCL's group
        queued = {k: v for k, v in collectives.flight_status().items() if k.startswith("_dump_nccl_trace/")}
        assert any(int(v["last_enqueued_collective"]) == seen.last for v in queued.values()), queued
        torch.cuda.synchronize()
        deadline = time.monotonic() + 10.0
        while collectives.flight().pending_seq and time.monotonic() < deadline:  # NCCL's watchdog retires it
            time.sleep(0.1)
        seen = collectives.flight()
        assert seen.pending_seq == 0 and not seen.pending, seen
        done = {k: v for k, v in collectives.flight_status().items() if k.startswith("_dump_nccl_trace/")}
        assert done != queued and any(int(v["last_completed_collective"]) == seen.last for v in done.values()), done
        assert seen.latest == f"#{seen.last} nccl:all_reduce [[5]] Float of group 0", seen
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_one_process_on_a_chosen_gpu_makes_it_the_current_device_and_keeps_its_generator():
    """``ddpkit.init(device="cuda:N")`` in one process: torch.cuda's calls without a device (the RNG
    state a checkpoint keeps, an allocation) mean GPU N, not GPU 0."""
    import subprocess
    import sys

    last = torch.cuda.device_count() - 1
    code = (
        f"import torch, ddpkit; from ddpkit import rng; rt = ddpkit.init(device='cuda:{last}'); "
        "torch.rand(3, device=rt.device); state = rng.rng_state(); "
        "print(torch.cuda.current_device(), rt.device, torch.equal(state['cuda'], torch.cuda.get_rng_state(rt.device)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(last), f"cuda:{last}", "True"]
