"""Learned absolute position embeddings: ``learned``.

One trained vector per position, added to the token embedding before the first block, as in GPT
(Radford et al. 2018) and GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners"). The table has ``block_size`` rows, so the model cannot see positions beyond its
training context.
"""

import torch
from torch import nn

from lmlab.api import ModelShape, Position, PositionModule


class LearnedPositionEmbedding(PositionModule):
    """x + wpe[positions], with wpe an (block_size, d_model) table."""

    adds_embedding = True
    per_row = True

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.max_positions = shape.block_size
        self.wpe = nn.Embedding(shape.block_size, shape.d_model)
        self.reset_parameters(shape)

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # The model refuses positions beyond max_positions before calling (no device sync here).
        return x + self.wpe(positions)  # (B, T, C) + (T, C), or (B, T, C) for per-row positions

    def reset_parameters(self, shape: ModelShape) -> None:
        nn.init.normal_(self.wpe.weight, mean=0.0, std=shape.init_std)


class LearnedPosition(Position):
    """``learned``: GPT-2's trained position table, added to the token embeddings."""

    api = ">=1.8,<2"  # per_row

    def build(self, shape: ModelShape) -> LearnedPositionEmbedding:
        return LearnedPositionEmbedding(shape)
