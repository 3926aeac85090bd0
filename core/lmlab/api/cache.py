"""Inference state for incremental decoding.

The model holds one :class:`InferenceCache` per generation; each attention layer keeps its own
state inside it (a :class:`KVCache` for softmax attention, a recurrent state for a state-space
mixer). Decoding plugins only create caches, feed tokens and reorder rows (beam search).
"""

from typing import Protocol

import torch


class LayerState(Protocol):
    """What a layer's inference state must support besides holding tensors."""

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (B',) in that order; used when beams are re-ranked."""


class KVCache:
    """Pre-allocated keys and values of one attention layer: (B, n_kv_heads, max_len, head_dim)."""

    def __init__(self, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv, T, hs) at positions [start, start+T); return all keys/values so far."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; asked to write up to {end}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def reorder(self, index: torch.Tensor) -> None:
        self.k = self.k.index_select(0, index)
        self.v = self.v.index_select(0, index)


class InferenceCache:
    """Every layer's state plus the number of tokens already consumed (``length``)."""

    def __init__(self, states: list, max_len: int):
        self.states = states
        self.max_len = max_len
        self.length = 0

    def reorder(self, index: torch.Tensor) -> None:
        for state in self.states:
            state.reorder(index)
