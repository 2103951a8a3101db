"""Hugging Face's loop: samples that are dicts (a ``datasets.Dataset``), models called as
``model(**batch)`` that return an output object with ``loss`` and ``logits``, and batches a script
builds itself as a tokenizer does (a ``BatchEncoding``, a ``UserDict``). ``ddpkit.evaluate`` unpacked
a dict sample as ``inputs, targets`` ("too many values to unpack"), ``ddpkit.predict`` passed it to
the model as one argument, and ``rt.shards`` handed every micro-shard a ``UserDict`` batch whole."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
import torch

import ddpkit
import workers
from ddpkit.loop.batch import concat_batches, map_tensors, to_device
from ddpkit.parallel.exact_tree import _take


def _model() -> workers.HfClassifier:
    torch.manual_seed(3)
    return workers.HfClassifier().eval()


class _Tokens(torch.nn.Module):
    """The same model on ``(input_ids, labels)`` pairs: what evaluate took before dicts."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids):  # noqa: ANN001, ANN201
        return self.inner(input_ids=input_ids, attention_mask=(input_ids > 0).long()).logits


def _pairs(data) -> torch.utils.data.TensorDataset:  # noqa: ANN001
    return torch.utils.data.TensorDataset(data[:]["input_ids"], data[:]["labels"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "built",
    [pytest.param(False, marks=pytest.mark.slow), True],  # the built batch's run reads the loader's dicts too
    ids=["loader-dicts", "tokenizer-built-userdict"],
)
def test_the_hugging_face_loop_on_two_processes_ends_at_one_process_bits(built):
    one = workers.hf_dicts(built)
    runs = ddpkit.launch(workers.hf_dicts, nprocs=2, args=(built,))
    for found in runs.values():
        for key, value in one["state"].items():
            assert torch.equal(found["state"][key], value), key
        assert found["metrics"] == one["metrics"]
        assert list(found["predicted"]) == ["logits"]  # the output's loss is None: not a field of it
        assert torch.equal(found["predicted"]["logits"], one["predicted"]["logits"])
    assert one["metrics"]["count"] == 30


def test_evaluate_of_dict_samples_equals_evaluate_of_the_same_pairs():
    data = workers.hf_dataset(17, 2)
    model = _model()
    as_dicts = ddpkit.evaluate(model, data, num_classes=3, batch_size=4)
    as_pairs = ddpkit.evaluate(_Tokens(model), _pairs(data), num_classes=3, batch_size=4)
    assert as_dicts == as_pairs and as_dicts["count"] == 17
    predicted = ddpkit.predict(model, data, batch_size=4)
    assert torch.equal(predicted["logits"], ddpkit.predict(_Tokens(model), _pairs(data), batch_size=4))


def test_the_targets_key_is_found_named_or_refused_in_one_line():
    data = workers.hf_dataset(6, 2)
    model = _model()
    expected = ddpkit.evaluate(model, data, num_classes=3)
    renamed = data.rename_column("labels", "label")  # a dataset not yet through a data collator
    assert ddpkit.evaluate(model, renamed, num_classes=3) == expected
    custom = data.rename_column("labels", "sentiment")
    assert ddpkit.evaluate(model, custom, num_classes=3, target_key="sentiment") == expected
    with pytest.raises(ddpkit.UsageError, match=r"keys \['attention_mask', 'input_ids', 'sentiment'\].*target_key="):
        ddpkit.evaluate(model, custom, num_classes=3)
    with pytest.raises(ddpkit.UsageError, match="none is 'y'"):
        ddpkit.evaluate(model, data, num_classes=3, target_key="y")
    # predict leaves the targets out of the model's inputs whatever their key
    assert torch.equal(ddpkit.predict(model, custom, target_key="sentiment")["logits"], expected_logits(model, data))
    with pytest.raises(ddpkit.UsageError, match="a list of 3 items"):
        ddpkit.evaluate(model, [(1, 2, 3)], num_classes=3)


def expected_logits(model: torch.nn.Module, data, batch_size: int = 256) -> torch.Tensor:  # noqa: ANN001
    """The logits of ``data`` in batches of ``batch_size`` (a batch's size may change a matmul's rounding)."""
    with torch.no_grad():
        return torch.cat(
            [
                model(
                    input_ids=data[i : i + batch_size]["input_ids"],
                    attention_mask=data[i : i + batch_size]["attention_mask"],
                ).logits
                for i in range(0, len(data), batch_size)
            ]
        )


def test_a_model_that_takes_the_dict_whole_is_given_it_whole():
    """A model whose forward takes one argument (a multimodal batch, say) gets the dict as before."""

    class Whole(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 3)

        def forward(self, batch):  # noqa: ANN001, ANN201
            return self.linear(torch.stack([batch["a"], batch["b"]], dim=1))

    class WholeWithOptions(Whole):
        def forward(self, batch, **options):  # noqa: ANN001, ANN003, ANN201
            return super().forward(batch)

    samples = [{"a": torch.tensor(float(i)), "b": torch.tensor(1.0), "labels": torch.tensor(i % 3)} for i in range(7)]
    torch.manual_seed(0)
    with_options = WholeWithOptions()  # **options, but `batch` is not a key: the dict is its one argument
    assert ddpkit.predict(with_options, samples, batch_size=3).shape == (7, 3)
    model = Whole()
    metrics = ddpkit.evaluate(model, samples, num_classes=3, batch_size=3)
    with torch.no_grad():
        logits = model.linear(torch.tensor([[float(i), 1.0] for i in range(7)]))
    assert metrics["correct"] == int((logits.argmax(1) == torch.arange(7) % 3).sum())
    assert torch.equal(ddpkit.predict(model, samples, batch_size=3), logits)


def test_outputs_hugging_face_style_come_back_as_dicts_and_predict_to_file_takes_their_logits(tmp_path):
    data = workers.hf_dataset(9, 4)
    model = _model()
    path = ddpkit.predict_to_file(model, data, tmp_path / "logits.npy", batch_size=4)
    assert np.array_equal(np.load(path), expected_logits(model, data, 4).numpy())

    class ModelOutput(collections.OrderedDict):  # transformers' outputs are dicts too
        pass

    class Both(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):  # noqa: ANN001, ANN201
            return ModelOutput(logits=input_ids.float(), hidden=input_ids.float() * 2)

    both = ddpkit.predict(Both(), data, batch_size=4)
    assert set(both) == {"logits", "hidden"} and torch.equal(both["hidden"], 2 * data[:]["input_ids"].float())
    with pytest.raises(ddpkit.UsageError, match=r"one tensor is its logits \(it returned \['hidden', 'logits'\]\)"):
        ddpkit.predict_to_file(Both(), data, tmp_path / "both.npy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logits.npy"]  # nothing else written


def test_a_rank_with_no_samples_makes_the_empty_output_from_a_dict_sample():
    from ddpkit.loop.evaluate import _empty_output

    empty = _empty_output(_model(), workers.hf_dataset(3, 0))
    assert list(empty) == ["logits"] and empty["logits"].shape == (0, 3)


def test_a_stream_of_dict_samples_is_evaluated_and_predicted_in_order():
    data = workers.hf_dataset(11, 5)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # noqa: ANN204
            return iter(data)

    model = _model()
    assert ddpkit.evaluate(model, Stream(), num_classes=3, batch_size=4) == ddpkit.evaluate(
        model, data, num_classes=3, batch_size=4
    )
    assert torch.equal(ddpkit.predict(model, Stream(), batch_size=4)["logits"], expected_logits(model, data, 4))


def test_a_userdict_batch_keeps_its_type_when_moved_joined_or_cut():
    batch = workers.hf_encoding(input_ids=torch.arange(8).view(4, 2), labels=torch.arange(4))
    moved = to_device(batch, torch.device("cpu"))
    assert type(moved) is type(batch) and torch.equal(moved.input_ids, batch.input_ids)
    joined = concat_batches([batch, batch])
    assert type(joined) is type(batch) and joined.labels.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    shard = _take(batch, 1, 2)  # rows 1 and 3: a micro-shard, not the whole batch
    assert type(shard) is type(batch) and shard.labels.tolist() == [1, 3]
    assert shard.input_ids.tolist() == [[2, 3], [6, 7]]


def test_a_mapping_whose_constructor_takes_no_dict_comes_back_a_dict():
    @dataclasses.dataclass
    class Pair(collections.abc.Mapping):
        x: torch.Tensor
        y: torch.Tensor

        def __getitem__(self, key):  # noqa: ANN001, ANN204
            return getattr(self, key)

        def __iter__(self):  # noqa: ANN204
            return iter(("x", "y"))

        def __len__(self) -> int:
            return 2

    mapped = map_tensors(lambda t: t + 1, Pair(torch.zeros(1), torch.ones(1)))
    assert type(mapped) is dict and mapped["x"].item() == 1.0 and mapped["y"].item() == 2.0
