"""The decoding slot: turns a prompt into a continuation."""

import torch

from lmlab.api.cache import InferenceCache
from lmlab.api.model import LanguageModel
from lmlab.api.plugin import Plugin


class Decoder(Plugin):
    """How text is generated from a trained model:
    [generate][lmlab.api.decoding.Decoder.generate] continues a prompt of token ids.

    Used by ``lmlab generate`` and by the sample ``lmlab run`` prints at the end of a causal run;
    a model trained with a bidirectional objective is never given to a decoder.
    """

    slot = "decoding"

    def generate(self, model: LanguageModel, prompt: torch.Tensor, max_new_tokens: int,
                 eos_id: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Continue ``prompt`` by at most ``max_new_tokens`` tokens.

        Called under ``torch.no_grad()`` with the model in eval mode (``model.eval()``), in one
        process. Feed the model through a [Stepper][lmlab.api.decoding.Stepper] (or the model's
        own cache, [LanguageModel.new_cache][lmlab.api.model.LanguageModel.new_cache]) rather than
        re-running the whole sequence per token; the Stepper also keeps the sequence within
        [LanguageModel.max_context][lmlab.api.model.LanguageModel.max_context].

        Args:
            model: The trained model: ``model(idx, cache)`` gives logits (B, T, V) in the
                parameters' dtype.
            prompt: (B, T) int64 token ids on the model's device, T ≥ 1; the core passes one row
                (B = 1).
            max_new_tokens: How many tokens to add at most, ≥ 1 from the core.
            eos_id: The tokenizer's end-of-document id, or None. A row that emits it is finished:
                the first-party decoders pad it with ``eos_id`` and stop once every row is.
            generator: The random generator to draw from (on the model's device, seeded by
                ``--seed`` or the run's seed), so that sampling is reproducible; None draws from
                the global one.

        Returns:
            Token ids (B, T + n) int64 with n ≤ ``max_new_tokens``, beginning with ``prompt``
            unchanged; the core decodes row 0 after the prompt.
        """
        raise NotImplementedError


class Stepper:
    """Feeds tokens to a model one step at a time through its cache.

    Hides the context limit: once a sequence outgrows ``model.max_context``, the cache is rebuilt
    from the most recent tokens that fit (a sliding window), as nanoGPT's sampler crops its input.
    Call [start][lmlab.api.decoding.Stepper.start] once, then
    [step][lmlab.api.decoding.Stepper.step] per token, under ``torch.no_grad()``.

    Args:
        model: The model to feed (a causal one: bidirectional models have no cache).
        batch_size: Rows decoded together (B).
        max_len: The longest sequence that will be fed, prompt included; the cache holds
            ``min(max_len, model.max_context)`` positions.
    """

    def __init__(self, model: LanguageModel, batch_size: int, max_len: int):
        self.model = model
        self.batch_size = batch_size
        limit = model.max_context
        self.window = max_len if limit is None else min(max_len, limit)
        self.cache: InferenceCache = model.new_cache(batch_size, self.window)
        self.tokens: torch.Tensor | None = None

    def start(self, prompt: torch.Tensor) -> torch.Tensor:
        """Consume prompt (B, T) int64; return the logits (B, V) for the next token, in the model's
        dtype. A prompt longer than the cache's window is cropped to its last ``window - 1`` tokens."""
        self.tokens = prompt
        return self._refill()

    def step(self, next_tokens: torch.Tensor) -> torch.Tensor:
        """Append next_tokens (B,) int64, one per row; return the logits (B, V) for the token after
        them. One forward pass of one token; when the cache is full, instead one forward pass of the
        last ``window - 1`` tokens into a fresh cache."""
        self.tokens = torch.cat([self.tokens, next_tokens[:, None]], dim=1)
        if self.cache.length >= self.window:
            return self._refill()
        return self.model(next_tokens[:, None], cache=self.cache)[:, -1]

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (B',) int64, in that order, of the tokens and the cache (beam search
        re-ranking); later calls take B' rows."""
        self.tokens = self.tokens.index_select(0, index)
        self.cache.reorder(index)

    def _refill(self) -> torch.Tensor:
        # Keep room for at least one more token so a refill is needed at most every few steps.
        keep = self.tokens[:, -max(1, self.window - 1):] if self.tokens.shape[1] >= self.window else self.tokens
        self.cache = self.model.new_cache(self.tokens.shape[0], self.window)
        return self.model(keep, cache=self.cache)[:, -1]
