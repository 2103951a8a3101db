"""Shared fixtures: every test starts with the launcher variables it expects and no process group."""

from __future__ import annotations

import multiprocessing
import os

import pytest

# ddpkit.launch's children start from a forkserver that imported torch once (a spawned child spends
# ~3 s of CPU importing it again); each launch's children still get that launch's environment and
# streams (entry.FromLauncher). Tests that need spawn itself pass start_method="spawn".
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "ddpkit", "workers"]


@pytest.fixture(autouse=True, scope="session")
def launch_from_a_preloaded_forkserver():
    import ddpkit.distributed.launch as launch

    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    default = launch._start_method
    launch._start_method = lambda fn: "forkserver" if default(fn) == "spawn" else default(fn)
    yield
    launch._start_method = default


# Variables a launcher could have left in the environment of the test runner itself.
_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_", "MPI_LOCAL")
_LAUNCHER_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """Hide launcher variables, restore the environment afterwards, destroy any leftover group."""
    for name in list(os.environ):
        if name in _LAUNCHER_NAMES or name.startswith(_LAUNCHER_PREFIXES):
            monkeypatch.delenv(name, raising=False)
    saved = dict(os.environ)
    yield
    for name in set(os.environ) - set(saved):  # what the test's own code set (ddpkit.init's flight recorder)
        del os.environ[name]
    os.environ.update(saved)
    import torch.distributed as dist

    import ddpkit.runtime

    runtime = ddpkit.runtime.current()
    if runtime is not None:
        runtime.close()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
