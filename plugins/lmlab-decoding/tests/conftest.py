"""A bigram language model with a trivial inference cache, for decoding tests."""

import pytest
import torch

from lmlab.api import InferenceCache


class BigramModel(torch.nn.Module):
    """logits of the next token = table[current token]. Checks that callers respect its context."""

    def __init__(self, table: torch.Tensor, max_context: int | None = 64):
        super().__init__()
        self.table = torch.nn.Parameter(table)  # (V, V)
        self.vocab_size = table.shape[0]
        self.block_size = max_context or 1024
        self._max_context = max_context
        self.calls: list[int] = []  # tokens fed per call

    @property
    def max_context(self) -> int | None:
        return self._max_context

    def new_cache(self, batch_size: int, max_len: int) -> InferenceCache:
        assert self.max_context is None or max_len <= self.max_context
        return InferenceCache(states=[], max_len=max_len)

    def forward(self, idx: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor:
        self.calls.append(idx.shape[1])
        if cache is not None:
            assert cache.length + idx.shape[1] <= cache.max_len, "cache overflow"
            cache.length += idx.shape[1]
        elif self.max_context is not None:
            assert idx.shape[1] <= self.max_context
        return self.table[idx]  # (B, T, V)


def greedy_chain(table: torch.Tensor, start: int, n: int) -> list[int]:
    out = [start]
    for _ in range(n):
        out.append(int(table[out[-1]].argmax()))
    return out[1:]


@pytest.fixture
def bigram():
    """Factory: bigram(table, max_context=64) → BigramModel."""
    return BigramModel


@pytest.fixture
def chain():
    """chain(table, start, n) → the n tokens greedy decoding must produce after ``start``."""
    return greedy_chain


@pytest.fixture
def table():
    """A random (V=16) bigram table whose rows have a clear argmax (top-2 margin > 0.05)."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(16, 16, generator=g) * 3
    top2 = t.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 0.05
    return t
