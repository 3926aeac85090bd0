"""The model shape every architecture plugin is built against."""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The ``[model]`` table as architecture plugins see it (``vocab_size`` comes from the tokenizer).

    Every ``build`` of the position, attention and ffn slots receives it, as do the modules'
    ``reset_parameters``.
    """

    n_layers: int
    """Blocks in the model (``model.n_layers``)."""
    d_model: int
    """Width of the residual stream, C (``model.d_model``)."""
    n_heads: int
    """Attention heads (``model.n_heads``)."""
    block_size: int
    """Tokens per training window, T, and the context a position scheme must cover
    (``model.block_size``)."""
    vocab_size: int
    """Rows of the embedding and head, V: the tokenizer's vocabulary plus the objective's reserved
    special ids, or ``model.vocab_size`` when set (a stand-in under ``lmlab check`` when the
    tokenizer learns its vocabulary from the data)."""
    dropout: float = 0.0
    """Dropout probability (``model.dropout``): the model applies it to the embeddings and to each
    residual branch, attention modules to their attention weights, in training mode only."""
    bias: bool = False
    """Whether linear layers and LayerNorms have biases (``model.bias``)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation (``model.init_std``)."""
    explicit_head_dim: int | None = None
    """``model.head_dim`` when the manifest sets it (API 1.20): heads of another size than
    ``d_model / n_heads`` (Qwen3, Gemma). Read :attr:`head_dim`, which falls back to that quotient."""
    causal: bool = True
    """False for a stack whose mixers see both sides (API 1.13): the encoder of an encoder–decoder
    model, or a model built for a bidirectional objective. A position scheme that treats the two
    directions differently (T5's relative buckets) builds for it; the blocks of such a stack get
    ``MixerContext.causal`` False."""

    @property
    def head_dim(self) -> int:
        """Size of one attention head: ``model.head_dim``, by default ``d_model // n_heads``."""
        return self.explicit_head_dim or self.d_model // self.n_heads

    @property
    def residual_init_std(self) -> float:
        """Std for projections that write into the residual stream (GPT-2's 1/sqrt(2L) scaling)."""
        return self.init_std / math.sqrt(2 * self.n_layers)
