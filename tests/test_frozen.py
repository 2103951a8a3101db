"""A model set up with no parameter that requires a gradient (a distillation teacher, a frozen encoder).

DDP refuses such a model ("DistributedDataParallel is not needed when a module doesn't have any
parameter that requires a gradient"), so ``rt.setup(teacher)`` worked on one process and ended two in
torch's traceback. Now it is not wrapped, on any number of processes: every rank holds rank 0's weights,
the student's micro-shards still give the same bits on 1 and 2 processes, and a parameter of it that
trains later is refused at the step on one process as on two.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import ddpkit
from ddpkit._torch import unwrap
from ddpkit.errors import UsageError

_T = 2.0


def _teacher(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    teacher = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    ).double()
    return teacher.requires_grad_(False).eval()


def _distill(micro_shards: int | None, teacher_first: bool) -> dict:
    """Distil a teacher (built differently on each rank before rt.setup) into a student for one epoch."""
    rt = ddpkit.init(seed=0)
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(40, 6, dtype=torch.float64, generator=generator), torch.randint(0, 3, (40,), generator=generator)
    )
    student = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 3)).double()
    optimizer = torch.optim.SGD(student.parameters(), lr=0.2)
    teacher = _teacher(seed=rt.rank)  # rank 0's weights are the ones every rank must end up with
    if teacher_first:
        teacher = rt.setup(teacher)
    student, optimizer = rt.setup(student, optimizer, micro_shards=micro_shards)
    if not teacher_first:
        teacher = rt.setup(teacher)
    loader = rt.loader(data, global_batch_size=8, shuffle=True)
    for _ in rt.epochs(1):
        for x, y in loader:
            for shard in rt.shards(x, y) if micro_shards else [(x, y)]:
                xs, ys = shard
                with torch.no_grad():
                    soft = F.softmax(teacher(xs) / _T, -1)
                s = student(xs)
                loss = F.kl_div(F.log_softmax(s / _T, -1), soft, reduction="batchmean") * _T * _T
                rt.backward(loss + F.cross_entropy(s, ys))
            rt.step(optimizer)
    metrics = ddpkit.evaluate(teacher, data, num_classes=3)
    found = {
        "wrapped": isinstance(teacher, torch.nn.parallel.DistributedDataParallel),
        "teacher": {k: v.clone() for k, v in teacher.state_dict().items()},
        "student": {k: v.clone() for k, v in unwrap(student).state_dict().items()},
        "teacher_accuracy": metrics["accuracy"],
    }
    rt.close()
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "teacher_first", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["teacher-first", "student-first"]
)  # (student-first: make test-slow)
def test_a_frozen_teacher_sets_up_on_two_processes_and_micro_shards_keep_their_bits(teacher_first):
    one = _distill(2, teacher_first)
    two = ddpkit.launch(_distill, nprocs=2, args=(2, teacher_first))
    reference = _teacher(seed=0)
    for found in (one, *two.values()):
        assert not found["wrapped"]
        for key, value in reference.state_dict().items():  # rank 0's weights on every rank
            assert torch.equal(found["teacher"][key], value), key
        assert found["teacher_accuracy"] == one["teacher_accuracy"]
        for key, value in one["student"].items():  # micro-shards: the same bits on 1 and 2 processes
            assert torch.equal(found["student"][key], value), key


def _unfreeze_later() -> str:
    rt = ddpkit.init(seed=0)
    teacher = rt.setup(_teacher(seed=0))
    teacher[3].requires_grad_(True)  # fine-tune its head, with the set-up model that DDP never wrapped
    optimizer = torch.optim.SGD(teacher[3].parameters(), lr=0.1)
    rt.backward(teacher(torch.randn(4, 6, dtype=torch.float64)).sum())
    try:
        rt.step(optimizer)
    except UsageError as exc:
        return str(exc)
    finally:
        rt.close()
    return "stepped"


@pytest.mark.timeout(120)
def test_a_frozen_model_that_trains_later_is_refused_on_one_process_as_on_two():
    said = [_unfreeze_later(), *ddpkit.launch(_unfreeze_later, nprocs=2).values()]
    for line in said:
        assert line.startswith("rt.step: 2 parameter(s) of a model set up with none that requires a gradient"), line
        assert "(3.weight, ...)" in line and "\n" not in line


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"micro_shards": 2}, "micro_shards="),
        ({"grad_compression": "bf16"}, "grad_compression="),
        ({"find_unused_parameters": True}, "find_unused_parameters="),
        ({"sync": "diloco", "sync_every": 4}, "sync=, sync_every="),
    ],
)
def test_options_that_train_a_frozen_model_are_refused_in_one_line(options, named):
    rt = ddpkit.init(seed=0)
    try:
        with pytest.raises(UsageError) as caught:
            rt.setup(_teacher(seed=0), **options)
        said = str(caught.value)
        assert said.startswith("rt.setup: this model has no parameter that requires a gradient"), said
        assert f"averaged and {named} would do nothing" in said, said
    finally:
        rt.close()


def _sharded_teacher() -> dict:
    rt = ddpkit.init(seed=0)
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()
    teacher = rt.setup(teacher.requires_grad_(False), strategy="fsdp")  # a large teacher, sharded to save memory
    with torch.no_grad():
        out = teacher(torch.ones(4, 6, dtype=torch.float64))
    found = {"sharded": type(teacher).__name__.startswith("FSDP"), "out": out.clone()}
    rt.close()
    return found


@pytest.mark.timeout(120)
def test_a_frozen_teacher_may_still_be_sharded():
    one = _sharded_teacher()
    for found in [one, *ddpkit.launch(_sharded_teacher, nprocs=2).values()]:
        assert found["sharded"] and torch.equal(found["out"], one["out"])


def test_a_frozen_teachers_forward_outside_autocast_says_nothing():
    rt = ddpkit.init(seed=0, precision="bf16")
    teacher = rt.setup(_teacher(seed=0).float())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        teacher(torch.randn(4, 6))  # grad enabled, no autocast: a teacher's forward is the script's to place
    rt.close()
