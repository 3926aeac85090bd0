"""The decoding slot: turns a prompt into a continuation."""

import torch

from lmlab.api.cache import InferenceCache
from lmlab.api.model import LanguageModel
from lmlab.api.plugin import Plugin


class Decoder(Plugin):
    """How text is generated from a trained model: :meth:`generate` continues a prompt of token ids."""

    slot = "decoding"

    def generate(self, model: LanguageModel, prompt: torch.Tensor, max_new_tokens: int,
                 eos_id: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """prompt (B, T) → (B, T + n) with n ≤ max_new_tokens. Called under ``torch.no_grad``."""
        raise NotImplementedError


class Stepper:
    """Feeds tokens to a model one step at a time through its cache.

    Hides the context limit: once a sequence outgrows ``model.max_context``, the cache is rebuilt
    from the most recent tokens that fit (a sliding window), as nanoGPT's sampler crops its input.
    """

    def __init__(self, model: LanguageModel, batch_size: int, max_len: int):
        self.model = model
        self.batch_size = batch_size
        limit = model.max_context
        self.window = max_len if limit is None else min(max_len, limit)
        self.cache: InferenceCache = model.new_cache(batch_size, self.window)
        self.tokens: torch.Tensor | None = None

    def start(self, prompt: torch.Tensor) -> torch.Tensor:
        """Consume prompt (B, T); return the logits (B, V) for the next token."""
        self.tokens = prompt
        return self._refill()

    def step(self, next_tokens: torch.Tensor) -> torch.Tensor:
        """Append next_tokens (B,); return the logits (B, V) for the token after them."""
        self.tokens = torch.cat([self.tokens, next_tokens[:, None]], dim=1)
        if self.cache.length >= self.window:
            return self._refill()
        return self.model(next_tokens[:, None], cache=self.cache)[:, -1]

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (beam search re-ranking)."""
        self.tokens = self.tokens.index_select(0, index)
        self.cache.reorder(index)

    def _refill(self) -> torch.Tensor:
        # Keep room for at least one more token so a refill is needed at most every few steps.
        keep = self.tokens[:, -max(1, self.window - 1):] if self.tokens.shape[1] >= self.window else self.tokens
        self.cache = self.model.new_cache(self.tokens.shape[0], self.window)
        return self.model(keep, cache=self.cache)[:, -1]
