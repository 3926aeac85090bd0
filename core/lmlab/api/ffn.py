"""The ffn slot: the position-wise feed-forward part of each block."""

import torch
from torch import nn

from lmlab.api.plugin import Plugin
from lmlab.api.shape import ModelShape


class FFNModule(nn.Module):
    """forward(x (B, T, C)) → (B, T, C).

    A module with an auxiliary training loss (a router's load balancing) stores it in ``aux_loss``
    during forward; the model adds it to the objective's loss and logs it.
    """

    aux_loss: torch.Tensor | None = None
    #: True for a module that stands for "no feed-forward": the block then has no ffn part at all
    #: (no norm, no residual add), as in the original Mamba architecture. (API 1.1)
    skip: bool = False

    def reset_parameters(self, shape: ModelShape) -> None:
        """Initialise weights; output projections into the residual use ``shape.residual_init_std``."""


class FFN(Plugin):
    slot = "ffn"

    def build(self, shape: ModelShape, layer: int) -> FFNModule:
        """Called once per block when the model is assembled."""
        raise NotImplementedError
