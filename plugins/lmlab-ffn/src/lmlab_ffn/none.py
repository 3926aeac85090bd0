"""No feed-forward: ``none``.

Leaves each block with its token mixer alone: no norm, no MLP, no residual branch. This is the
original Mamba architecture (Gu & Dao 2023), whose blocks are a mixer and nothing else, and the
way to ask "what does the MLP buy?" in an ablation.
"""

import torch

from lmlab.api import FFN, FFNModule, ModelShape


class NoFeedForward(FFNModule):
    """Stands for the absence of a feed-forward part; the model skips it (``skip = True``)."""

    skip = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)  # only reached when called directly; the block never calls it


class NoFFN(FFN):
    """``none``: mixer-only blocks."""

    api = ">=1.1,<2"  # FFNModule.skip

    def build(self, shape: ModelShape, layer: int) -> NoFeedForward:
        return NoFeedForward()
