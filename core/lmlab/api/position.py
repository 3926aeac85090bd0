"""The position slot: how token order reaches the model.

A position scheme acts in one or more of three places, and an attention plugin never needs to know
which scheme is in use: the model calls [PositionModule.embed][lmlab.api.position.PositionModule.embed]
on the token embeddings, and every attention layer calls
[PositionModule.rotate][lmlab.api.position.PositionModule.rotate] on its queries and keys and adds
[PositionModule.attention_bias][lmlab.api.position.PositionModule.attention_bias] to its scores.
Defaults do nothing, so a scheme overrides only the places it acts in and sets the matching flag so
the others can be skipped at build time.
"""

from typing import ClassVar

import torch
from torch import nn

from lmlab.api.plugin import Plugin
from lmlab.api.shape import ModelShape


class PositionModule(nn.Module):
    """One module per model, shared by every layer (the model's ``position``; attention layers
    reach it as [MixerContext.position][lmlab.api.attention.MixerContext.position]).

    Its methods run inside every forward pass: in training (train mode, gradients on, under the
    precision's autocast), in evaluation and in decoding (eval mode, no gradients). ``positions``
    are absolute (a decoding step's positions continue the cached ones), int64, on the input's
    device.
    """

    adds_embedding: ClassVar[bool] = False
    """True when [embed][lmlab.api.position.PositionModule.embed] changes its input (a learned or
    sinusoidal table)."""
    rotates: ClassVar[bool] = False
    """True when [rotate][lmlab.api.position.PositionModule.rotate] changes queries and keys (RoPE);
    attention plugins skip the call otherwise."""
    biases: ClassVar[bool] = False
    """True when [attention_bias][lmlab.api.position.PositionModule.attention_bias] returns a bias
    (ALiBi); attention plugins skip the call otherwise."""
    per_row: ClassVar[bool] = False
    """True when every method also takes per-row positions, (B, T) instead of (T,) (API 1.8), as
    ragged decoding passes them: ``embed`` gets (B, T) positions for (B, T, C) embeddings,
    ``rotate`` (B, T) for (B, H, T, hs) queries, and ``attention_bias`` (B, Tq) query positions
    (keys stay (Tk,)) and returns (B, H, Tq, Tk). Without it, the core generates one sequence at a
    time."""
    max_positions: int | None = None
    """Positions this scheme can represent (a learned table's rows); None means unbounded. The
    model's ``max_context``: a forward pass past it raises ``ValueError``, and decoders slide their
    window within it."""

    def reset_parameters(self, shape: ModelShape) -> None:
        """Initialise learned weights, if any. Called once when the model is built, before any
        starting weights are loaded. Default: nothing."""

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Mix positions into the token embeddings; called once per forward pass, by the model,
        before the first block (and before the embedding dropout).

        Args:
            x: (B, T, C) token embeddings, in the parameters' dtype.
            positions: (T,) absolute positions of the tokens; (B, T) when ``per_row``.

        Returns:
            The embeddings (B, T, C) with positions mixed in. Default: ``x`` unchanged.
        """
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """Apply positions to queries and keys; called by attention layers when
        [rotates][lmlab.api.position.PositionModule.rotates] is True.

        Args:
            q: (B, H, T, hs) queries.
            k: (B, H_kv, T, hs) keys (H_kv divides H under grouped-query attention).
            positions: (T,) absolute positions of these queries and keys; (B, T) when ``per_row``.

        Returns:
            The pair (q, k) with positions applied, same shapes. Default: unchanged.
        """
        return q, k

    def attention_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor | None:
        """The additive bias of attention scores; called by attention layers when
        [biases][lmlab.api.position.PositionModule.biases] is True.

        Args:
            q_positions: (Tq,) absolute positions of the queries; (B, Tq) when ``per_row``.
            k_positions: (Tk,) absolute positions of the keys (all cached ones too, in decoding).

        Returns:
            A bias (H, Tq, Tk) ((B, H, Tq, Tk) for per-row queries) added to the scores before the softmax, or
            None (the default). A tensor-parallel attention layer takes its heads' slice of it.
        """
        return None


class Position(Plugin):
    """How token order reaches the model: [build][lmlab.api.position.Position.build] makes one
    [PositionModule][lmlab.api.position.PositionModule] that every layer shares, acting in the places
    its flags name (embedding, rotation, attention bias)."""

    slot = "position"

    def build(self, shape: ModelShape) -> PositionModule:
        """Make the model's position module. Called once whenever a model is built (for a run, for
        ``lmlab check`` on the meta device, for ``lmlab plan``, for a trained run loaded back).

        Args:
            shape: The model's shape; ``max_positions`` must cover ``shape.block_size``.

        Returns:
            The module every layer shares.
        """
        raise NotImplementedError
