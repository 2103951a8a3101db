"""The run's state as one object, saved and resumed by functions: no process group, no runtime."""

from __future__ import annotations

import pytest
import torch

from ddpkit.checkpoint import restore, resume
from ddpkit.errors import UsageError
from ddpkit.loop import build, steps
from ddpkit.parallel.options import SetupOptions, check_strategy
from ddpkit.parallel.wrap import wrap
from ddpkit.state.precision import Precision
from ddpkit.state.run import RunState


def _run(weights: int = 3) -> tuple[RunState, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(weights)
    run = RunState(Precision("fp32", "cpu"), seed=3)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    wrapped = wrap(
        model,
        opt,
        SetupOptions(),
        device=torch.device("cpu"),
        world_size=1,
        is_main=True,
        precision="fp32",
        timeout_s=60,
    )
    run.adopt(wrapped.model, opt)
    return run, wrapped.model, opt


def _train(run: RunState, model: torch.nn.Module, opt: torch.optim.Optimizer, batches, count: int) -> None:
    for _ in range(count):
        x, y = next(batches)
        steps.backward(run, torch.nn.functional.mse_loss(model(x), y))
        steps.step(run, (opt,))


def _loader(run: RunState):
    data = torch.utils.data.TensorDataset(torch.arange(40.0).reshape(10, 4) / 40, torch.ones(10, 2))
    return build.build_loader(
        run,
        data,
        build.loader_options({"global_batch_size": 2, "shuffle": True}),
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        on_batch=lambda made: steps.on_batch(run, made),
        watch=lambda probe: None,
    )


def test_save_and_load_are_functions_of_the_run_state_without_a_process_group(tmp_path):
    assert not torch.distributed.is_initialized()
    run, model, opt = _run()
    batches = iter(_loader(run))
    _train(run, model, opt, batches, 3)
    saved = resume.save(run, resume.Peers(), tmp_path / "c.pt", {"model": model, "opt": opt})
    _train(run, model, opt, batches, 2)  # the rest of the epoch, uninterrupted
    want = {k: v.clone() for k, v in model.state_dict().items()}

    again, model2, opt2 = _run(weights=99)  # another process: other weights, fresh loop
    loader2 = _loader(again)
    restore.load(again, resume.Peers(), saved, {"model": model2, "opt": opt2})
    assert again.loop.step == 3
    rest = iter(loader2)  # continues the saved pass: two batches are left
    _train(again, model2, opt2, rest, 2)
    with pytest.raises(StopIteration):
        next(rest)
    assert again.loop.step == run.loop.step == 5
    for key, value in model2.state_dict().items():
        assert torch.equal(value, want[key]), key


def test_resume_auto_without_a_checkpoint_is_none_and_a_bad_source_a_clear_error(tmp_path):
    run, model, _ = _run()
    assert restore.resume(run, resume.Peers(), "auto", tmp_path, {"model": model}) is None
    assert restore.resume(run, resume.Peers(), None, None, {"model": model}) is None
    with pytest.raises(Exception, match="no complete checkpoint"):
        restore.load(run, resume.Peers(), tmp_path, {"model": model})


def test_setup_options_refuse_in_one_place():
    cpu = torch.device("cpu")
    with pytest.raises(UsageError, match="unknown strategy 'zero'"):
        SetupOptions(strategy="zero").check(torch.nn.Linear(2, 2), device=cpu, backend=None, precision="fp32")
    with pytest.raises(UsageError, match="cpu_offload=True shards parameters .* needs strategy='fsdp'"):
        SetupOptions(cpu_offload=True).check(torch.nn.Linear(2, 2), device=cpu, backend=None, precision="fp32")
    with pytest.raises(UsageError, match="--cpu-offload keeps .* add --strategy fsdp"):
        check_strategy("ddp", True, cli=True)
    with pytest.raises(UsageError, match="grad_compression is a DDP communication hook"):
        SetupOptions(strategy="fsdp", grad_compression="fp16").check(
            torch.nn.Linear(2, 2), device=cpu, backend=None, precision="fp32"
        )


def test_an_unknown_loader_option_is_named():
    run = RunState(Precision("fp32", "cpu"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'batchsize'"):
        build.loader_options({"batchsize": 4})
    assert build.loader_options({"batch_size": 4}).batch_size == 4
    assert run.loop.step == 0


def test_a_warning_deep_inside_ddpkit_names_the_users_line():
    import warnings

    import ddpkit

    rt = ddpkit.init()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            rt.setup(torch.nn.Linear(2, 2), grad_compression="fp16")  # setup -> wrap -> replicate warns
        found = [w for w in seen if "no effect with one process" in str(w.message)]
        assert found and found[0].filename == __file__, [(w.filename, str(w.message)) for w in seen]
    finally:
        rt.close()
