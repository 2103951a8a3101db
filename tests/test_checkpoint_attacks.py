"""Nothing in a checkpoint can run code, for every format ddpkit reads and every path that reads one.

Written as an attacker would: a pickle whose ``__reduce__`` calls ``builtins.exec`` (or
``pathlib.Path.touch``) to create a marker file, planted in a single-file ``.pt`` checkpoint, in a
DCP checkpoint's ``ddpkit.pt``, in its ``.metadata`` and in a non-tensor value of its ``.distcp``
files, with the checksums (``.sha256`` record, ``manifest.json``) written again to match, so
verification passes and the attack reaches the unpickler. Each is driven through ``rt.load``,
``resume="auto"``, ``checkpoint.read``, ``ddpkit export``, ``ddpkit predict`` and a load on
another world size; every one must refuse in one line naming the file and what it wanted, and
the marker must never exist.
"""

from __future__ import annotations

import builtins
import hashlib
import itertools
import json
import pathlib
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

import ddpkit
from ddpkit import checkpoint
from ddpkit.checkpoint import dcp_reader, safe
from ddpkit.errors import DamagedCheckpoint, DdpkitError, UnsafeCheckpoint, one_line
from helpers import ddpkit as ddpkit_cli

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_workers as fw  # noqa: E402


class Exec:
    """Unpickled, runs Python that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (builtins.exec, (f"import pathlib; pathlib.Path({str(self.marker)!r}).touch()",))


class Touch:
    """Unpickled, creates ``marker`` with a method: ``pathlib.Path.touch`` (``getattr`` under protocol 2)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


# -- making checkpoints and planting attacks --------------------------------------------------


def _fsdp_state(rt, lr: float = 0.1):
    model = rt.setup(fw.Net(), strategy="fsdp")
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=lr)}


def _write_sharded(directory: Path, lr: object = 0.05) -> Path:
    """A one-process sharded checkpoint of fw.Net + SGD, written by ddpkit; ``lr`` is saved as given."""
    rt = ddpkit.init(seed=0)
    state = _fsdp_state(rt)
    rt.backward(state["model"](torch.randn(4, 8)).sum())
    rt.step(state["opt"])
    state["opt"].param_groups[0]["lr"] = lr
    path = rt.save(directory, state, blocking=True)
    rt.close()
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A clean sharded checkpoint and one whose optimizer ``lr`` is an attack, as DCP itself saves it.

    DCP pickles non-tensor values into the ``.distcp`` files with ``torch.save``; its planner reads
    them with ``torch.load(weights_only=False)``. ddpkit wrote this manifest itself: nothing to fake.
    """
    root = tmp_path_factory.mktemp("made")
    marker = root / "MARKER-distcp"
    with pytest.MonkeyPatch.context() as patch:  # ddpkit refuses to save what its load would refuse:
        patch.setattr(safe, "check_loadable", lambda entries: None)  # the attacker writes past that
        made = {
            "clean": _write_sharded(root / "clean"),
            "distcp": _write_sharded(root / "distcp", Exec(marker)),
            "distcp-marker": marker,
        }
    assert not marker.exists()  # saving pickled the attack; nothing ran it
    return made


def _reseal(step: Path) -> None:
    """Write ``manifest.json`` again as ``ddpkit.checkpoint.dcp.save`` does, so sizes and SHA-256 match the files."""
    manifest = json.loads((step / "manifest.json").read_text())
    files = {}
    for path in sorted(step.iterdir()):
        if path.name != "manifest.json":
            data = path.read_bytes()
            files[path.name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest["files"] = files
    (step / "manifest.json").write_text(json.dumps(manifest, indent=1))


def _plant(kind: str, made: dict, where: Path) -> tuple[Path, Path, str, str]:
    """A sharded checkpoint attacked in ``kind``, alone in ``where``; (step dir, marker, file, wanted)."""
    source = made["distcp" if kind == ".distcp" else "clean"]
    step = shutil.copytree(source, where / source.name)
    marker = where / "MARKER"
    if kind == "ddpkit.pt":
        own = torch.load(step / "ddpkit.pt", weights_only=True)
        own["config"]["seed"] = Exec(marker)
        torch.save(own, step / "ddpkit.pt")
        _reseal(step)
        return step, marker, str(step / "ddpkit.pt"), "builtins.exec"
    if kind == ".metadata":
        with open(step / ".metadata", "rb") as handle:
            metadata = dcp_reader.load_metadata(handle, step / ".metadata")
        metadata.storage_meta.modules = [Touch(marker)]  # deep inside real metadata
        (step / ".metadata").write_bytes(pickle.dumps(metadata))
        _reseal(step)
        return step, marker, str(step / ".metadata"), "pathlib.Path.touch"
    assert kind == ".distcp"
    return (step, made["distcp-marker"], f"{step / '__0_0.distcp'} (entry opt.param_groups.0.lr)", "builtins.exec")


def _assert_refused(said: str, file: str, wanted: str) -> None:
    assert "\n" not in said.strip(), said
    assert f"checkpoint {file} wants {wanted}, " in said, said
    assert "ddpkit refuses to unpickle it (it could run code)" in said, said


def _assert_cli_refused(result, command: str, file: str, wanted: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"ddpkit {command}: error: "), result.stderr[-3000:]
    _assert_refused(lines[0], file, wanted)


KINDS = ["ddpkit.pt", ".metadata", ".distcp"]
METADATA = "torch.distributed.checkpoint.metadata"


# -- sharded (DCP) checkpoints, every path ----------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_rt_load_refuses_an_attacked_sharded_checkpoint(made, tmp_path, kind):
    step, marker, file, wanted = _plant(kind, made, tmp_path)
    rt = ddpkit.init(seed=0)
    state = _fsdp_state(rt)
    for path in (step, step.parent):  # the step directory, and its directory (newest)
        with pytest.raises(UnsafeCheckpoint) as caught:
            rt.load(path, state)
        _assert_refused(str(caught.value), file, wanted)
    assert not marker.exists()


@pytest.mark.parametrize("kind", KINDS)
def test_resume_auto_refuses_an_attacked_sharded_checkpoint(made, tmp_path, kind):
    step, marker, file, wanted = _plant(kind, made, tmp_path)
    rt = ddpkit.init(seed=0, checkpoint_dir=step.parent, resume="auto")
    with pytest.raises(UnsafeCheckpoint) as caught:
        rt.resume(_fsdp_state(rt))
    _assert_refused(str(caught.value), file, wanted)
    assert not marker.exists()


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_read_refuses_an_attacked_sharded_checkpoint(made, tmp_path, kind):
    step, marker, file, wanted = _plant(kind, made, tmp_path)
    with pytest.raises(UnsafeCheckpoint) as caught:
        checkpoint.read(step)
    _assert_refused(str(caught.value), file, wanted)
    assert not marker.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(  # (make test: the commands on one attacked file; rt.load and checkpoint.read on each)
    "kind", [pytest.param(k, marks=pytest.mark.slow) if k != "ddpkit.pt" else k for k in KINDS]
)
def test_export_and_predict_refuse_an_attacked_sharded_checkpoint(made, tmp_path, kind):
    step, marker, file, wanted = _plant(kind, made, tmp_path / "ckpts")
    exported = ddpkit_cli("export", "--checkpoint", str(step), "--out", str(tmp_path / "model.pt"))
    _assert_cli_refused(exported, "export", file, wanted)
    predicted = ddpkit_cli("predict", "--checkpoint", str(step.parent), "--out", str(tmp_path / "p.csv"))
    _assert_cli_refused(predicted, "predict", file, wanted)
    assert not marker.exists() and not (tmp_path / "model.pt").exists() and not (tmp_path / "p.csv").exists()


def test_rank_local_metadata_is_no_way_around(made, tmp_path):
    """DCP falls back to ``__RANK.metadata`` when ``.metadata`` is missing; ddpkit wants its own file."""
    step = shutil.copytree(made["clean"], tmp_path / made["clean"].name)
    (step / ".metadata").unlink()
    (step / "__0.metadata").write_bytes(pickle.dumps(Exec(tmp_path / "MARKER")))
    _reseal(step)
    with pytest.raises(DdpkitError, match=r"has no \.metadata: it is not a complete DCP checkpoint"):
        checkpoint.read(step)
    reader = dcp_reader.Reader(step)
    with pytest.raises(UnsafeCheckpoint) as caught:  # DCP's own fallback, if it got there
        reader.read_metadata(rank=0)
    _assert_refused(str(caught.value), str(step / "__0.metadata"), "builtins.exec")
    assert not (tmp_path / "MARKER").exists()


@pytest.mark.timeout(240)  # ~7 s: two 2-process runs
def test_loads_on_another_world_size_refuse_and_a_clean_one_reshards(made, tmp_path):
    """Written on 2 processes, attacked, loaded on 1; written on 1, attacked, loaded on 2 (no rank hangs)."""
    two = Path(ddpkit.launch(fw.resumable, nprocs=2, args=("stop", str(tmp_path / "two"), "fsdp", 3, 1))[0]["path"])
    planted = {}
    for kind in ("ddpkit.pt", ".metadata"):
        planted[kind] = _plant(kind, {"clean": two}, tmp_path / f"two-{kind}")
    rt = ddpkit.init(seed=0)
    net = fw.Net()
    model, opt = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2), strategy="fsdp")
    state = {"model": model, "opt": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, step_size=5)}
    for step, marker, file, wanted in planted.values():
        with pytest.raises(UnsafeCheckpoint) as caught:
            rt.load(step, state)
        _assert_refused(str(caught.value), file, wanted)
        assert not marker.exists()
    rt.load(two, state)  # 2 -> 1 through ddpkit's reader
    whole = checkpoint.read(two)["user"]["model"]
    for key, value in rt.full_state_dict(model).items():
        assert torch.equal(value, whole[key]), key
    rt.close()

    attacked = [_plant(kind, made, tmp_path / f"one-{kind}") for kind in KINDS]
    said = ddpkit.launch(load_each, nprocs=2, args=([str(a[0]) for a in attacked] + [str(made["clean"])],))
    for rank in (0, 1):
        for (_step, marker, file, wanted), text in zip(attacked, said[rank]):
            _assert_refused(text, file, wanted)
            assert not marker.exists()
        assert said[rank][-1] is None  # 1 -> 2: the clean one loads


def load_each(paths: list[str]) -> list[str | None]:
    """Each rank loads each checkpoint in turn into fw.Net + SGD; what each load raised (None: loaded)."""
    rt = ddpkit.init(seed=0)
    state = _fsdp_state(rt)
    said: list[str | None] = []
    for path in paths:
        try:
            rt.load(path, state)
            said.append(None)
        except DdpkitError as exc:
            said.append(str(exc))
    return said


# -- a single-file .pt checkpoint, every path -------------------------------------------------


def test_an_attacked_single_file_checkpoint_is_refused_on_every_path(tmp_path):
    rt = ddpkit.init(seed=0)
    model = torch.nn.Linear(3, 2)
    path = rt.save(tmp_path / "ckpts", {"model": model, "note": "plain"}, blocking=True)
    payload = torch.load(path, weights_only=True)
    marker = tmp_path / "MARKER"
    payload["user"]["note"] = Exec(marker)
    torch.save(payload, path)
    data = path.read_bytes()
    path.with_name(path.name + ".sha256").write_text(
        json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)})
    )
    checkpoint.verify(path)  # the checksums vouch for the attack
    for load in (
        lambda: rt.load(path, {"model": model, "note": None}),
        lambda: rt.load(path.parent, {"model": model, "note": None}),
        lambda: checkpoint.read(path),
    ):
        with pytest.raises(UnsafeCheckpoint) as caught:
            load()
        _assert_refused(str(caught.value), str(path), "builtins.exec")
    rt.close()
    rt = ddpkit.init(seed=0, checkpoint_dir=path.parent, resume="auto")
    with pytest.raises(UnsafeCheckpoint) as caught:
        rt.resume({"model": model, "note": None})
    _assert_refused(str(caught.value), str(path), "builtins.exec")
    rt.close()
    exported = ddpkit_cli("export", "--checkpoint", str(path), "--out", str(tmp_path / "model.pt"))
    _assert_cli_refused(exported, "export", str(path), "builtins.exec")
    predicted = ddpkit_cli("predict", "--checkpoint", str(path.parent), "--out", str(tmp_path / "p.csv"))
    _assert_cli_refused(predicted, "predict", str(path), "builtins.exec")
    assert not marker.exists()


# -- plain data of another shape: refused before anything is restored -------------------------

CRAFTED = [  # (field of payload["ddpkit"], crafted value, what the refusal names)
    ("loop.step", torch.tensor([1, 2, 3]), "ddpkit.loop.step: expected a whole number of at least 0, found a tensor"),
    ("loop.driven", torch.ones(3), "ddpkit.loop.driven: expected True or False"),
    ("loop.epoch", "x", "ddpkit.loop.epoch: expected a whole number"),
    ("loop.micro_step", -5, "ddpkit.loop.micro_step: expected a whole number of at least 0, found -5"),
    ("loop.group", [1], "ddpkit.loop.group: expected [size, weight] or []"),
    ("loop.passes", 3, "ddpkit.loop.passes: expected a dict"),
    ("loop.stage", -1, "ddpkit.loop.stage: expected a whole number of at least 0, found -1"),
    ("loop.stage_left", "yes", "ddpkit.loop.stage_left: expected True or False"),
    ("loop.epoch_begun", torch.ones(1), "ddpkit.loop.epoch_begun: expected True or False"),
    ("loop.stage_start", 10**6, "ddpkit.loop.stage_start: expected an epoch no later than ddpkit.loop.epoch"),
    (
        "loop.loaders",
        {"train": {"epoch": 0, "position": "7", "finished": False, "signature": {}}},
        "ddpkit.loop.loaders['train'].position: expected a whole number",
    ),
    ("loop", None, "ddpkit.loop: expected a dict"),
    ("world_size", "a", "ddpkit.world_size: expected a whole number of at least 1"),
    ("rng", [], "ddpkit.rng: expected a list of 1, one per process"),
    ("rng.0.torch", torch.zeros(3, dtype=torch.uint8), "ddpkit.rng[0].torch: expected a generator's state"),
    ("rng.0.python", [3, [1, 2], None], "ddpkit.rng[0].python: expected a generator's state"),
    ("precision.scaler", {"scale": "x"}, "ddpkit.precision.scaler['scale']: expected a number"),
    ("compression", [None, None], "ddpkit.compression: expected a list of 1"),
    ("compression", [[3]], "ddpkit.compression[0][0]: expected a dict"),
    ("accumulated_grads", [[["x"]]], "ddpkit.accumulated_grads[0][0][0]: expected a tensor"),
    ("precision.scaler", {"scale": 1.0}, "ddpkit.precision.scaler['growth_factor']: expected a number, found None"),
    (
        "loop.loaders",
        {"train": {"epoch": 0, "position": 1, "finished": False, "signature": {"seed": 0}}},
        "ddpkit.loop.loaders['train'].signature.global_batch_size: expected a whole number of at least 1",
    ),
]


def _craft(own: dict, field: str, value: object) -> None:
    *parents, last = field.split(".")
    for part in parents:
        own = own[int(part)] if isinstance(own, list) else own[part]
    if isinstance(own, list):
        own[int(last)] = value
    else:
        own[last] = value


def _craft_single_file(tmp_path: Path, field: str, value: object):
    """A one-process checkpoint taken mid-epoch, its ddpkit state crafted and its checksum written anew."""
    rt = ddpkit.init(seed=0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(torch.utils.data.TensorDataset(torch.randn(16, 3)), global_batch_size=4, shuffle=True)
    for (x,) in itertools.islice(loader, 2):
        rt.backward(model(x).sum())
        rt.step(optimizer)
    path = rt.save(tmp_path / "ckpts", {"model": model, "optimizer": optimizer}, blocking=True)
    rt.close()
    payload = torch.load(path, weights_only=True)
    _craft(payload["ddpkit"], field, value)
    torch.save(payload, path)
    data = path.read_bytes()
    path.with_name(path.name + ".sha256").write_text(
        json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)})
    )
    return path


@pytest.mark.parametrize(("field", "value", "named"), CRAFTED, ids=[f"{c[0]}-{i}" for i, c in enumerate(CRAFTED)])
def test_a_crafted_ddpkit_state_is_one_line_before_anything_is_restored(tmp_path, field, value, named):
    path = _craft_single_file(tmp_path, field, value)
    rt = ddpkit.init(seed=1)
    model = torch.nn.Linear(3, 2)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    generator = torch.get_rng_state()
    state = {"model": model, "optimizer": optimizer}
    for load in (lambda: rt.load(path, state), lambda: rt.load(path.parent, state)):
        with pytest.raises(DamagedCheckpoint) as caught:
            load()
        said = str(caught.value)
        assert "\n" not in said and said == one_line(said), said
        assert f"checkpoint {path} holds a malformed ddpkit state (" in said, said
        assert named in said, said
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing was restored
    assert torch.equal(generator, torch.get_rng_state()) and rt.global_step == 0
    rt.close()


def test_a_crafted_ddpkit_state_of_a_sharded_checkpoint_is_refused(made, tmp_path):
    step = shutil.copytree(made["clean"], tmp_path / made["clean"].name)
    own = torch.load(step / "ddpkit.pt", weights_only=True)
    own["loop"]["step"] = torch.tensor([1, 2, 3])
    torch.save(own, step / "ddpkit.pt")
    _reseal(step)
    [said] = load_each([str(step)])
    assert said is not None and "\n" not in said, said
    assert f"checkpoint {step} holds a malformed ddpkit state (ddpkit.loop.step: expected a whole number" in said


# -- what must still work, and the allowlist ---------------------------------------------------


def test_a_clean_sharded_checkpoint_loads_through_the_allowlist(made, tmp_path, monkeypatch):
    asked: list[tuple[str, str]] = []
    find_class = dcp_reader.MetadataUnpickler.find_class

    def logged(self, module, name):
        asked.append((module, name))
        return find_class(self, module, name)

    monkeypatch.setattr(dcp_reader.MetadataUnpickler, "find_class", logged)
    rt = ddpkit.init(seed=0)
    state = _fsdp_state(rt, lr=0.1)
    rt.load(made["clean"], state)
    assert asked and state["opt"].param_groups[0]["lr"] == 0.05  # a non-tensor value, read safely
    assert asked.count((METADATA, "Metadata")) == 1  # read once: ddpkit first, then DCP
    weights = rt.full_state_dict(state["model"])
    rt.close()
    asked.clear()
    whole = checkpoint.read(made["clean"])
    assert asked.count((METADATA, "Metadata")) == 1 and whole["user"]["opt"]["param_groups"][0]["lr"] == 0.05
    for key, value in weights.items():
        assert torch.equal(whole["user"]["model"][key], value), key
    assert set(asked) <= dcp_reader.METADATA_GLOBALS | {("torch", name) for name in dcp_reader.DTYPE_NAMES}
    exported = ddpkit_cli("export", "--checkpoint", str(made["clean"]), "--out", str(tmp_path / "model.pt"))
    assert exported.returncode == 0, exported.stderr[-3000:]
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert saved.keys() == weights.keys()


class _Reduce:
    def __init__(self, call, args):
        self.call, self.args = call, args

    def __reduce__(self):
        return (self.call, self.args)


@pytest.mark.parametrize(
    "call, args, wanted",
    [
        (builtins.eval, ("1",), "builtins.eval"),
        (builtins.exec, ("x = 1",), "builtins.exec"),
        (builtins.getattr, (pathlib.Path, "cwd"), "builtins.getattr"),
        (__import__("os").system, ("true",), f"{__import__('os').system.__module__}.system"),
        (__import__("subprocess").Popen, (["true"],), "subprocess.Popen"),
        (__import__("functools").partial, (print,), "functools.partial"),
        (torch.load, ("x",), "torch.serialization.load"),
        (pathlib.Path.touch, (pathlib.Path("x"),), "pathlib.Path.touch"),
    ],
    ids=["eval", "exec", "getattr", "system", "popen", "partial", "torch.load", "method"],
)
@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_the_metadata_allowlist_refuses_what_could_run_code(tmp_path, call, args, wanted, protocol):
    if protocol < 4 and wanted == "pathlib.Path.touch":
        wanted = "builtins.getattr"  # protocols before 4 reach a method through getattr
    file = tmp_path / ".metadata"
    file.write_bytes(pickle.dumps({"metadata": _Reduce(call, args)}, protocol=protocol))
    with open(file, "rb") as handle, pytest.raises(UnsafeCheckpoint) as caught:
        dcp_reader.load_metadata(handle, file)
    _assert_refused(str(caught.value), str(file), wanted)


def test_metadata_of_allowed_classes_that_is_not_metadata_is_refused(tmp_path):
    file = tmp_path / ".metadata"
    file.write_bytes(pickle.dumps(torch.Size([1, 2])))
    with open(file, "rb") as handle, pytest.raises(DdpkitError, match=r"is not DCP metadata \(it holds a Size\)"):
        dcp_reader.load_metadata(handle, file)


# -- damaged checkpoints: one line, never cut inside a sentence ------------------------------


def _whole_sentences_of(part: str, whole: str) -> bool:
    return part == whole or (whole.startswith(part) and part.endswith((".", "!", "?")) and whole[len(part)] == " ")


def test_a_truncated_checkpoint_is_one_line_cut_only_between_sentences(tmp_path):
    rt = ddpkit.init(seed=0)
    path = rt.save(tmp_path / "c.pt", {"model": torch.nn.Linear(30, 30)}, blocking=True)
    rt.close()
    data = path.read_bytes()
    path.with_name(path.name + ".sha256").unlink()  # as a file saved by hand: torch.load finds it
    for cut in (10, 100, len(data) // 2):
        path.write_bytes(data[:cut])
        with pytest.raises(DdpkitError) as caught:
            checkpoint.read(path)
        said = str(caught.value)
        assert "\n" not in said and said.startswith(f"checkpoint {path} cannot be read (")
        try:
            torch.load(path, weights_only=True)
        except Exception as exc:  # noqa: BLE001 (whatever torch says)
            torch_said = " ".join(str(exc).split())
        reason = said[len(f"checkpoint {path} cannot be read (") :].rsplit("); ", 1)[0]
        assert _whole_sentences_of(reason, torch_said), (reason, torch_said)


def test_a_truncated_sharded_checkpoint_is_one_line(made, tmp_path):
    for name in ("ddpkit.pt", ".metadata"):
        step = shutil.copytree(made["clean"], tmp_path / name / made["clean"].name)
        data = (step / name).read_bytes()
        (step / name).write_bytes(data[: len(data) // 2])
        _reseal(step)
        with pytest.raises(DdpkitError) as caught:
            checkpoint.read(step)
        said = str(caught.value)
        assert (
            "\n" not in said
            and said.startswith(f"checkpoint {step / name} cannot be read (")
            and said.endswith("; it is damaged")
        ), said


def test_one_line_shortens_between_sentences_only():
    text = "First part: what failed. Second sentence here.\nThird sentence, long " + "x" * 200 + "."
    assert one_line(text) == "First part: what failed. Second sentence here."
    assert one_line("One very long sentence " + "y" * 300) == "One very long sentence " + "y" * 300
    assert one_line("a\n\tb  c") == "a b c"


def test_a_crafted_loader_position_in_a_resealed_checkpoint_is_refused_in_one_line(tmp_path):
    """A saved loader signature whose lengths= digest is not text (an int) made the refusal itself raise a
    TypeError while it described the saved signature; it is one line naming both."""

    def run() -> int:
        with ddpkit.init(seed=0, checkpoint_dir=str(tmp_path), resume="auto") as rt:
            data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.arange(40) % 2)
            net = torch.nn.Linear(4, 2)
            model, opt = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
            loader = rt.loader(data, global_batch_size=8, shuffle=True, lengths=[i % 5 for i in range(40)])
            state = {"model": model, "opt": opt}
            rt.resume(state)
            for x, y in loader:
                rt.backward(torch.nn.functional.cross_entropy(model(x), y))
                rt.step(opt)
                if rt.global_step == 2:
                    rt.checkpoint(state, blocking=True)
                    break
            return rt.global_step

    assert run() == 2
    (path,) = tmp_path.glob("ckpt-*.pt")
    saved = torch.load(path, weights_only=True)
    signatures = [v["signature"] for v in saved["ddpkit"]["loop"]["loaders"].values()]
    assert signatures and all("by_length" in s for s in signatures)
    for signature in signatures:
        signature["by_length"] = 5
    torch.save(saved, path)
    data = path.read_bytes()  # the record written again to match, so verification passes
    path.with_name(path.name + ".sha256").write_text(
        json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)})
    )
    with pytest.raises(DdpkitError) as raised:
        run()
    said = str(raised.value)
    assert "\n" not in said and "lengths= 5" in said and "build the loader as it was saved" in said
