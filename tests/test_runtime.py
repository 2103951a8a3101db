"""The runtime in one process: identity collectives, rank-0 printing, and the group's life."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.distributed.host import free_port
from ddpkit.errors import DdpkitError
from helpers import clean_env, python


def test_world_of_one_needs_no_process_group(capsys):
    rt = ddpkit.init()
    assert (rt.rank, rt._env.local_rank, rt.world_size, rt._env.node_rank) == (0, 0, 1, 0)
    assert rt.is_main and rt._env.launcher == "none" and rt._backend == "gloo"
    assert rt.device == torch.device("cpu")
    assert not dist.is_initialized()
    assert ddpkit.init() is rt
    rt.print("hello")
    assert capsys.readouterr().out == "hello\n"


class _Writes:
    """A stream that records each ``write`` call, as a shared pipe would see them."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_print_hands_each_line_to_the_stream_in_one_write():
    rt = ddpkit.init()
    stream = _Writes()
    rt.print("a", 1, "b", sep="-", file=stream)
    rt.print("x", all_ranks=True, end="!\n", file=stream)
    assert stream.calls == ["a-1-b\n", "x!\n"]  # builtin print under PYTHONUNBUFFERED makes 4 writes


def test_collectives_are_identity_in_one_process():
    rt = ddpkit.init()
    value = torch.tensor([1.0, 2.0])
    assert torch.equal(rt.all_reduce(value, op="mean"), value)
    assert rt.all_reduce(3) == 3.0
    assert torch.equal(rt.all_gather(torch.ones(2, 3)), torch.ones(2, 3))
    assert ddpkit.broadcast_object({"a": 1}) == {"a": 1}
    rt.barrier()


def test_unknown_reduce_op_is_a_usage_error():
    with pytest.raises(ddpkit.UsageError, match="unknown reduce op"):
        ddpkit.all_reduce(1, op="median")


def _single_rank_env(monkeypatch):
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(name, value)


def test_group_destroyed_when_the_block_raises(monkeypatch):
    _single_rank_env(monkeypatch)
    with pytest.raises(RuntimeError, match="user bug"):
        with ddpkit.init(backend="gloo") as rt:
            assert dist.is_initialized() and rt._env.launcher == "torchelastic"
            raise RuntimeError("user bug")
    assert not dist.is_initialized()
    assert ddpkit.current() is None


@pytest.mark.timeout(60)
def test_group_destroyed_at_exit_when_script_raises(tmp_path):
    # An atexit hook registered before init runs after ddpkit's own (atexit is LIFO).
    script = tmp_path / "raises.py"
    script.write_text(
        textwrap.dedent("""
        import atexit
        import torch.distributed as dist
        atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
        import ddpkit
        rt = ddpkit.init()
        print("initialized:", dist.is_initialized(), flush=True)
        raise SystemExit("script failed")
    """)
    )
    env = clean_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = python(str(script), env=env, timeout=60)
    assert result.returncode == 1
    assert "initialized: True" in result.stdout
    assert "initialized at exit: False" in result.stdout


@pytest.mark.slow  # 6 s: make test-slow (a connect that times out)
@pytest.mark.timeout(60)
def test_unreachable_master_names_host_and_port(monkeypatch):
    port = free_port()
    for name, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(DdpkitError, match=f"could not reach the master at 127.0.0.1:{port} within 2s"):
        ddpkit.init(timeout=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no GPU")
def test_nccl_without_cuda_is_refused():
    with pytest.raises(ddpkit.UsageError, match="nccl"):
        ddpkit.init(backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_more_processes_than_gpus_with_nccl(monkeypatch):
    count = torch.cuda.device_count()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(count + 1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(count + 1))
    with pytest.raises(DdpkitError, match="visible GPU"):
        ddpkit.init()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_device_follows_local_rank():
    rt = ddpkit.init()
    assert rt.device == torch.device("cuda", 0) and rt._backend == "nccl"


@pytest.mark.parametrize("name", ["checkpoint_dir", "out_dir"])
def test_a_directory_that_is_a_file_or_cannot_be_written_is_refused_at_init(tmp_path, monkeypatch, name):
    """Refused in one line at ddpkit.init: before, a checkpoint_dir that was a file trained an epoch and then
    failed in the background save with "[Errno 17] File exists"."""
    (tmp_path / "afile").write_text("x")
    for given in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        with pytest.raises(
            ddpkit.UsageError, match=rf"{name}='.*': .*afile is a file, not a directory; give a directory"
        ):
            ddpkit.init(**{name: given})
    writable = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(tmp_path) else writable(path, mode))
    with pytest.raises(
        ddpkit.UsageError,
        match=rf"{name}='.*new': this user cannot write in {tmp_path}; give a directory it can write in$",
    ):
        ddpkit.init(**{name: tmp_path / "new"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing made

    def cannot_look(path: object) -> bool:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(tmp_path), "exists", cannot_look)  # a part of the path this user may not look into
    with pytest.raises(ddpkit.UsageError, match=rf"{name}='.*': Permission denied \(.*\); give a directory"):
        ddpkit.init(**{name: tmp_path / "new"})
