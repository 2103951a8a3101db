"""A state dict saved by hand, ``torch.save(model.state_dict(), path)`` on rank 0 as the blog posts do,
loads into the set-up model on any number of processes.

DDP names the entries ``module.0.weight`` on 2 processes; one process names them ``0.weight``; so
``model.load_state_dict(torch.load(path))`` failed whenever the file came from the other number of
processes ("Unexpected key(s) in state_dict: module.0.weight ...").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ddpkit
from ddpkit._torch import unwrap


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def _save(path: str) -> None:
    rt = ddpkit.init(seed=0)
    model = rt.setup(_model())
    with torch.no_grad():
        for index, parameter in enumerate(model.parameters()):
            parameter.add_(index + 1)
    model.train()
    model(torch.randn(6, 4))  # BatchNorm statistics and its count move too
    if rt.is_main:
        torch.save(model.state_dict(), path)
    rt.close()


def _load(paths: list[str]) -> list[dict]:
    """Each file loaded into a freshly set-up model: its plain state after the load, or what the load said."""
    rt = ddpkit.init(seed=0)
    found = []
    for path in paths:
        model = rt.setup(_model())
        try:
            model.load_state_dict(torch.load(path, weights_only=True))
        except RuntimeError as exc:
            found.append({"error": str(exc)})
            continue
        found.append({k: v.clone() for k, v in unwrap(model).state_dict().items()})
    rt.close()
    return found


@pytest.mark.timeout(120)
def test_a_state_dict_saved_by_hand_loads_on_another_number_of_processes(tmp_path):
    one, two = str(tmp_path / "one.pt"), str(tmp_path / "two.pt")
    _save(one)
    ddpkit.launch(_save, nprocs=2, args=(two,))
    assert next(iter(torch.load(two, weights_only=True))).startswith("module.")  # DDP's names, as written
    assert not next(iter(torch.load(one, weights_only=True))).startswith("module.")
    expected = _load([one])[0]
    assert "error" not in expected and expected["1.num_batches_tracked"] == 1
    for found in [
        *_load([one, two]),
        *(state for states in ddpkit.launch(_load, nprocs=2, args=([one, two],)).values() for state in states),
    ]:
        assert found.keys() == expected.keys()
        for key, value in expected.items():  # the 2-process file's BatchNorm statistics are rank 0's
            if key.startswith("1.running") or key.endswith("num_batches_tracked"):
                assert found[key].shape == value.shape, key
            else:
                assert torch.equal(found[key], value), key


def test_a_state_dict_of_another_model_is_still_refused_by_torch(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"module.0.weight": torch.zeros(8, 4), "module.9.weight": torch.zeros(2, 8)}, path)
    rt = ddpkit.init(seed=0)
    model = rt.setup(_model())
    before = unwrap(model)[0].weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"module.9.weight\""):
        model.load_state_dict(torch.load(path, weights_only=True))
    model.load_state_dict(torch.load(path, weights_only=True), strict=False)  # what matches loads, as torch's own
    assert torch.equal(unwrap(model)[0].weight, torch.zeros(8, 4)) and not torch.equal(before, torch.zeros(8, 4))
    rt.close()


def test_a_module_that_holds_the_set_up_model_loads_in_its_own_names(tmp_path: Path):
    """``AveragedModel(model)`` loads its own state as before: the hook leaves a load from a parent alone."""
    rt = ddpkit.init(seed=0)
    model = rt.setup(_model())
    average = torch.optim.swa_utils.AveragedModel(model)
    saved = average.state_dict()
    average.load_state_dict(saved)
    assert all(torch.equal(saved[k], v) for k, v in average.state_dict().items())
    rt.close()


def test_the_callers_state_dict_is_left_as_it_was(tmp_path):
    """torch reads the caller's own ``_metadata`` (each module's version): renamed for the load, put back after."""
    rt = ddpkit.init(seed=0)
    model = rt.setup(_model())
    plain = _model().state_dict()
    wrapped = type(plain)((f"module.{k}", v) for k, v in plain.items())
    wrapped._metadata = type(plain._metadata)((f"module.{k}" if k else "", v) for k, v in plain._metadata.items())
    before = dict(wrapped._metadata)
    model.load_state_dict(wrapped)
    assert list(wrapped) == [f"module.{k}" for k in plain] and dict(wrapped._metadata) == before
    assert torch.equal(unwrap(model)[0].weight, plain["0.weight"])
    rt.close()
