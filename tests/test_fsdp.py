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
    result = fw.compare(("ddp", "fsdp"))            # a world of one, in this process
    ddpkit.current().close()
    return result


@pytest.fixture(scope="module")
def two():
    return ddpkit.launch(fw.compare, nprocs=2)


def test_fsdp_on_one_process_equals_ddp_and_names_are_plain(one):
    _close(one["fsdp"]["weights"], one["ddp"]["weights"])
    assert list(one["fsdp"]["weights"]) == ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias",
                                            "head.weight", "head.bias"]


@pytest.mark.timeout(240)
def test_fsdp_x2_equals_ddp_x2_and_one_process_with_the_loop_features(one, two):
    for rank in (0, 1):
        run = two[rank]
        assert (run["fsdp"]["weights"] is None) == (rank == 1)        # full_state_dict: rank 0 only
        for variant in ("fsdp", "fsdp-after"):               # the optimizer made before or after setup
            got, want = run[variant]["metrics"], run["ddp"]["metrics"]
            assert [got[k] for k in ("count", "correct", "confusion")] == \
                [want[k] for k in ("count", "correct", "confusion")]
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            torch.testing.assert_close(run[variant]["predicted"], run["ddp"]["predicted"], rtol=0, atol=1e-5)
        assert run["fsdp-acc"]["metrics"]["count"] == 101                     # uneven shards, no hang
        assert run["fsdp-acc"]["norms"] == pytest.approx(run["ddp-acc"]["norms"], rel=1e-5)
    run = two[0]
    _close(run["fsdp"]["weights"], run["ddp"]["weights"])
    _close(run["fsdp-after"]["weights"], run["ddp"]["weights"])
    _close(run["fsdp-acc"]["weights"], run["ddp-acc"]["weights"])          # accumulate + clip
    _close(run["fsdp"]["weights"], one["fsdp"]["weights"])                  # 2 processes = 1
    assert not torch.equal(run["fsdp"]["weights"]["head.weight"], run["fsdp-acc"]["weights"]["head.weight"])


@pytest.mark.timeout(240)
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
        "units": "fsdp_units=['Conv2d']: the model has no such module",
        "stepped-optimizer": "the optimizer has state already",
        "save": "rt.save of a model set up with strategy='fsdp' is not built yet",
    }
    assert said.keys() == expected.keys()
    for name, text in expected.items():
        assert text in said[name] and "\n" not in said[name], name


def test_fp16_under_fsdp_is_refused():
    rt = ddpkit.init(seed=0, precision="fp16")
    try:
        with pytest.raises(ddpkit.UsageError, match="precision='fp16' is not supported"):
            rt.setup(fw.Net(), strategy="fsdp")
    finally:
        rt.close()
