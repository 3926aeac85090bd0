"""The position slot: how token order reaches the model.

A position scheme acts in one or more of three places, and an attention plugin never needs to know
which scheme is in use: the model calls :meth:`PositionModule.embed` on the token embeddings, and
every attention layer calls :meth:`PositionModule.rotate` on its queries and keys and adds
:meth:`PositionModule.attention_bias` to its scores. Defaults do nothing, so a scheme overrides only
the places it acts in and sets the matching flag so the others can be skipped at build time.
"""

from typing import ClassVar

import torch
from torch import nn

from lmlab.api.plugin import Plugin
from lmlab.api.shape import ModelShape


class PositionModule(nn.Module):
    adds_embedding: ClassVar[bool] = False
    rotates: ClassVar[bool] = False
    biases: ClassVar[bool] = False
    max_positions: int | None = None  # positions this scheme can represent; None means unbounded

    def reset_parameters(self, shape: ModelShape) -> None:
        """Initialise learned weights, if any."""

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, T, C), positions (T,) absolute indices → x with positions mixed in."""
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q (B, H, T, hs), k (B, H_kv, T, hs), positions (T,) → (q, k) with positions applied."""
        return q, k

    def attention_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor | None:
        """Additive score bias (H, Tq, Tk) for queries at q_positions over keys at k_positions."""
        return None


class Position(Plugin):
    """How token order reaches the model: :meth:`build` makes one :class:`PositionModule` that every
    layer shares, acting in the places its flags name (embedding, rotation, attention bias)."""

    slot = "position"

    def build(self, shape: ModelShape) -> PositionModule:
        """Called once per model; the module is shared by every layer."""
        raise NotImplementedError
