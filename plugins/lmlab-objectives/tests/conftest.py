"""A tiny stand-in for the model an objective runs, and preference rows to feed it."""

import pytest
import torch
from torch import nn

from lmlab.api import ModelShape, Windows


class TinyLM(nn.Module):
    """What an objective sees of the model: ids → logits (or hidden states), and ``heads``."""

    def __init__(self, vocab: int = 12, d: int = 8, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.mix, self.head = nn.Embedding(vocab, d), nn.Linear(2 * d, d), nn.Linear(d, vocab)
        self.heads = None
        self.shape = ModelShape(n_layers=1, d_model=d, n_heads=1, block_size=16, vocab_size=vocab)

    def forward(self, ids, hidden: bool = False):
        x = self.emb(ids)
        previous = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)  # causal: this and the last token
        h = torch.tanh(self.mix(torch.cat([x, previous], dim=-1)))
        return h if hidden else self.head(h)


@pytest.fixture
def tiny_lm():
    """TinyLM(seed=...), with ``heads`` set from an objective's when given one."""
    def make(seed: int = 0, objective=None) -> TinyLM:
        model = TinyLM(seed=seed)
        if objective is not None:
            model.heads = nn.ModuleDict(objective.heads(model.shape))
        return model
    return make


@pytest.fixture
def pair_windows() -> Windows:
    """Two preference records: prompt 1 2 | chosen 3 | rejected 4 5 (then padding), and prompt 6 |
    chosen 7 8 | rejected 9."""
    tokens = torch.tensor([[1, 2, 3, 4, 5, 0, 0], [6, 7, 8, 9, 0, 0, 0]])
    labels = torch.tensor([[0, 0, 1, 2, 2, 0, 0], [0, 1, 1, 2, 0, 0, 0]], dtype=torch.uint8)
    padding = torch.tensor([[0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    return Windows(tokens, labels=labels, padding=padding)
