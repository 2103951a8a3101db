"""The table of bad inputs: one line saying what is wrong and how to fix it, no traceback,
exit 2 for usage errors, and nothing lost or overwritten."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddpkit
from ddpkit import checkpoint, cli
from ddpkit.recipes.models import build_model
from helpers import EXAMPLES, clean_env

HELLO = str(EXAMPLES / "hello.py")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Config files, data directories and checkpoints, good and bad, made once."""
    root = tmp_path_factory.mktemp("bad")
    (root / "unknown.yaml").write_text("model: convnet\nlearning_rate: 0.1\n")
    (root / "broken.toml").write_text("epochs = = 3\n")
    (root / "typed.yaml").write_text("epochs: many\n")
    (root / "list.yaml").write_text("- model\n- convnet\n")
    (root / "config.json").write_text("{}")
    (root / "not_a_dir").write_text("x")
    (root / "empty_mnist").mkdir()
    bad_mnist = root / "bad_mnist"
    bad_mnist.mkdir()
    for name in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        (bad_mnist / name).write_bytes(b"\x00\x00\x00\x99" + b"garbage!" * 8)
    (root / "empty_cifar").mkdir()
    (root / "ckpt-step00000003").mkdir()
    (root / "rows.csv").mkdir()
    (root / "manifest.json").write_text(
        '{"name": "a project of its own"}'
    )  # not a checkpoint's  # a sharded checkpoint's step directory, by its name

    recipe = {
        "model": "convnet",
        "data": "digits",
        "num_classes": 10,
        "in_channels": 1,
        "image_size": 8,
        "precision": "fp32",
        "sync_bn": False,
    }
    convnet = build_model("convnet", num_classes=10, in_channels=1, image_size=8)
    rt = ddpkit.init()
    good = rt.save(root / "good.pt", {"model": convnet, "recipe": recipe})
    mlp = rt.save(
        root / "mlp.pt", {"model": build_model("mlp", num_classes=10, in_channels=1, image_size=8), "recipe": recipe}
    )
    rt.close()
    fp16 = ddpkit.init(precision="fp16")
    other_precision = fp16.save(root / "fp16.pt", {"model": convnet, "recipe": recipe})
    fp16.close()
    data = good.read_bytes()
    (root / "truncated.pt").write_bytes(data[: len(data) // 2])
    (root / "truncated.pt.sha256").write_text((root / "good.pt.sha256").read_text())
    flipped = bytearray(data)
    flipped[len(flipped) // 3] ^= 0xFF
    (root / "corrupt.pt").write_bytes(bytes(flipped))
    (root / "corrupt.pt.sha256").write_text((root / "good.pt.sha256").read_text())
    payload = checkpoint.read(good)
    payload["version"], payload["ddpkit_version"] = 99, "9.9.0"
    checkpoint.write(root / "newer.pt", payload)
    (root / "random.pt").write_bytes(os.urandom(2048))

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {root / 'pwned'}",))

    torch.save({"format": checkpoint.FORMAT, "version": 1, "user": {"model": Exploit()}}, root / "evil.pt")
    (root / "best.pt").write_bytes(good.read_bytes())  # a checkpoint copied by hand: no record, a name of its own
    sums = {"good": sha256(good), "mlp": sha256(mlp)}
    return {"root": root, "good": good, "mlp": mlp, "fp16": other_precision, "sums": sums}


def sha256(path):
    return (
        hashlib.sha256(path.read_bytes()).hexdigest() + hashlib.sha256(Path(f"{path}.sha256").read_bytes()).hexdigest()
    )


def _p(files, name):
    return str(files["root"] / name)


# (case id, argv builder, message expected in the one line)
CASES = [
    # command-line flags
    ("run-unknown-flag", lambda f: ["run", "--frobnicate", HELLO], "unknown option '--frobnicate'"),
    ("run-zero-procs", lambda f: ["run", "-n", "0", HELLO], "must be at least 1"),
    ("run-master-no-port", lambda f: ["run", "--master", "nohost", HELLO], "has no port"),
    ("run-port-range", lambda f: ["run", "--master", "h:65536", HELLO], "out of range"),
    ("run-missing-script", lambda f: ["run", "nope.py"], "script 'nope.py' not found"),
    ("run-missing-module", lambda f: ["run", "-n", "2", "-m", "nope_ddpkit"], "module 'nope_ddpkit' not found"),
    ("ft-missing-script", lambda f: ["run", "--fault-tolerant", "-n", "2", "nope.py"], "script 'nope.py' not found"),
    (
        "run-node-rank-outside",
        lambda f: ["run", "--nnodes", "2", "--node-rank", "2", "--master", "h:1", HELLO],
        "outside 0..1",
    ),
    ("train-unknown-model", lambda f: ["train", "--model", "gpt"], "unknown model 'gpt'"),
    ("train-unknown-data", lambda f: ["train", "--data", "imagenet"], "unknown data 'imagenet'"),
    ("train-batch-not-divisible", lambda f: ["train", "--nproc", "3"], "global batch 64 does not divide by --nproc 3"),
    ("train-negative-lr", lambda f: ["train", "--lr", "-1"], "--lr must be positive"),
    ("train-unknown-flag", lambda f: ["train", "--learning-rate", "1"], "unrecognized arguments"),
    (
        "predict-suffix",
        lambda f: ["predict", "--checkpoint", str(f["good"]), "--out", _p(f, "o.xlsx")],
        "unknown suffix '.xlsx'",
    ),
    ("demo-zero", lambda f: ["demo", "--nproc", "0"], "at least 1"),
    # config files
    ("config-unknown-key", lambda f: ["train", "--config", _p(f, "unknown.yaml")], "unknown setting(s) learning_rate"),
    ("config-parse-error", lambda f: ["train", "--config", _p(f, "broken.toml")], "cannot be parsed"),
    ("config-wrong-type", lambda f: ["train", "--config", _p(f, "typed.yaml")], "epochs must be an integer"),
    ("config-not-mapping", lambda f: ["train", "--config", _p(f, "list.yaml")], "must hold a mapping"),
    ("config-suffix", lambda f: ["train", "--config", _p(f, "config.json")], "use a .yaml, .yml or .toml"),
    # data paths
    ("mnist-no-dir", lambda f: ["train", "--data", "mnist"], "needs --data-dir"),
    ("data-dir-is-file", lambda f: ["train", "--data", "mnist", "--data-dir", _p(f, "not_a_dir")], "not a directory"),
    (
        "mnist-files-missing",
        lambda f: ["train", "--data", "mnist", "--data-dir", _p(f, "empty_mnist")],
        "train-images-idx3-ubyte",
    ),
    ("mnist-corrupt", lambda f: ["train", "--data", "mnist", "--data-dir", _p(f, "bad_mnist")], "magic"),
    (
        "cifar-files-missing",
        lambda f: ["train", "--data", "cifar10", "--data-dir", _p(f, "empty_cifar")],
        "data_batch_1",
    ),
    # checkpoints
    ("ckpt-missing", lambda f: ["train", "--resume", _p(f, "absent.pt")], "does not exist"),
    (
        "ckpt-truncated",
        lambda f: ["train", "--resume", _p(f, "truncated.pt")],
        "is truncated: .* bytes of .* written; resume from an earlier checkpoint",
    ),
    (
        "ckpt-corrupt",
        lambda f: ["train", "--resume", _p(f, "corrupt.pt")],
        "is corrupted: .*; resume from an earlier checkpoint",
    ),
    (
        "ckpt-other-model",
        lambda f: ["train", "--resume", str(f["mlp"])],
        "is for another model: .*; build the model the checkpoint was saved from",
    ),
    ("ckpt-other-precision", lambda f: ["train", "--resume", str(f["fp16"])], "precision 'fp16'"),
    ("ckpt-newer-ddpkit", lambda f: ["train", "--resume", _p(f, "newer.pt")], "newer ddpkit"),
    ("ckpt-not-a-checkpoint", lambda f: ["train", "--resume", _p(f, "random.pt")], "cannot be read"),
    ("ckpt-malicious", lambda f: ["train", "--resume", _p(f, "evil.pt")], "refuses to unpickle"),
    # an output that would replace a checkpoint, its record, or a directory, --overwrite or not
    (
        "export-out-is-its-checkpoint",
        lambda f: ["export", "--checkpoint", str(f["good"]), "--out", str(f["good"]), "--overwrite"],
        "is a checkpoint or lies in one; write elsewhere",
    ),
    (
        "export-out-is-another-checkpoint",
        lambda f: ["export", "--checkpoint", str(f["good"]), "--out", str(f["mlp"]), "--overwrite"],
        "is a checkpoint or lies in one",
    ),
    (
        "export-out-is-a-record",
        lambda f: ["export", "--checkpoint", str(f["good"]), "--out", _p(f, "mlp.pt.sha256"), "--overwrite"],
        "is a checkpoint record",
    ),
    (
        "export-out-in-a-step-directory",
        lambda f: ["export", "--checkpoint", str(f["good"]), "--out", _p(f, "ckpt-step00000003/m.pt")],
        "lies in one",
    ),
    (
        "export-out-in-a-step-directory-not-made-yet",
        lambda f: ["export", "--checkpoint", str(f["good"]), "--out", _p(f, "ckpt-step00000009/m.pt")],
        "lies in one",
    ),
    (
        "export-out-is-the-checkpoint-read-renamed",
        lambda f: ["export", "--checkpoint", _p(f, "best.pt"), "--out", _p(f, "best.pt"), "--overwrite"],
        "is a checkpoint or lies in one",
    ),
    (
        "export-out-is-a-directory",
        lambda f: ["export", "--checkpoint", str(f["good"]), "--out", _p(f, "empty_mnist"), "--overwrite"],
        "is a directory; give the path of the file to write",
    ),
    (
        "predict-out-is-its-checkpoint",
        lambda f: ["predict", "--checkpoint", str(f["good"]), "--out", str(f["good"]), "--overwrite"],
        "is a checkpoint or lies in one",
    ),
    (
        "predict-out-is-a-directory",
        lambda f: ["predict", "--checkpoint", str(f["good"]), "--out", _p(f, "rows.csv"), "--overwrite"],
        "is a directory",
    ),
    (
        "predict-ckpt-other-model",
        lambda f: ["predict", "--checkpoint", str(f["mlp"]), "--out", _p(f, "p.csv")],
        "is for another model",
    ),
]


@pytest.mark.parametrize("case, argv, message", CASES, ids=[c[0] for c in CASES])
def test_cli_bad_input(files, tmp_path, capsys, case, argv, message):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    args = argv(files)
    if args[0] == "train":
        args = args + ["--out", str(out), "--overwrite"]
    before = sorted(os.listdir(files["root"]))
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert message in lines[0] or re.search(message, lines[0]), lines[0]  # text, or a pattern
    assert "Traceback" not in err
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"
    assert sorted(os.listdir(files["root"])) == before  # nothing written beside the inputs
    assert not (files["root"] / "pwned").exists()
    assert sha256(files["good"]) == files["sums"]["good"] and sha256(files["mlp"]) == files["sums"]["mlp"]
    assert (files["root"] / "best.pt").read_bytes() == files["good"].read_bytes()


def test_an_out_beside_a_manifest_of_a_projects_own_is_written(files, tmp_path, capsys):
    """Only a ddpkit sharded checkpoint's manifest.json makes a directory a checkpoint, not a web
    project's or a data set's, nor one in a directory above."""
    for out in (files["root"] / "m.pt", files["root"] / "sub" / "m.pt"):
        try:
            assert cli.main(["export", "--checkpoint", str(files["good"]), "--out", str(out)]) == 0
            assert "wrote" in capsys.readouterr().out and torch.load(out, weights_only=True)
        finally:
            out.unlink(missing_ok=True)
            if out.parent != files["root"]:
                out.parent.rmdir()


def _script_env_case(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, HELLO], env=clean_env(**env), capture_output=True, text=True, timeout=60)


def _taken_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


ENV_CASES = [
    ("world-size-mismatch", {"RANK": "3", "WORLD_SIZE": "2"}, "rank 3 is outside the world of size 2"),
    ("missing-world-size", {"RANK": "0"}, "RANK set but WORLD_SIZE missing"),
    ("missing-rank", {"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "WORLD_SIZE, LOCAL_RANK set but RANK missing"),
    ("not-a-number", {"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ("bad-port", {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not a valid port"),
    ("port-taken", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "is already in use"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case, env, message", ENV_CASES, ids=[c[0] for c in ENV_CASES])
def test_environment_bad_input(monkeypatch, case, env, message):
    """A script run with each environment; where nothing is bound yet, ``ddpkit.init`` in this process
    (the script's one line and exit code 2 are the first case's and the taken port's)."""
    if case not in ("world-size-mismatch", "port-taken"):
        for name in set(os.environ) - set(clean_env()):
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(ddpkit.UsageError) as refused:
            ddpkit.init()
        assert message in str(refused.value) and "\n" not in str(refused.value)
        return
    sock = _taken_port() if case == "port-taken" else None
    try:
        if sock is not None:
            env = {**env, "MASTER_PORT": str(sock.getsockname()[1])}
        result = _script_env_case(env)
    finally:
        if sock is not None:
            sock.close()
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_the_table_is_long_enough():
    assert len(CASES) + len(ENV_CASES) >= 25
