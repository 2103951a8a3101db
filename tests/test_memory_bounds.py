"""Loading any file bounds memory by the file: a record that declares more than its bytes is refused first.

Written as an attacker would: a ``.pt`` whose storage record is deflated zeros (a few kB that
``torch.load`` would inflate to tens of MB, 1000 times the file), one whose pickle declares a
storage far larger than its record, and DCP checkpoints whose metadata declares more than their
files hold; each with its checksums written again so that verification vouches for it. Every path
that loads a checkpoint refuses in one line, exit 2 on the command line, before ``torch.load``
allocates anything.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

import ddpkit
from ddpkit import _bounds, checkpoint
from ddpkit.checkpoint import dcp_reader
from ddpkit.errors import UnsafeCheckpoint
from helpers import ddpkit as ddpkit_cli


def _archive(value: object) -> tuple[dict[str, bytes], str]:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    with zipfile.ZipFile(buffer) as archive:
        records = {name: archive.read(name) for name in archive.namelist()}
    return records, next(name for name in records if name.endswith("data.pkl"))[: -len("data.pkl")]


def _declare(pkl: bytes, numel: int) -> bytes:
    """The pickle of ``torch.zeros(4)`` with its storage and size saying ``numel`` elements."""
    four = numel.to_bytes(4, "little")
    return pkl.replace(b"K\x04t", b"J" + four + b"t", 1).replace(b"K\x00K\x04\x85", b"K\x00J" + four + b"\x85", 1)


def inflated(declared: int, value: object = None) -> bytes:
    """``torch.save`` bytes whose storage record is ``declared`` bytes of zeros, deflated."""
    records, prefix = _archive({"w": torch.zeros(4)} if value is None else value)
    records[prefix + "data.pkl"] = _declare(records[prefix + "data.pkl"], declared // 4)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in records.items():
            if name == prefix + "data/0":
                info = zipfile.ZipInfo(name)
                info.compress_type = zipfile.ZIP_DEFLATED
                with archive.open(info, "w") as handle:
                    chunk = bytes(1 << 20)
                    for _ in range(declared // len(chunk)):
                        handle.write(chunk)
            else:
                archive.writestr(name, data)
    return out.getvalue()


def short(declared: int) -> bytes:
    """``torch.save`` bytes whose pickle declares a storage of ``declared`` bytes over a 16-byte record."""
    records, prefix = _archive({"w": torch.zeros(4)})
    records[prefix + "data.pkl"] = _declare(records[prefix + "data.pkl"], declared // 4)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in records.items():
            archive.writestr(name, data)
    return out.getvalue()


def test_the_bound_refuses_what_declares_more_than_it_holds_and_passes_what_torch_saves():
    bomb = inflated(64 << 20)
    assert len(bomb) * 500 < 64 << 20
    with pytest.raises(_bounds.Disproportionate, match=r"record \S+data/0 is compressed \(67108864 bytes from"):
        _bounds.check(bomb, "bomb.pt")
    with pytest.raises(_bounds.Disproportionate, match="storage 0 declares 1073741824 bytes in a record of 16"):
        _bounds.check(short(1 << 30), "short.pt")
    legacy = io.BytesIO()
    torch.save(torch.ones(3), legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(_bounds.Disproportionate, match="legacy format"):
        _bounds.check(legacy.getvalue(), "old.pt")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    clean = io.BytesIO()
    torch.save(
        {
            "m": model.state_dict(),
            "o": optimizer.state_dict(),
            "view": torch.arange(10.0)[2:5],
            "half": torch.ones(3, dtype=torch.bfloat16),
            "p": torch.nn.Parameter(torch.ones(2)),
            "plain": [1, 2.5, (3, "a")],
        },
        clean,
    )
    _bounds.check(clean, "clean.pt")
    assert clean.tell() == len(clean.getvalue())  # the position is given back


def _reseal_file(path: Path) -> None:
    data = path.read_bytes()
    path.with_name(path.name + ".sha256").write_text(
        json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)})
    )


def _one_line_exit_2(result, command: str, says: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"ddpkit {command}: error: checkpoint "), result.stderr[-3000:]
    assert says in lines[0] and "ddpkit refuses to load it" in lines[0], lines[0]


@pytest.mark.parametrize("kind", ["inflated", "short"])
def test_an_inflating_single_file_checkpoint_is_refused_on_every_path(tmp_path, monkeypatch, kind):
    rt = ddpkit.init(seed=0)
    model = torch.nn.Linear(3, 2)
    path = rt.save(tmp_path / "ckpts", {"model": model}, blocking=True)
    payload = torch.load(path, weights_only=True)
    payload["user"]["model"]["weight"] = torch.zeros(4)
    records, prefix = _archive(payload)
    bomb = inflated(64 << 20, payload) if kind == "inflated" else None
    if bomb is None:  # the weight's storage (the first) declares 64 MiB over its 16 bytes
        records[prefix + "data.pkl"] = _declare(records[prefix + "data.pkl"], 16 << 20)
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as archive:
            for name, data in records.items():
                archive.writestr(name, data)
        bomb = out.getvalue()
    path.write_bytes(bomb)
    _reseal_file(path)
    checkpoint.verify(path)  # the checksums vouch for it
    says = "is compressed" if kind == "inflated" else "declares"
    real_load = torch.load
    monkeypatch.setattr(
        torch, "load", lambda *a, **k: pytest.fail("torch.load reached") if a and a[0] == path else real_load(*a, **k)
    )
    for load in (lambda: rt.load(path, {"model": model}), lambda: checkpoint.read(path)):
        with pytest.raises(UnsafeCheckpoint) as caught:
            load()
        assert says in str(caught.value) and "\n" not in str(caught.value)
    rt.close()
    rt = ddpkit.init(seed=0, checkpoint_dir=path.parent, resume="auto")
    with pytest.raises(UnsafeCheckpoint, match=says):
        rt.resume({"model": model})
    rt.close()
    monkeypatch.undo()
    if kind == "inflated":  # the command lines read through the same function: once is enough
        _one_line_exit_2(
            ddpkit_cli("export", "--checkpoint", str(path), "--out", str(tmp_path / "m.pt")), "export", says
        )
        _one_line_exit_2(
            ddpkit_cli("predict", "--checkpoint", str(path.parent), "--out", str(tmp_path / "p.csv")), "predict", says
        )
    path.with_name(path.name + ".sha256").unlink()  # no checksum beside it: bounded all the same
    with pytest.raises(UnsafeCheckpoint, match=says):
        checkpoint.read(path)
    assert not (tmp_path / "m.pt").exists()


def _sharded(root: Path) -> Path:
    from test_checkpoint_attacks import _write_sharded

    return _write_sharded(root)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return _sharded(tmp_path_factory.mktemp("sharded") / "clean")


def _edit_metadata(step: Path, edit) -> None:
    from test_checkpoint_attacks import _reseal

    with open(step / ".metadata", "rb") as handle:
        metadata = dcp_reader.load_metadata(handle, step / ".metadata")
    edit(metadata)
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(step)


def _first_tensor(metadata):
    fqn, item = next((k, v) for k, v in metadata.state_dict_metadata.items() if getattr(v, "chunks", None))
    chunk = item.chunks[0]
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return fqn, item, chunk, metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]


def _grow(metadata):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    fqn, item, chunk, info = _first_tensor(metadata)
    del metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
    chunk.sizes = torch.Size([1 << 28])
    item.size = torch.Size([1 << 28])
    metadata.storage_data[MetadataIndex(fqn, chunk.offsets)] = info


def _transform(metadata):
    _first_tensor(metadata)[3].transform_descriptors = ["zstd"]


def _past_the_end(metadata):
    _first_tensor(metadata)[3].length += 1 << 30


def _overlap(metadata):
    infos = sorted(metadata.storage_data.values(), key=lambda info: info.offset)
    infos[1].offset = infos[0].offset


def _outside(metadata):
    _first_tensor(metadata)[3].relative_path = "../../etc/hostname"


@pytest.mark.parametrize(
    "edit, says",
    [
        (_grow, "declares 1073741824 bytes in an item of"),
        (_transform, "is stored through ['zstd']"),
        (_past_the_end, "spans bytes"),
        (_overlap, "two items overlap"),
        (_outside, "not a file of the checkpoint"),
    ],
)
def test_sharded_metadata_that_declares_more_than_its_files_is_refused(sharded, tmp_path, edit, says):
    step = shutil.copytree(sharded, tmp_path / sharded.name)
    _edit_metadata(step, edit)
    checkpoint.verify(step)
    with pytest.raises(UnsafeCheckpoint) as caught:
        checkpoint.read(step)
    assert says in str(caught.value) and "ddpkit refuses to load it" in str(caught.value)
    assert "\n" not in str(caught.value)
    if edit is _grow:  # the command line reads through the same function: once is enough
        _one_line_exit_2(
            ddpkit_cli("export", "--checkpoint", str(step), "--out", str(tmp_path / "m.pt")), "export", says
        )


def test_a_sharded_tensor_whose_record_is_compressed_is_refused(sharded, tmp_path):
    step = shutil.copytree(sharded, tmp_path / sharded.name)
    bomb = inflated(64 << 20)
    (step / "__9_0.distcp").write_bytes(bomb)

    def point(metadata):
        info = _first_tensor(metadata)[3]
        info.relative_path, info.offset, info.length = "__9_0.distcp", 0, len(bomb)

    _edit_metadata(step, point)
    with pytest.raises(UnsafeCheckpoint, match="is compressed"):
        checkpoint.read(step)


@pytest.mark.parametrize(
    "value", [[1, 2, 3], pytest.param(torch.ones(2), marks=pytest.mark.slow)]
)  # (a tensor: make test-slow)
def test_a_code_free_but_wrong_ddpkit_pt_is_one_line_exit_2_on_every_command(sharded, tmp_path, value):
    from test_checkpoint_attacks import _reseal

    step = shutil.copytree(sharded, tmp_path / sharded.name)
    torch.save(value, step / "ddpkit.pt")
    _reseal(step)
    for command in (
        ["export", "--checkpoint", str(step), "--out", str(tmp_path / "m.pt")],
        ["predict", "--checkpoint", str(step), "--out", str(tmp_path / "p.csv")],
    ):
        done = ddpkit_cli(*command)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
        assert "Warning" not in done.stderr
        # export reads the step named; predict takes a directory as "the newest complete checkpoint in it"
        assert ("does not hold ddpkit's state" if command[0] == "export" else "no complete checkpoint") in lines[0]
