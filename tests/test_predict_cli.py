"""`ddpkit predict` end to end: input order on any number of processes, and its bad input."""

from __future__ import annotations

import csv
import os

import numpy as np
import pytest
import torch

import ddpkit
from ddpkit.recipes.models import build_model
from helpers import ddpkit as ddpkit_cli

RECIPE = {
    "model": "convnet",
    "data": "digits",
    "num_classes": 10,
    "in_channels": 1,
    "image_size": 8,
    "precision": "fp32",
    "sync_bn": False,
}


def _checkpoint(path, model_name="convnet", recipe=RECIPE):
    torch.manual_seed(0)
    model = build_model(model_name, num_classes=10, in_channels=1, image_size=8)
    rt = ddpkit.init()
    rt.save(path, {"model": model, "recipe": dict(recipe)})
    rt.close()
    return path


@pytest.fixture(scope="module")
def digits_checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("ckpt") / "convnet.pt")


def _rows(path):
    with open(path) as handle:
        return list(csv.reader(handle))


@pytest.mark.slow  # 10-16 s: make test-slow keeps make test under 15 minutes
@pytest.mark.timeout(300)
def test_three_processes_keep_input_order_and_match_one(digits_checkpoint, tmp_path):
    outputs = {}
    for nproc in (1, 3):
        out = tmp_path / f"pred{nproc}.csv"
        result = ddpkit_cli(
            "predict",
            "--checkpoint",
            str(digits_checkpoint),
            "--data",
            "digits",
            "--split",
            "test",
            "--nproc",
            str(nproc),
            "--out",
            str(out),
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        outputs[nproc] = _rows(out)
    header = outputs[3][0]
    assert header == ["index", "prediction"] + [f"prob_{c}" for c in range(10)]
    assert [int(r[0]) for r in outputs[3][1:]] == list(range(360))
    assert [r[1] for r in outputs[3][1:]] == [r[1] for r in outputs[1][1:]]
    probabilities = np.array([[float(v) for v in r[2:]] for r in outputs[3][1:]])
    assert np.allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
    assert (probabilities.argmax(axis=1) == [int(r[1]) for r in outputs[3][1:]]).all()


@pytest.mark.slow  # 51 s: make test-slow
@pytest.mark.timeout(200)
def test_npy_and_pt_outputs(digits_checkpoint, tmp_path):
    for suffix in (".npy", ".pt"):
        out = tmp_path / f"pred{suffix}"
        result = ddpkit_cli(
            "predict", "--checkpoint", str(digits_checkpoint), "--nproc", "2", "--out", str(out), timeout=90
        )
        assert result.returncode == 0, result.stderr[-3000:]
    probabilities = np.load(tmp_path / "pred.npy")
    saved = torch.load(tmp_path / "pred.pt", weights_only=True)
    assert probabilities.shape == (360, 10)
    assert torch.equal(saved["index"], torch.arange(360))
    assert np.allclose(saved["probabilities"].numpy(), probabilities)


@pytest.mark.slow  # 10-16 s: make test-slow keeps make test under 15 minutes
def test_bad_input(digits_checkpoint, tmp_path):
    existing = tmp_path / "exists.csv"
    existing.write_text("keep me\n")
    wrong_weights = _checkpoint(tmp_path / "mlp.pt", model_name="mlp")  # recipe says convnet
    no_recipe = tmp_path / "norecipe.pt"
    rt = ddpkit.init()
    rt.save(no_recipe, {"model": build_model("mlp", num_classes=10, in_channels=1, image_size=8)})
    rt.close()
    cases = [
        (["--checkpoint", str(wrong_weights), "--out", str(tmp_path / "a.csv")], 2, "is for another model"),
        (["--checkpoint", str(no_recipe), "--out", str(tmp_path / "a.csv")], 2, "has no recipe"),
        (
            ["--checkpoint", str(digits_checkpoint), "--data", "synthetic", "--out", str(tmp_path / "a.csv")],
            2,
            "gives 3x32x32",
        ),
        (
            ["--checkpoint", str(digits_checkpoint), "--out", str(tmp_path / "missing" / "a.csv")],
            2,
            "does not exist; create it first",
        ),
        (["--checkpoint", str(digits_checkpoint), "--out", str(tmp_path / "a.txt")], 2, "unknown suffix '.txt'"),
        (["--checkpoint", str(digits_checkpoint), "--out", str(existing)], 2, "already exists"),
        (["--checkpoint", str(tmp_path / "nope.pt"), "--out", str(tmp_path / "a.csv")], 2, "does not exist"),
        (["--out", str(tmp_path / "a.csv")], 2, "--checkpoint"),
    ]
    for args, code, message in cases:
        result = ddpkit_cli("predict", *args, timeout=60)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == code, (args, result.stderr)
        assert len(lines) == 1 and message in lines[0], (args, result.stderr)
        assert "Traceback" not in result.stderr
    assert existing.read_text() == "keep me\n"
    assert not (tmp_path / "a.csv").exists() and not (tmp_path / "missing").exists()
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["exists.csv", "mlp.pt", "mlp.pt.sha256", "norecipe.pt", "norecipe.pt.sha256"]
    )


@pytest.mark.slow  # 7 s: make test-slow
@pytest.mark.timeout(150)
def test_the_forward_runs_in_the_precision_the_checkpoint_was_trained_in(tmp_path):
    from ddpkit.recipes.datasets import load_dataset

    path = _checkpoint(tmp_path / "bf16.pt", recipe={**RECIPE, "precision": "bf16"})
    out = tmp_path / "pred.csv"
    result = ddpkit_cli(
        "predict",
        "--checkpoint",
        str(path),
        "--data",
        "digits",
        "--split",
        "test",
        "--nproc",
        "1",
        "--out",
        str(out),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    written = np.array([[float(v) for v in r[2:]] for r in _rows(out)[1:]])
    torch.manual_seed(0)
    model = build_model("convnet", num_classes=10, in_channels=1, image_size=8).eval()
    images = torch.stack([x for x, _ in load_dataset("digits", "test", None).dataset])
    with torch.no_grad():
        fp32 = torch.softmax(model(images), dim=1).numpy()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(images)
        bf16 = torch.softmax(logits.float(), dim=1).numpy()
    assert np.allclose(written, bf16, atol=1e-6)
    assert not np.allclose(written, fp32, atol=1e-6)
