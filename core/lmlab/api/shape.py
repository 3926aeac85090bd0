"""The model shape every architecture plugin is built against."""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The ``[model]`` table as architecture plugins see it (``vocab_size`` comes from the tokenizer)."""

    n_layers: int
    d_model: int
    n_heads: int
    block_size: int
    vocab_size: int
    dropout: float = 0.0
    bias: bool = False
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def residual_init_std(self) -> float:
        """Std for projections that write into the residual stream (GPT-2's 1/sqrt(2L) scaling)."""
        return self.init_std / math.sqrt(2 * self.n_layers)
