"""The attention slot: the token mixer of each block (softmax attention or a state-space mixer)."""

from dataclasses import dataclass

import torch
from torch import nn

from lmlab.api.plugin import Plugin
from lmlab.api.position import PositionModule
from lmlab.api.shape import ModelShape


@dataclass
class MixerContext:
    """What every layer of one forward pass shares: built once per forward by the model.

    ``positions`` (T,) are the absolute positions of the T input tokens; ``start`` is how many tokens
    the inference cache already holds (0 in training, where ``cache`` is None).
    """

    position: PositionModule
    positions: torch.Tensor
    start: int = 0


class AttentionModule(nn.Module):
    """forward(x (B, T, C), ctx, state) → (B, T, C). Must be causal: output t sees inputs ≤ t only."""

    def forward(self, x: torch.Tensor, ctx: MixerContext, state=None) -> torch.Tensor:
        raise NotImplementedError

    def new_state(self, batch_size: int, max_len: int, device, dtype):
        """Fresh inference state for decoding up to ``max_len`` tokens (see ``lmlab.api.cache``)."""
        raise NotImplementedError

    def reset_parameters(self, shape: ModelShape) -> None:
        """Initialise weights; output projections into the residual use ``shape.residual_init_std``."""


class Attention(Plugin):
    slot = "attention"

    def build(self, shape: ModelShape, layer: int) -> AttentionModule:
        """Called once per block when the model is assembled."""
        raise NotImplementedError
