"""Functions that ``tests/test_first_run.py`` runs in 1 and 2 processes through ``ddpkit.launch``."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

import ddpkit

VOCAB, LENGTH, SAMPLES = 11, 7, 13


class TinyLM(torch.nn.Module):
    """Logits ``(B, T, V)``, as nanoGPT's model returns them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))


class ClassesFirst(torch.nn.Module):
    """The same logits as ``(B, V, T)``, torch's convention."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens).transpose(1, 2)


def token_data() -> torch.utils.data.TensorDataset:
    """Sequences whose targets are the next tokens, the tail of some padded with -100."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (SAMPLES, LENGTH + 1), generator=generator)
    targets = tokens[:, 1:].clone()
    for row in range(0, SAMPLES, 3):
        targets[row, LENGTH - 1 - row % 4 :] = -100
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), targets)


def sequence_metrics() -> tuple[dict, dict]:
    """``ddpkit.evaluate`` of a language model, (B, T, V) with class_dim=-1 and (B, V, T)."""
    ddpkit.init(seed=0)
    torch.manual_seed(0)
    model = TinyLM()
    data = token_data()
    last = ddpkit.evaluate(model, data, num_classes=VOCAB, class_dim=-1, batch_size=4)
    first = ddpkit.evaluate(ClassesFirst(model), data, num_classes=VOCAB, batch_size=4)
    return last, first


def plain_backward(use_rt: bool) -> tuple[list[str], dict]:
    """A loop migrated with ``loss.backward()`` left in place, over an uneven last batch (11 samples,
    global batch 4: the last holds 3, split 2 and 1 on two processes)."""
    rt = ddpkit.init(seed=0)
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(11, 3), torch.randint(0, 2, (11,)))
    model = torch.nn.Linear(3, 2)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = rt.loader(data, global_batch_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in rt.epochs(2):
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                if use_rt:
                    rt.backward(loss)
                else:
                    loss.backward()
                rt.step(optimizer)
    said = [str(w.message) for w in caught if "loss.backward()" in str(w.message)]
    weights = {k: v.detach().clone() for k, v in ddpkit._torch.unwrap(model).state_dict().items()}
    return said, weights


def random_around_setup() -> tuple[torch.Tensor, torch.Tensor]:
    """What ``ddpkit.init``'s docstring says: equal draws before ``rt.setup``, a stream per rank after."""
    rt = ddpkit.init(seed=3)
    before = torch.rand(4)
    rt.setup(torch.nn.Linear(2, 2))
    return before, torch.rand(4)
