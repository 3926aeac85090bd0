"""What decoding plugins may rely on about a trained model."""

from typing import Protocol

import torch

from lmlab.api.cache import InferenceCache


class LanguageModel(Protocol):
    """The assembled model, as a decoder sees it."""

    block_size: int
    vocab_size: int

    def __call__(self, idx: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor:
        """idx (B, T) → logits (B, T, V). With a cache, idx continues the cached tokens."""

    def new_cache(self, batch_size: int, max_len: int) -> InferenceCache:
        """An empty cache for up to ``max_len`` tokens (at most ``max_context``)."""

    @property
    def max_context(self) -> int | None:
        """The longest sequence the model can attend over (None: unbounded, e.g. a recurrent mixer)."""
