"""Shared fixtures: every test starts with the launcher variables it expects and no process group."""

from __future__ import annotations

import os

import pytest

# Variables a launcher could have left in the environment of the test runner itself.
_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_", "MPI_LOCAL")
_LAUNCHER_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """Hide launcher variables, restore the environment afterwards, destroy any leftover group."""
    for name in list(os.environ):
        if name in _LAUNCHER_NAMES or name.startswith(_LAUNCHER_PREFIXES):
            monkeypatch.delenv(name, raising=False)
    yield
    import torch.distributed as dist

    import ddpkit.runtime

    runtime = ddpkit.runtime.current()
    if runtime is not None:
        runtime.close()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
