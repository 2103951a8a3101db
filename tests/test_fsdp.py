"""strategy="fsdp": the same results as DDP and as any world size, with the loop's features."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import ddpkit

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_workers as fw  # noqa: E402


def _close(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol)


@pytest.fixture(scope="module")
def one():
    result = fw.compare(("ddp", "fsdp"))  # a world of one, in this process
    ddpkit.current().close()
    return result


@pytest.fixture(scope="module")
def two():
    return ddpkit.launch(fw.compare, nprocs=2)


def test_fsdp_on_one_process_equals_ddp_and_names_are_plain(one):
    _close(one["fsdp"]["weights"], one["ddp"]["weights"])
    assert list(one["fsdp"]["weights"]) == [
        "body.0.weight",
        "body.0.bias",
        "body.2.weight",
        "body.2.bias",
        "head.weight",
        "head.bias",
    ]


@pytest.mark.timeout(240)
def test_fsdp_x2_equals_ddp_x2_and_one_process_with_the_loop_features(one, two):
    for rank in (0, 1):
        run = two[rank]
        assert (run["fsdp"]["weights"] is None) == (rank == 1)  # full_state_dict: rank 0 only
        for variant in ("fsdp", "fsdp-after"):  # the optimizer made before or after setup
            got, want = run[variant]["metrics"], run["ddp"]["metrics"]
            assert [got[k] for k in ("count", "correct", "confusion")] == [
                want[k] for k in ("count", "correct", "confusion")
            ]
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            torch.testing.assert_close(run[variant]["predicted"], run["ddp"]["predicted"], rtol=0, atol=1e-5)
        assert run["fsdp-acc"]["metrics"]["count"] == 101  # uneven shards, no hang
        assert run["fsdp-acc"]["norms"] == pytest.approx(run["ddp-acc"]["norms"], rel=1e-5)
    run = two[0]
    _close(run["fsdp"]["weights"], run["ddp"]["weights"])
    _close(run["fsdp-after"]["weights"], run["ddp"]["weights"])
    _close(run["fsdp-acc"]["weights"], run["ddp-acc"]["weights"])  # accumulate + clip
    _close(run["fsdp-offload-acc"]["weights"], run["ddp-acc"]["weights"])  # and cpu_offload
    assert run["fsdp-offload-acc"]["norms"] == pytest.approx(run["ddp-acc"]["norms"], rel=1e-5)
    _close(run["fsdp"]["weights"], one["fsdp"]["weights"])  # 2 processes = 1
    assert not torch.equal(run["fsdp"]["weights"]["head.weight"], run["fsdp-acc"]["weights"]["head.weight"])


def test_activation_checkpointing_under_fsdp_trains_to_the_same_bits_with_plain_names(two):
    """torch.utils.checkpoint(..., use_reentrant=False) in the forward, or each layer wrapped by
    apply_activation_checkpointing before rt.setup shards it: the backward recomputes the same values."""
    for rank, run in two.items():
        for variant in ("fsdp-checkpointed-function", "fsdp-checkpointed-wrapper"):
            assert run[variant]["metrics"] == run["fsdp"]["metrics"], (rank, variant)
            assert torch.equal(run[variant]["predicted"], run["fsdp"]["predicted"]), (rank, variant)
    for variant in ("fsdp-checkpointed-function", "fsdp-checkpointed-wrapper"):
        weights = two[0][variant]["weights"]
        assert list(weights) == list(two[0]["fsdp"]["weights"])  # no _checkpoint_wrapped_module in the names
        for key, value in two[0]["fsdp"]["weights"].items():
            assert torch.equal(weights[key], value), (variant, key)


@pytest.mark.timeout(240)
@pytest.mark.slow  # 4 s
def test_fsdp_x3_equals_fsdp_x2(two):
    three = ddpkit.launch(fw.compare, nprocs=3, args=(("fsdp",),))[0]
    _close(three["fsdp"]["weights"], two[0]["fsdp"]["weights"])
    torch.testing.assert_close(three["fsdp"]["predicted"], two[0]["fsdp"]["predicted"], rtol=0, atol=1e-5)


def test_what_fsdp_refuses_is_one_line_each():
    said = fw.refusals()
    ddpkit.current().close()
    expected = {
        "strategy": "unknown strategy 'zero'",
        "compression": "grad_compression is a DDP communication hook",
        "batchnorm": "BatchNorm layers",
        "ddp-option": "find_unused_parameters: DistributedDataParallel options do not apply",
        "offload": "cpu_offload=True shards parameters to CPU memory: it needs strategy='fsdp'",
        "units": "fsdp_units=['Conv2d']: the model has no such module",
        "stepped-optimizer": "the optimizer has state already",
        "save": "under strategy='fsdp' a checkpoint is a directory of shards",
    }
    assert said.keys() == expected.keys()
    for name, text in expected.items():
        assert text in said[name] and "\n" not in said[name], name


@pytest.mark.slow  # make test-slow: make test keeps the core of this family (its 15 minutes)
@pytest.mark.timeout(240)
def test_a_second_optimizer_built_before_setup_and_not_given_to_it_trains_its_part(tmp_path):
    """A body's optimizer built before rt.setup(model, head_optimizer, strategy="fsdp") stepped the
    parameters fsdp had replaced: the body trained nothing, silently (its weights ended at their first
    values). Now it steps the sharded ones, through rt.step or its own step(), as under DDP (float64, to
    rounding); one that stepped before setup is refused in one line. Given to rt.setup(model, head, body),
    it is rebound there. Loaded from a checkpoint before its first step, it is rebound first: a resumed
    run had loaded its momentum into the replaced parameters and lost it, silently."""
    ddp = ddpkit.launch(fw.second_optimizer, nprocs=2, args=("ddp",))[0]
    assert not torch.equal(ddp["weights"]["body.0.weight"], ddp["first"]["body.0.weight"])
    full = ddpkit.launch(fw.second_optimizer, nprocs=2, args=("fsdp", "rt.step"))[0]
    for name, value in ddp["weights"].items():
        assert torch.allclose(full["weights"][name], value, rtol=1e-12, atol=1e-14), name
    one = fw.second_optimizer("ddp")  # one process (a group of one under fsdp), in this process
    for how in ("own", "given"):
        fsdp = fw.second_optimizer("fsdp", how)
        for name, value in one["weights"].items():
            assert torch.allclose(fsdp["weights"][name], value, rtol=1e-12, atol=1e-14), (how, name)
    stopped = ddpkit.launch(fw.second_optimizer, nprocs=2, args=("fsdp", "rt.step", str(tmp_path / "ckpt"), 2))
    assert stopped[0] == {"stopped": 2}
    resumed = ddpkit.launch(fw.second_optimizer, nprocs=2, args=("fsdp", "rt.step", str(tmp_path / "ckpt")))[0]
    for name, value in full["weights"].items():  # the body's momentum came back: the same bits
        assert torch.equal(resumed["weights"][name], value), name
    said = fw.second_optimizer("fsdp", "stepped")["refused"]
    assert said.startswith("an optimizer that stepped the model's parameters before rt.setup") and "\n" not in said


@pytest.mark.slow  # make test-slow: make test keeps the core of this family (its 15 minutes)
@pytest.mark.timeout(240)
def test_fp16_under_fsdp_scales_like_ddp_and_every_rank_skips_an_inf_in_one_shard():
    ddp = ddpkit.launch(fw.scaled, nprocs=2, args=("ddp",))[0]
    sharded = ddpkit.launch(fw.scaled, nprocs=2, args=("fsdp",))
    _close(sharded[0]["weights"], ddp["weights"])  # fp16 + loss scale, accumulate, clip
    assert sharded[0]["metrics"]["correct"] == ddp["metrics"]["correct"]
    assert sharded[0]["norms"] == pytest.approx(ddp["norms"], rel=1e-4)
    assert sharded[0]["scale"] == ddp["scale"]
    for rank in (0, 1):  # the inf sat in rank 1's shard only: rank 0 skipped the step too
        assert sharded[rank]["inf_stepped"] is False and sharded[rank]["inf_unchanged"] is True
    assert type(ddpkit_scaler_after_fsdp_setup()).__name__ == "ShardedGradScaler"


def ddpkit_scaler_after_fsdp_setup():
    rt = ddpkit.init(seed=0, precision="fp16")
    try:
        rt.setup(fw.Net(), strategy="fsdp")
        return rt.precision.scaler
    finally:
        rt.close()


# -- checkpoints that reshard ----------------------------------------------------------------


@pytest.mark.slow  # 32 s, for make test's budget
@pytest.mark.timeout(300)
def test_fsdp_stopped_on_two_resumes_on_three_and_crosses_strategies(tmp_path):
    full = ddpkit.launch(fw.resumable, nprocs=2, args=("full", str(tmp_path / "unused")))[0]
    stopped = ddpkit.launch(fw.resumable, nprocs=2, args=("stop", str(tmp_path / "fsdp")))[0]
    assert stopped["stopped"] == 17
    saved = Path(stopped["path"])
    assert saved.name == "ckpt-step00000017"
    assert {"manifest.json", "ddpkit.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= {
        p.name for p in saved.iterdir()
    }
    on_three = ddpkit.launch(fw.resumable, nprocs=3, args=("resume", str(tmp_path / "fsdp")))[0]
    assert on_three["steps"] == full["steps"] == 27 and on_three["lr"] == full["lr"]  # the scheduler came back
    _close(on_three["weights"], full["weights"])
    as_ddp = ddpkit.launch(fw.resumable, nprocs=2, args=("resume", str(tmp_path / "fsdp"), "ddp"))[0]
    _close(as_ddp["weights"], full["weights"])  # fsdp checkpoint -> DDP
    ddpkit.launch(fw.resumable, nprocs=2, args=("stop", str(tmp_path / "ddp"), "ddp"))
    assert [p.name for p in (tmp_path / "ddp").iterdir() if p.suffix == ".pt"] == ["ckpt-step00000017.pt"]
    from_ddp = ddpkit.launch(fw.resumable, nprocs=2, args=("resume", str(tmp_path / "ddp"), "fsdp"))[0]
    _close(from_ddp["weights"], full["weights"])  # DDP checkpoint -> fsdp


def _one_process_checkpoint(tmp_path) -> Path:
    rt = ddpkit.init(seed=0)
    model = rt.setup(fw.Net(), strategy="fsdp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rt.backward(model(torch.randn(4, 8)).sum())
    rt.step(opt)
    path = rt.save(tmp_path / "ckpts", {"model": model, "opt": opt})
    rt.close()
    return path


def _load_error(path, model_factory=fw.Net) -> str:
    rt = ddpkit.init(seed=0)
    try:
        model = rt.setup(model_factory(), strategy="fsdp")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ddpkit.DdpkitError) as caught:
            rt.load(path, {"model": model, "opt": opt})
        return str(caught.value)
    finally:
        rt.close()


def test_bad_sharded_checkpoints_are_one_line_and_nothing_is_overwritten(tmp_path):
    import shutil

    good = _one_process_checkpoint(tmp_path)
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    missing = shutil.copytree(good, tmp_path / "missing" / good.name)
    (missing / "__0_0.distcp").unlink()
    assert "is incomplete: __0_0.distcp (in its manifest) is missing" in _load_error(missing)
    damaged = shutil.copytree(good, tmp_path / "damaged" / good.name)
    with open(damaged / "__0_0.distcp", "r+b") as handle:
        handle.write(b"\0\0\0\0")
    assert "is damaged: __0_0.distcp" in _load_error(damaged)

    class Wider(fw.Net):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(32, 5)

    said = _load_error(good, Wider)
    assert said.startswith(f"checkpoint {good} does not fit this model") and "\n" not in said
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before  # loads wrote nothing


@pytest.mark.timeout(120)
def test_a_kill_inside_an_fsdp_save_keeps_the_previous_checkpoint(tmp_path):
    from helpers import python

    script = str(Path(__file__).parent / "scripts" / "fsdp_kill_in_save.py")
    killed = python(script, str(tmp_path), "3", timeout=60)
    assert killed.returncode == -9, killed.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[1:] == ["ckpt-step00000001", "ckpt-step00000002"] and names[0].startswith(".ckpt-step00000003.tmp-")
    resumed = python(script, str(tmp_path), "99", timeout=60)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from ckpt-step00000002 at step 2" in resumed.stdout
    assert not any(p.name.startswith(".ckpt-step") for p in tmp_path.iterdir())  # the leftover is swept


@pytest.mark.slow  # ~30 s: two 2-process runs
@pytest.mark.timeout(240)
def test_a_rank_killed_after_writing_its_shards_keeps_the_previous_checkpoint(tmp_path):
    from helpers import ddpkit as ddpkit_cli

    script = str(Path(__file__).parent / "scripts" / "fsdp_kill_in_save.py")
    killed = ddpkit_cli("run", "-n", "2", script, str(tmp_path), "3", timeout=200)
    assert killed.returncode != 0 and "rank 1" in killed.stderr, killed.stderr[-2000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[1:] == ["ckpt-step00000001", "ckpt-step00000002"] and names[0].startswith(".ckpt-step00000003.tmp-")
    resumed = ddpkit_cli("run", "-n", "2", script, str(tmp_path), "99", timeout=200)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.stdout.count("resumed from ckpt-step00000002 at step 2") == 2  # both ranks
    assert not any(p.name.startswith(".ckpt-step") for p in tmp_path.iterdir())


# -- the commands ----------------------------------------------------------------------------


@pytest.mark.slow  # ~25 s: train on 2 processes, predict on 2, export
@pytest.mark.timeout(300)
def test_train_predict_and_export_with_strategy_fsdp(tmp_path):
    from helpers import ddpkit as ddpkit_cli

    out = tmp_path / "run"
    trained = ddpkit_cli(
        "train",
        "--model",
        "mlp",
        "--data",
        "digits",
        "--strategy",
        "fsdp",
        "--nproc",
        "2",
        "--precision",
        "fp16",
        "--cpu-offload",
        "--epochs",
        "1",
        "--out",
        str(out),
        timeout=200,
    )
    assert trained.returncode == 0, trained.stderr[-2000:]
    import json

    summary = json.loads((out / "summary.json").read_text())
    assert (summary["strategy"], summary["precision"], summary["cpu_offload"]) == ("fsdp", "fp16", True)
    assert summary["test_accuracy"] > 0.5
    [saved] = [p for p in (out / "checkpoints").iterdir()]
    assert (saved / "manifest.json").is_file()
    predicted = ddpkit_cli(
        "predict",
        "--checkpoint",
        str(out / "checkpoints"),
        "--data",
        "digits",
        "--nproc",
        "2",
        "--out",
        str(tmp_path / "p.csv"),
        timeout=200,
    )
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    rows = (tmp_path / "p.csv").read_text().splitlines()
    exported = ddpkit_cli("export", "--checkpoint", str(out / "checkpoints"), "--out", str(tmp_path / "m.pt"))
    assert exported.returncode == 0, exported.stderr
    weights = torch.load(tmp_path / "m.pt")
    from ddpkit.recipes.datasets import load_dataset
    from ddpkit.recipes.models import build_model

    model = build_model("mlp", num_classes=10, in_channels=1, image_size=8)
    model.load_state_dict(weights)  # plain names, the whole model
    test = load_dataset("digits", "test")
    first = test.dataset[0][0].unsqueeze(0)
    assert rows[1].split(",")[1] == str(int(model(first).argmax()))


def test_train_and_export_refuse_bad_input_in_one_line(tmp_path, capsys):
    from ddpkit import cli

    def refused(*args: str) -> str:
        assert cli.main(list(args)) == 2  # in this process; tests/test_cli.py runs the command whole
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    assert "BatchNorm layers" in refused(
        "train", "--model", "convnet", "--strategy", "fsdp", "--out", str(tmp_path / "r")
    )
    assert "--strategy 'zero': choose ddp or fsdp" in refused(
        "train", "--strategy", "zero", "--out", str(tmp_path / "r")
    )
    assert "--cpu-offload keeps fsdp's shards in CPU memory: add --strategy fsdp" in refused(
        "train", "--cpu-offload", "--out", str(tmp_path / "r")
    )
    (tmp_path / "m.pt").write_bytes(b"keep me")
    assert "pass --overwrite" in refused("export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "m.pt"))
    assert (tmp_path / "m.pt").read_bytes() == b"keep me"
    assert not (tmp_path / "r").exists()


def test_fsdp_trains_and_evaluates_on_streams():
    import stream_workers as sw

    rt = ddpkit.init(seed=0)
    try:
        model = rt.setup(torch.nn.Linear(4, 3), strategy="fsdp")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = rt.full_state_dict(model)["weight"].clone()
        for _, x, y in rt.loader(sw.shards(), global_batch_size=12, shuffle=True):
            rt.backward(torch.nn.functional.cross_entropy(model(x), (y[:, 0] > 1).long()))
            rt.step(opt)
        assert not torch.equal(rt.full_state_dict(model)["weight"], before)
        metrics = ddpkit.evaluate(model, sw.pairs("shards"), num_classes=3, batch_size=10)
        assert metrics["count"] == sw.TOTAL
        assert ddpkit.predict(model, sw.pairs("plain"), batch_size=10).shape == (sw.TOTAL, 3)
    finally:
        rt.close()


@pytest.mark.slow  # 15 s, for make test's budget
def test_fsdp_resumed_on_the_same_world_size_is_bitwise(tmp_path):
    runs = []
    for mode in ("full", "stop", "resume"):
        runs.append(fw.resumable(mode, str(tmp_path / "ckpts")))
        ddpkit.current().close()
    full, stopped, resumed = runs
    assert stopped["stopped"] == 17 and resumed["steps"] == full["steps"] == 27
    for key in full["weights"]:
        assert torch.equal(resumed["weights"][key], full["weights"][key]), key


@pytest.mark.slow  # 9 s: make test-slow; make test keeps a kill inside an fsdp save
@pytest.mark.timeout(180)
def test_a_background_fsdp_save_returns_before_its_seal_and_holds_the_state_of_its_step(tmp_path):
    from ddpkit.checkpoint import dcp
    from helpers import ddpkit as ddpkit_cli

    script = str(Path(__file__).parent / "scripts" / "fsdp_background_save.py")
    result = ddpkit_cli("run", "-n", "2", script, str(tmp_path), timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("returned before the seal: True") == 2, result.stdout  # DCP's async_save
    blocking = dcp.read_consolidated(tmp_path / "blocking" / "ckpt-step00000002")
    background = dcp.read_consolidated(tmp_path / "background" / "ckpt-step00000002")
    assert background["ddpkit"]["step"] == 2
    for entry in ("model", "opt"):
        flat_b, flat_g = _flat(blocking["user"][entry]), _flat(background["user"][entry])
        assert flat_b.keys() == flat_g.keys() and flat_b
        for key, value in flat_b.items():  # the step's state, though three steps ran during the write
            assert torch.equal(value, flat_g[key]) if isinstance(value, torch.Tensor) else value == flat_g[key], key


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}{key}/").items()}
    return {prefix: tree}


@pytest.mark.timeout(120)
def test_a_failed_background_fsdp_write_fails_the_next_save_and_keeps_the_checkpoint_before(tmp_path, monkeypatch):
    from ddpkit.checkpoint import background, dcp

    rt = ddpkit.init(seed=0, checkpoint_dir=tmp_path)
    net = fw.Net()
    model, opt = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy="fsdp")
    state = {"model": model, "opt": opt}

    def step():
        rt.backward(model(torch.randn(4, 8)).pow(2).mean())
        rt.step(opt)

    step()
    rt.checkpoint(state)  # step 1: written
    step()
    assert background.WRITER.join(60)  # step 1's seal is done before the disk "fills"

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "_seal", full)
    rt.checkpoint(state)  # step 2: returns; its seal fails in the background
    step()
    with pytest.raises(
        ddpkit.errors.DdpkitError, match=r"could not write checkpoint .*ckpt-step00000002 in the background"
    ):
        rt.checkpoint(state)
    assert ddpkit.checkpoint.latest(tmp_path).name == "ckpt-step00000001"
    rt.close()


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_rt_clip_grad_norm_of_fsdp_shards_is_torchs_clip_of_the_whole_gradients(norm_type, monkeypatch):
    """fsdp's gradient shards are clipped with ddpkit's own reduction of their norms (torch's reduces
    over the mesh's group, which NCCL refuses where ``cpu_offload`` keeps the shards on the host): the
    same total norm and clipped gradients as torch's ``clip_grad_norm_`` of the unsharded model."""
    import copy

    import torch.nn.functional as F

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    plain = copy.deepcopy(net)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    with ddpkit.init(seed=0) as rt:
        model, _ = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy="fsdp")
        rt.backward(F.cross_entropy(model(x), y))
        with monkeypatch.context() as patched:  # not torch's reduction over the mesh
            patched.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: pytest.fail("torch's clip"))
            norm = rt.clip_grad_norm_(model, 0.05, norm_type=norm_type)
        clipped = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    F.cross_entropy(plain(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05, norm_type=norm_type)
    assert float(norm) == pytest.approx(float(expected), rel=1e-6) and float(expected) > 0.05
    for name, p in plain.named_parameters():
        torch.testing.assert_close(clipped[name], p.grad, rtol=1e-6, atol=1e-8)
