"""Fixed sinusoidal position encoding: ``sinusoidal`` (Vaswani et al. 2017, "Attention Is All You Need", §3.5).

Each position gets a fixed vector, added to the token embedding before the first block:

    PE[pos, 2i]   = sin(pos / base^(2i / d_model))
    PE[pos, 2i+1] = cos(pos / base^(2i / d_model))

The wavelengths form a geometric progression from 2π to 2π·base, so PE[pos + k] is a fixed linear
function (a rotation per frequency) of PE[pos] for every offset k, which the paper hoped would let
the model attend by relative position. Nothing is learned and nothing is tabulated: the encoding is
computed for whatever positions arrive, so the scheme has no longest position.

The paper multiplies the token embeddings by sqrt(d_model) before adding the encoding; lmlab's token
embedding is GPT-2's N(0, init_std) without that factor, so here the encoding (amplitude 1) starts
out larger than the token embeddings it is added to.
"""

import torch

from lmlab.api import Field, ModelShape, Options, Position, PositionModule
from lmlab_position.angles import angles


def sinusoids(positions: torch.Tensor, d_model: int, base: float) -> torch.Tensor:
    """positions (T,) or (B, T) → (T, d_model) or (B, T, d_model) float32 encoding, sin in even and cos
    in odd dimensions."""
    theta = angles(positions, d_model, base)                                    # ([B,] T, ceil(d/2))
    # stack → (..., ceil(d/2), 2) → flatten interleaves: sin, cos, sin, cos, ...; an odd d drops the last cos
    return torch.stack((theta.sin(), theta.cos()), dim=-1).flatten(-2)[..., :d_model]


class SinusoidalEncoding(PositionModule):
    """x + PE[positions], with PE computed on the fly (no parameters, no buffers)."""

    adds_embedding = True
    per_row = True
    max_positions = None  # the formula covers every position

    def __init__(self, d_model: int, base: float):
        super().__init__()
        self.d_model, self.base = d_model, base

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Computed per call: (T, C) sin/cos cost little next to a block, need no bounds check and
        # keep checkpoints free of derived tensors.
        return x + sinusoids(positions, self.d_model, self.base).to(x.dtype)  # (B, T, C) + (T, C) or (B, T, C)


class SinusoidalPositionOptions(Options):
    base: float = Field(10000.0, gt=0, help="wavelengths run from 2π to 2π·base positions")


class SinusoidalPosition(Position):
    """``sinusoidal``: the transformer's fixed sin/cos encoding added to the embeddings."""

    Options = SinusoidalPositionOptions
    api = ">=1.8,<2"  # per_row

    def build(self, shape: ModelShape) -> SinusoidalEncoding:
        return SinusoidalEncoding(shape.d_model, self.options.base)
