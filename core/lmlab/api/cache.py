"""Inference state for incremental decoding.

The model holds one [InferenceCache][lmlab.api.cache.InferenceCache] per generation; each attention
layer keeps its own state inside it (a [KVCache][lmlab.api.cache.KVCache] for softmax attention, a
recurrent state for a state-space mixer). Decoding plugins only create caches, feed tokens and
reorder rows (beam search).
"""

from typing import Protocol

import torch


class LayerState(Protocol):
    """What a layer's inference state must support besides holding tensors: what
    [AttentionModule.new_state][lmlab.api.attention.AttentionModule.new_state] returns."""

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (B',) int64 in that order; used when beams are re-ranked."""


class KVCache:
    """Pre-allocated keys and values of one attention layer: (B, n_kv_heads, max_len, head_dim).

    Args:
        batch_size: Rows decoded together (B).
        n_kv_heads: Key/value heads of the layer.
        max_len: Positions to hold.
        head_dim: Size of one head.
        device: Where to allocate (the model's device).
        dtype: The dtype of keys and values (the model's parameter dtype).
    """

    def __init__(self, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        """Keys (B, n_kv_heads, max_len, head_dim); positions past those written hold zeros."""
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        """Values, shaped as [k][lmlab.api.cache.KVCache.k]."""

    @property
    def max_len(self) -> int:
        """Positions the cache holds."""
        return self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv, T, hs) at positions [start, start+T); return all keys/values so far,
        (B, n_kv, start + T, hs) each. ``start`` is ``MixerContext.start``; ``ValueError`` when the
        cache is too short."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; asked to write up to {end}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (B',) int64 in that order (beam search)."""
        self.k = self.k.index_select(0, index)
        self.v = self.v.index_select(0, index)


class InferenceCache:
    """Every layer's state plus the number of tokens already consumed (``length``).

    Made by the model's ``new_cache`` ([LanguageModel.new_cache][lmlab.api.model.LanguageModel.new_cache]);
    the model advances ``length`` after each forward pass with the cache.

    Args:
        states: One state per block, in block order.
        max_len: Positions every state holds.
    """

    def __init__(self, states: list, max_len: int):
        self.states = states
        """One [LayerState][lmlab.api.cache.LayerState] per block; block i's mixer receives
        ``states[i]``."""
        self.max_len = max_len
        """Positions every state holds."""
        self.length = 0
        """Tokens consumed so far: the next forward pass's ``MixerContext.start``."""

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (B',) int64, in that order, in every layer's state."""
        for state in self.states:
            state.reorder(index)
