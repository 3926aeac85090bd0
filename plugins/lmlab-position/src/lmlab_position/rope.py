"""Rotary position embedding: ``rope`` (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary
Position Embedding").

Each query and key is rotated, pair of dimensions by pair, through an angle proportional to its
position: dimension pair i turns at frequency ``base ** (-2i / head_dim)``. A rotation preserves
norms, and the dot product of a query rotated to m with a key rotated to n depends on m and n only
through m - n, so attention scores see relative positions while nothing is added to the residual
stream.

Context extension rescales the frequencies (``scaling``): ``linear`` divides them all by ``factor``
(position interpolation, Chen et al. 2023); ``llama3`` divides only the slow ones, whose wavelength
exceeds ``original_max_positions / low_freq_factor``, keeps the fast ones below
``original_max_positions / high_freq_factor`` and blends in between (Llama 3.1's scheme, as
transformers computes it).

``fraction`` rotates only the first part of each head (GPT-NeoX's partial rotary: Pythia turns a
quarter of each head's dimensions), leaving the rest to match by content alone.

Dimensions are paired as (i, i + head_dim/2) — the "rotate_half" layout of GPT-NeoX, Llama and
Hugging Face transformers — rather than the interleaved (2i, 2i+1) pairs of the paper, so weights
move to and from Hugging Face checkpoints unchanged.
"""

import math
from typing import Literal

import torch

from lmlab.api import Field, ModelShape, Options, Position, PositionModule, UserError
from lmlab_position.angles import angles, frequencies


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) → (-x2, x1) on the two halves of the last dimension: a quarter turn of every pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(PositionModule):
    """Rotates q (B, H, T, hs) and k (B, Hkv, T, hs) by their positions: the first ``head_dim`` of the
    hs dimensions of each head (all of them, unless partial rotary leaves the rest as they are)."""

    rotates = True
    per_row = True
    max_positions = None  # angles exist for every position

    def __init__(self, head_dim: int, base: float, inv_freq: torch.Tensor | None = None):
        super().__init__()
        self.head_dim, self.base = head_dim, base  # head_dim: the rotated dimensions
        self.inv_freq = inv_freq  # rescaled frequencies (context extension), or None for base's own
        self._last: tuple | None = None  # (positions, dtype, cos, sin) of the last eval-mode call

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = angles(positions, self.head_dim, self.base, self.inv_freq)       # (T, hs/2) or (B, T, hs/2) float32
        emb = torch.cat((freqs, freqs), dim=-1)                                 # pair i and i + hs/2 share an angle
        if emb.dim() == 3:  # per-row positions: (B, 1, T, hs), one row's angles for all its heads
            emb = emb[:, None]
        return emb.cos(), emb.sin()

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        # Computed per call rather than looked up in a table: (T, hs) cos/sin cost little next to
        # attention, need no bounds check (which would sync the device) and stay exact in float32.
        # Every layer of a forward pass gets the same positions tensor, a new one per pass
        # (MixerContext.positions): in decoding, where a step's few operations per layer are most of
        # its time, compute its angles once, not per layer. Never while compiling or capturing a
        # CUDA graph, which must record the computation itself.
        memo = not self.training and not torch.compiler.is_compiling() and not (
            q.is_cuda and torch.cuda.is_current_stream_capturing())
        last = self._last
        if memo and last is not None and last[0] is positions and last[1] == q.dtype:
            cos, sin = last[2], last[3]
        else:
            cos, sin = self._angles(positions)
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # broadcast over batch and heads, so H != Hkv is fine
            if memo:
                self._last = (positions, q.dtype, cos, sin)
        if q.shape[-1] != self.head_dim:  # partial rotary: the rest of each head passes unrotated
            r = self.head_dim
            return (torch.cat((q[..., :r] * cos + rotate_half(q[..., :r]) * sin, q[..., r:]), dim=-1),
                    torch.cat((k[..., :r] * cos + rotate_half(k[..., :r]) * sin, k[..., r:]), dim=-1))
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RotaryPositionOptions(Options):
    base: float = Field(10000.0, gt=0, help="rotary base (theta): the slowest pair turns once every ~2π·base positions")
    scaling: Literal["none", "linear", "llama3"] = Field(
        "none", help="context extension: linear divides every frequency by factor; llama3 only the slow ones")
    factor: float = Field(1.0, ge=1, help="scaling: how much longer a context the model is stretched to")
    low_freq_factor: float = Field(1.0, gt=0, help="llama3: pairs slower than original_max_positions / this are "
                                                  "divided by factor")
    high_freq_factor: float = Field(4.0, gt=0, help="llama3: pairs faster than original_max_positions / this are kept")
    original_max_positions: int = Field(8192, gt=0, help="llama3: the context the model was pre-trained on")
    fraction: float = Field(1.0, gt=0, le=1, help="the share of each head's dimensions rotated (GPT-NeoX's "
                                                  "rotary_pct, 0.25 in Pythia); the rest carry no position")


def scaled_frequencies(head_dim: int, o: RotaryPositionOptions) -> torch.Tensor | None:
    """The frequencies ``o.scaling`` rescales (None without scaling), as transformers' rope_init_fn."""
    if o.scaling == "none":
        return None
    inv_freq = frequencies(head_dim, o.base)
    if o.scaling == "linear":
        return inv_freq / o.factor
    if o.high_freq_factor <= o.low_freq_factor:
        raise UserError("must exceed position.low_freq_factor", key="position.high_freq_factor")
    low_wavelen, high_wavelen = o.original_max_positions / o.low_freq_factor, o.original_max_positions / o.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / o.factor, inv_freq)
    smooth = (o.original_max_positions / wavelen - o.low_freq_factor) / (o.high_freq_factor - o.low_freq_factor)
    smoothed = (1 - smooth) * scaled / o.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryPosition(Position):
    """``rope``: rotate queries and keys by position (RoFormer)."""

    Options = RotaryPositionOptions
    api = ">=1.8,<2"  # per_row

    def build(self, shape: ModelShape) -> RotaryEmbedding:
        rotated = int(shape.head_dim * self.options.fraction)  # as GPT-NeoX rounds rotary_pct · head_dim
        if rotated % 2 or not rotated:
            raise UserError(f"rope rotates pairs of dimensions, so the rotated part of a head (head size "
                            f"{shape.head_dim} × position.fraction {self.options.fraction}) must be even and "
                            f"positive; got {rotated}", key="position.fraction" if self.options.fraction < 1
                            else "position.use")
        return RotaryEmbedding(rotated, self.options.base, scaled_frequencies(rotated, self.options))
