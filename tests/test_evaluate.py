"""Exact evaluation and order-preserving prediction on 1, 2 and 3 processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchmetrics

import ddpkit
import workers
from ddpkit import predict_to_file  # the public name README shows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    found = {}
    for world in (1, 2, 3):
        stream = tmp_path_factory.mktemp(f"stream{world}")
        results = ddpkit.launch(workers.evaluate_everything, nprocs=world, args=(str(stream),))
        found[world] = results
    return found


def _single_process(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and labels of one process reading the whole dataset: the reference."""
    data = workers.indexed_dataset(length)
    with torch.no_grad():
        return workers.LogitsOnly()(data.tensors[0]), data.tensors[1]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("length", workers.LENGTHS)
def test_predictions_match_single_process_in_order(runs, world, length):
    reference, _ = _single_process(length)
    ranks = runs[world]
    main = ranks[0][length]["main"]
    assert torch.equal(main["index"], torch.arange(length))  # every index once, in order
    assert main["logits"].shape == (length, 5)
    assert torch.equal(main["logits"].argmax(1), reference.argmax(1))
    assert _relative(main["logits"], reference) <= 1e-6
    for rank in range(world):
        assert torch.equal(ranks[rank][length]["all"]["index"], torch.arange(length))
        assert torch.equal(ranks[rank][length]["all"]["logits"], main["logits"])
        if rank:
            assert ranks[rank][length]["main"] is None
    assert sum(ranks[r][length]["shard"] for r in range(world)) == length
    if length == 1 and world > 1:
        assert ranks[world - 1][length]["shard"] == 0  # an empty rank finished


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("length", workers.LENGTHS)
def test_counts_equal_single_process_exactly(runs, world, length):
    logits, labels = _single_process(length)
    predicted = logits.argmax(1)
    confusion = torch.zeros(5, 5, dtype=torch.long)
    confusion.index_put_((labels, predicted), torch.ones(length, dtype=torch.long), accumulate=True)
    loss = torch.nn.functional.cross_entropy(logits.double(), labels, reduction="sum").item() / length
    for rank in range(world):  # identical on every rank
        metrics = runs[world][rank][length]["metrics"]
        assert metrics["count"] == length
        assert metrics["correct"] == int((predicted == labels).sum())
        assert metrics["confusion"] == confusion.tolist()
        assert metrics["loss"] == pytest.approx(loss, rel=1e-6)
        assert metrics["tm_accuracy"] == pytest.approx(metrics["accuracy"], abs=1e-6)  # torchmetrics agrees


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_streamed_predictions_are_merged_in_order(runs, world):
    for length in workers.LENGTHS:
        path = runs[world][0][length]["streamed"]
        reference = _single_process(length)[0].numpy()
        merged = np.load(path)
        assert merged.shape == reference.shape
        assert np.allclose(merged, reference, rtol=1e-6, atol=1e-7)
        assert all(runs[world][r][length]["streamed"] is None for r in range(1, world))


def test_per_class_metrics_from_the_confusion_matrix():
    data = torch.utils.data.TensorDataset(
        torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]), torch.tensor([0, 1, 1, 1])
    )
    metrics = ddpkit.evaluate(torch.nn.Identity(), data, num_classes=2)
    assert metrics["confusion"] == [[1, 0], [1, 2]]
    assert metrics["precision"] == [0.5, 1.0] and metrics["recall"] == [1.0, 2 / 3]
    assert metrics["f1"] == pytest.approx([2 / 3, 0.8])
    assert metrics["accuracy"] == 0.75


def test_a_reused_torchmetrics_metric_is_reset_by_each_evaluate():
    """One metric object passed every epoch must not carry the earlier epochs' samples."""
    import torchmetrics

    data = workers.indexed_dataset(7)
    accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=5)
    accuracy.update(torch.eye(5)[:4], torch.tensor([1, 2, 3, 4]))  # stale state: four wrong samples
    first = ddpkit.evaluate(workers.LogitsOnly(), data, num_classes=5, extra_metrics={"tm": accuracy})
    second = ddpkit.evaluate(workers.LogitsOnly(), data, num_classes=5, extra_metrics={"tm": accuracy})
    assert first["tm"] == second["tm"] == pytest.approx(first["accuracy"])
    assert accuracy.update_count == 1  # the second call's one batch of 7, nothing before it


def test_predict_rejects_bad_arguments(tmp_path):
    with pytest.raises(ddpkit.UsageError, match="use 'main' or 'all'"):
        ddpkit.predict(workers.LogitsOnly(), workers.indexed_dataset(3), to="everyone")
    with pytest.raises(ddpkit.UsageError, match="empty"):
        ddpkit.predict(workers.LogitsOnly(), workers.indexed_dataset(0))
    with pytest.raises(ddpkit.UsageError, match="one tensor"):
        predict_to_file(workers.IndexedModel(), workers.indexed_dataset(3), tmp_path / "x.npy")
    assert list(tmp_path.iterdir()) == []  # nothing written: no part file left beside the output

    class Named(torch.nn.Module):
        def forward(self, x):
            return {"logits": x, "label": "not a tensor"}

    with pytest.raises(ddpkit.UsageError, match="returned a str"):
        ddpkit.predict(Named(), workers.indexed_dataset(3))


def test_nested_batches_move_and_keep_their_types():
    from collections import namedtuple

    from ddpkit.loop.batch import map_tensors, to_device

    Pair = namedtuple("Pair", "x y")
    batch = {"a": [torch.ones(2), (torch.zeros(1), "label")], "b": Pair(torch.ones(3), 7)}
    doubled = map_tensors(lambda t: t * 2, batch)
    assert isinstance(doubled["b"], Pair) and doubled["b"].y == 7
    assert torch.equal(doubled["a"][0], torch.full((2,), 2.0)) and doubled["a"][1][1] == "label"
    assert to_device(batch, torch.device("cpu"))["b"].x.device.type == "cpu"
    with pytest.raises(TypeError):
        map_tensors(lambda t: t, batch, strict=True)


def test_a_model_whose_child_is_named_module_is_evaluated_and_predicted_whole():
    """ddpkit took any module with a ``module`` child for DDP's wrapper: evaluate and predict ran the
    child alone (a backbone of 4 outputs, its head left out)."""
    from test_torch_private import _Backbone

    torch.manual_seed(0)
    model = _Backbone()
    data = torch.utils.data.TensorDataset(torch.randn(20, 3), torch.randint(0, 2, (20,)))
    with torch.no_grad():
        outputs = model(data.tensors[0])
    metrics = ddpkit.evaluate(model, data, num_classes=2)
    assert metrics["correct"] == int((outputs.argmax(1) == data.tensors[1]).sum())
    assert metrics["loss"] == pytest.approx(
        float(torch.nn.functional.cross_entropy(outputs, data.tensors[1])), rel=1e-6
    )
    assert torch.allclose(torch.as_tensor(ddpkit.predict(model, data)), outputs, atol=1e-6)


@pytest.mark.timeout(240)
def test_a_collate_that_pads_each_batch_evaluates_and_predicts_every_sample_once():
    """Sequences of 2 to 13 tokens padded to each batch's longest by a collate_fn (a text classifier's
    evaluation set): evaluate and predict take it as the loader does (default_collate stopped at the
    first ragged batch with torch's traceback). 45 samples on 1 and 3 processes: the same counts and
    correct ones, the rows in dataset order; per-token outputs of each batch's own width are refused
    in one line on every rank."""
    one = ddpkit.launch(workers.evaluate_padded, nprocs=1)[0]
    three = ddpkit.launch(workers.evaluate_padded, nprocs=3)
    assert one["metrics"]["count"] == 45 and one["metrics"]["correct"] == three[0]["metrics"]["correct"]
    assert all(r["metrics"]["confusion"] == one["metrics"]["confusion"] for r in three.values())
    assert one["metrics"]["loss"] == pytest.approx(three[0]["metrics"]["loss"], rel=1e-6)
    data, model = workers._Labelled(), workers._MeanPooled()
    with torch.no_grad():
        alone = torch.cat([model(x.unsqueeze(0)) for x, _ in data])
    for result in (one, *three.values()):
        assert result["rows"].shape == (45, 2) and torch.allclose(result["rows"], alone, atol=1e-6)
    said = [r["ragged"] for r in (one, *three.values())]
    assert all(s.startswith("predict: the outputs of the batches differ beyond their first dimension") for s in said)
    assert all("\n" not in s for s in said)


def test_a_float64_model_is_scored_in_float64():
    """The loss was taken of the outputs cast to float32: a float64 run's loss was float32's (3e-8 off)."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(40, 6, generator=g, dtype=torch.float64), torch.arange(40) % 4)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4).double()
    metrics = ddpkit.evaluate(model, data, num_classes=4, batch_size=40)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(data.tensors[0]), data.tensors[1], reduction="sum")
    assert expected.dtype == torch.float64 and metrics["loss"] == float(expected) / 40


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "batch_size, worlds",  # (7: rows apart); 4 processes on 2 cores: make test-slow
    [pytest.param(None, (2, 4), marks=pytest.mark.slow), (7, (2,)), pytest.param(7, (4,), marks=pytest.mark.slow)],
)
def test_under_micro_shards_evaluate_and_predict_give_the_same_bits_on_any_world_size(batch_size, worlds):
    """Each batch holds the same samples on any world size (a forward's bits depend on the rows it is
    given: 7 rows apart on one process) and the loss is summed exactly, so 1, 2 and 4 processes agree to
    the bit: a dataset, a plain stream, a ``ddpkit.Shards`` and an ``rt.loader``."""
    runs = {n: ddpkit.launch(workers.evaluated_alike, nprocs=n, args=(batch_size,))[0] for n in (1, *worlds)}
    for kind, one in runs[1].items():
        assert one["metrics"]["count"] == 101 and one["predicted"].shape == (101, 10)
        for n in worlds:
            assert runs[n][kind]["metrics"] == one["metrics"], (kind, n)  # the loss's last bit too
            assert runs[n][kind]["values"] == one["values"], (kind, n)  # without num_classes
            assert torch.equal(runs[n][kind]["predicted"], one["predicted"]), (kind, n)
    assert runs[1]["map"]["values"]["count"] == 1010 and runs[1]["map"]["values"]["loss"] > 0  # every element


@pytest.mark.timeout(180)
def test_a_rank_that_reads_no_batch_evaluates_and_predicts_with_the_others(tmp_path):
    """Ranks hold whole batches, so one may hold none (40 samples in one batch of 64 on 2 processes).
    That rank synced a list-state metric as an empty float tensor, skipped predict's check of the
    batches' shapes (where a collate_fn is given), and probed predict_to_file's shape with torch's
    default collate: each a hang or an abort beside the ranks that read."""
    one = workers.uneven_ranks(str(tmp_path / "one"))
    two = ddpkit.launch(workers.uneven_ranks, nprocs=2, args=(str(tmp_path / "two"),))[0]
    assert two["metrics"] == one["metrics"] and 0.0 < two["metrics"]["auroc"] <= 1.0
    assert two["strict"].startswith("evaluate: a rank read no batch (each reads whole batches), and extra_metrics")
    assert "['strict'], whose states are lists, cannot take zero rows there (ValueError: no rows)" in two["strict"]
    assert one["strict"] is None  # (one process reads every batch)
    assert torch.equal(two["predicted"], one["predicted"]) and two["predicted"].shape == (40, 3)
    assert two["rows"] == one["rows"] and len(two["rows"]) == 40


@pytest.mark.parametrize("size", [0, -4, 2.5, True])
def test_a_batch_size_that_is_not_a_positive_integer_is_one_line(size):
    data = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))
    model = torch.nn.Linear(2, 2)
    for call in (ddpkit.evaluate, ddpkit.predict):
        kwargs = {"num_classes": 2} if call is ddpkit.evaluate else {}
        with pytest.raises(ddpkit.UsageError) as refused:
            call(model, data, batch_size=size, **kwargs)
        assert str(refused.value).endswith("give the samples of each forward, a positive integer")
        assert f"(batch_size={size!r})" in str(refused.value) and "\n" not in str(refused.value)


def test_without_num_classes_the_targets_are_values_and_the_loss_is_their_mean_over_every_term():
    """A regression's loss over the whole set (``F.mse_loss``: every target element a term), soft labels
    scored by cross-entropy (a term a sample), and the two mistakes each in one line."""
    torch.manual_seed(0)
    inputs, values = torch.randn(37, 5), torch.randn(37, 2)
    model = torch.nn.Linear(5, 2)
    data = torch.utils.data.TensorDataset(inputs, values)
    mse = torchmetrics.MeanSquaredError()
    found = ddpkit.evaluate(model, data, loss_fn=F.mse_loss, batch_size=37, extra_metrics={"mse": mse})
    with torch.no_grad():
        expected = F.mse_loss(model(inputs), values, reduction="none").double().sum().item() / 74
    assert found["count"] == 74 and found["loss"] == expected and set(found) == {"count", "loss", "mse"}
    assert found["mse"] == pytest.approx(expected, rel=1e-5)
    batched = ddpkit.evaluate(model, data, loss_fn=F.mse_loss, batch_size=8)
    assert batched["count"] == 74 and batched["loss"] == pytest.approx(expected, rel=1e-6)
    soft = torch.softmax(torch.randn(37, 2), dim=1)
    labelled = ddpkit.evaluate(model, torch.utils.data.TensorDataset(inputs, soft), batch_size=37)
    with torch.no_grad():
        assert labelled["count"] == 37 and labelled["loss"] == pytest.approx(
            F.cross_entropy(model(inputs), soft).item()
        )
    classes = torch.utils.data.TensorDataset(inputs, torch.randint(0, 2, (37,)))
    with pytest.raises(ddpkit.UsageError, match=r"class indices .* num_classes is not given: pass num_classes=2 "):
        ddpkit.evaluate(model, classes)
    with pytest.raises(ddpkit.UsageError, match=r"values \(a regression's\): leave num_classes out$"):
        ddpkit.evaluate(model, data, num_classes=2, loss_fn=F.mse_loss)
    column = torch.nn.Linear(5, 1)  # (N, 1) outputs against (N,) targets: F.mse_loss pairs each with each
    with pytest.raises(ddpkit.UsageError, match=r"broadcast to \(8, 8\), every output against every target"):
        ddpkit.evaluate(column, torch.utils.data.TensorDataset(inputs, values[:, 0]), loss_fn=F.mse_loss, batch_size=8)
    with pytest.raises(ddpkit.UsageError, match=r"^evaluate\(class_dim=-1\) without num_classes"):
        ddpkit.evaluate(model, data, loss_fn=F.mse_loss, class_dim=-1)


@pytest.mark.slow  # make test-slow: make test keeps the core of this family (its 15 minutes)
@pytest.mark.timeout(180)
def test_a_test_set_that_draws_as_it_is_read_is_scored_alike_on_any_world_size_and_workers():
    """Test-time augmentation drew from each process's stream: 1 and 2 processes scored 0.270 and 0.243.
    Each sample's read is now keyed by its index (an evaluation's own key), as rt.loader keys its reads."""
    one = workers.evaluated_augmented(0)
    found = ddpkit.launch(workers.evaluated_augmented, nprocs=2, args=(2,))[0]  # in 2 loader workers each
    assert found["metrics"] == one["metrics"] and torch.equal(found["predicted"], one["predicted"])
    again = workers.evaluated_augmented(0)  # and at every evaluation
    assert again["metrics"] == one["metrics"] and torch.equal(again["predicted"], one["predicted"])
