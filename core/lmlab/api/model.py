"""What decoding plugins may rely on about a trained model."""

from typing import Protocol

import torch

from lmlab.api.cache import InferenceCache


class LanguageModel(Protocol):
    """The assembled model, as a decoder sees it (the core's ``lmlab.model.LanguageModel``, an
    ``nn.Module``): token embedding, position module, ``blocks``, final norm and head.

    A model whose decoding needs more than the shared key/value store supplies its own engine (API
    1.18): a method ``make_engine(rows, max_len, **settings)`` returning an
    [Engine][lmlab.api.decoding.Engine] for up to ``rows`` sequences of up to ``max_len`` tokens,
    ``settings`` being the cache's (``cache``, ``block_size``, ``n_blocks``, ``cuda_graph``,
    ``compile``, as in [DecodingOptions][lmlab.api.decoding.DecodingOptions]). The core then decodes
    through it rather than its own; it is typically a subclass of ``lmlab.api.decoding.SharedCacheEngine``
    (an encoder–decoder's engine adds each row's encoder output). A model without it (the core's
    decoder stack), or whose ``make_engine`` returns None (API 1.19: early exit without a threshold),
    decodes through the core's engine.
    """

    block_size: int
    """``model.block_size``: the window length the model was trained on."""
    vocab_size: int
    """Rows of the embedding and head: the logits' last dimension V."""

    head: torch.nn.Module
    """The output head: final hidden states (B, T, C) → logits (B, T, V) (tied to the token embedding
    unless ``model.tie_embeddings = false``)."""
    heads: torch.nn.ModuleDict | None
    """The objective's own modules ([Objective.heads][lmlab.api.objective.Objective.heads]: a reward
    model's scalar head), or None (API 1.10)."""

    def __call__(self, idx: torch.Tensor, cache: InferenceCache | None = None,
                 hidden: bool = False) -> torch.Tensor:
        """idx (B, T) → logits (B, T, V). With a cache, idx continues the cached tokens.

        Args:
            idx: (B, T) int64 token ids on the model's device.
            cache: None to score ``idx`` alone; else a cache from
                [new_cache][lmlab.api.model.LanguageModel.new_cache] whose ``length`` tokens
                ``idx`` continues (its length grows by T).
            hidden: Return the final norm's output (B, T, C), what ``head`` turns into logits,
                instead of the logits (API 1.10): an objective's heads read it.

        Returns:
            Logits (B, T, V); in decoding (no autocast), in the parameters' dtype.

        Raises:
            ValueError: Positions past [max_context][lmlab.api.model.LanguageModel.max_context].
        """

    def new_cache(self, batch_size: int, max_len: int) -> InferenceCache:
        """An empty cache for up to ``max_len`` tokens (at most ``max_context``).

        Raises:
            ValueError: ``max_len`` past ``max_context``, a bidirectional model, or a pipeline
                stage: none of them can decode.
        """

    @property
    def max_context(self) -> int | None:
        """The longest sequence the model can attend over (None: unbounded, e.g. a recurrent mixer)."""

    def pipeline_stage(self, start: int, stop: int) -> None:
        """Turn the model, in place, into the pipeline stage that runs blocks ``[start, stop)`` of
        ``len(model.blocks)`` (API 1.3), for a parallel plugin that splits the model over processes.

        Afterwards the stage holds only what it runs: the token embedding on the first stage
        (``start == 0``), the final norm and head on the last (with the embedding too when the head
        shares its weight), the position module everywhere (attention layers use it); blocks
        outside the range are replaced by empty modules, so every remaining parameter keeps its
        name and the stages' state dicts together make the single-device one. ``model(x)`` then
        takes what the previous stage returned (token ids (B, T) on the first stage, hidden states
        (B, T, C) on the others) and returns hidden states, or logits (B, T, V) on the last stage.
        A stage cannot decode (no cache). ``ValueError`` for an empty or out-of-range span.
        """
