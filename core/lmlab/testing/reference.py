"""Small reference modules the kit tests plugins against, written for clarity rather than speed.

The kit depends on no plugin: a position plugin is checked inside the core's ``LanguageModel``
assembled with :class:`ReferenceAttention` and :class:`ReferenceFFN`, and an attention plugin is
checked under :class:`ReferencePosition`, a scheme that both rotates queries and keys and biases
scores, so that a mixer which mishandles positions (during cached decoding, say) shows it.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.api import FFN, Attention, AttentionModule, FFNModule, KVCache, MixerContext, ModelShape, Position
from lmlab.api import PositionModule


class ReferenceAttentionModule(AttentionModule):
    """Causal (or, with ``ctx.causal`` False, unmasked) softmax attention of n_heads queries over
    n_kv_heads keys/values, spelled out.

    It honours the position scheme as the API asks: ``rotate`` on queries and keys when the scheme
    ``rotates``, ``attention_bias`` added to the scores when it ``biases``; both before masking. It
    gives its ``kv_layout``, so the core can decode rows of different lengths together through it
    (per-row positions, ``ctx.key_mask`` in place of the causal mask).
    """

    def __init__(self, shape: ModelShape, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = shape.n_heads, n_kv_heads, shape.head_dim
        self.q_proj = nn.Linear(shape.d_model, shape.n_heads * shape.head_dim, bias=False)
        self.k_proj = nn.Linear(shape.d_model, n_kv_heads * shape.head_dim, bias=False)
        self.v_proj = nn.Linear(shape.d_model, n_kv_heads * shape.head_dim, bias=False)
        self.out_proj = nn.Linear(shape.n_heads * shape.head_dim, shape.d_model, bias=False)

    def forward(self, x: torch.Tensor, ctx: MixerContext, state: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, hs = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, hs).transpose(1, 2)                    # (B, H, T, hs)
        k = self.k_proj(x).view(B, T, Hkv, hs).transpose(1, 2)                  # (B, Hkv, T, hs)
        v = self.v_proj(x).view(B, T, Hkv, hs).transpose(1, 2)                  # (B, Hkv, T, hs)
        if ctx.position.rotates:
            q, k = ctx.position.rotate(q, k, ctx.positions)
        if state is not None:
            k, v = state.update(k, v, ctx.start)                                # (B, Hkv, S, hs)
        S = k.shape[2]
        if ctx.key_mask is not None:  # ragged decoding: rows differ in length, so slot s holds position s
            k_positions = torch.arange(S, device=x.device)
        else:  # the S keys are the consecutive positions that end at the last query's
            k_positions = ctx.positions[-1] - S + 1 + torch.arange(S, device=x.device)
        k = k.repeat_interleave(H // Hkv, dim=1)                                # (B, H, S, hs)
        v = v.repeat_interleave(H // Hkv, dim=1)
        scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(hs)              # (B, H, T, S)
        if ctx.position.biases:
            scores = scores + ctx.position.attention_bias(ctx.positions, k_positions).float()
        if ctx.key_mask is not None:  # (B, 1, T, S): causality and each row's length
            scores = scores.masked_fill(~ctx.key_mask, float("-inf"))
        elif ctx.causal:
            visible = k_positions[None, :] <= ctx.positions[:, None]             # (T, S)
            scores = scores.masked_fill(~visible, float("-inf"))
        weights = scores.softmax(dim=-1).to(v.dtype)
        y = (weights @ v).transpose(1, 2).reshape(B, T, H * hs)                 # (B, T, H*hs)
        return self.out_proj(y)

    def new_state(self, batch_size: int, max_len: int, device, dtype) -> KVCache:
        return KVCache(batch_size, self.n_kv_heads, max_len, self.head_dim, device=device, dtype=dtype)

    def kv_layout(self) -> tuple[int, int]:
        return self.n_kv_heads, self.head_dim

    def reset_parameters(self, shape: ModelShape) -> None:
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.normal_(proj.weight, 0.0, shape.init_std)
        nn.init.normal_(self.out_proj.weight, 0.0, shape.residual_init_std)


class ReferenceAttention(Attention):
    """The attention the kit assembles position plugins with: grouped (n_heads / 2 key/value heads,
    when n_heads is even) so that a scheme's ``rotate`` meets keys with fewer heads than queries."""

    name = "reference"
    bidirectional = True

    def build(self, shape: ModelShape, layer: int) -> ReferenceAttentionModule:
        return ReferenceAttentionModule(shape, shape.n_heads // 2 if shape.n_heads % 2 == 0 else shape.n_heads)


class ReferenceMLP(FFNModule):
    """down(gelu(up(x))), position by position."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.up = nn.Linear(shape.d_model, 2 * shape.d_model, bias=False)
        self.down = nn.Linear(2 * shape.d_model, shape.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))

    def reset_parameters(self, shape: ModelShape) -> None:
        nn.init.normal_(self.up.weight, 0.0, shape.init_std)
        nn.init.normal_(self.down.weight, 0.0, shape.residual_init_std)


class ReferenceFFN(FFN):
    name = "reference"

    def build(self, shape: ModelShape, layer: int) -> ReferenceMLP:
        return ReferenceMLP(shape)


class ReferencePositionModule(PositionModule):
    """Rotates queries and keys (rotary, in float32) and adds a linear distance penalty (ALiBi-like).

    Not a scheme anyone should train with: it acts in both attention-side places so that an attention
    plugin checked under it must pass the right absolute positions to ``rotate`` and the right query
    and key positions to ``attention_bias``, in training and in cached decoding alike, and per row
    in ragged decoding.
    """

    rotates = True
    biases = True
    per_row = True

    def __init__(self, shape: ModelShape):
        super().__init__()
        half = shape.head_dim // 2
        self.register_buffer("inv_freq", 1.0 / 100.0 ** (torch.arange(half, dtype=torch.float) / max(half, 1)),
                             persistent=False)
        self.register_buffer("slopes", 2.0 ** -torch.arange(1, shape.n_heads + 1, dtype=torch.float),
                             persistent=False)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        angles = positions[..., None].float() * self.inv_freq.float()            # (T, hs/2) or (B, T, hs/2)
        if angles.dim() == 3:  # per-row positions: (B, 1, T, hs/2), one row's angles for all its heads
            angles = angles[:, None]
        cos, sin = angles.cos(), angles.sin()
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def attention_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        distance = (q_positions[..., None] - k_positions).abs().float()         # ([B,] Tq, Tk)
        return -self.slopes.float()[:, None, None] * distance.unsqueeze(-3)      # ([B,] H, Tq, Tk)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn each pair (x[i], x[i + hs/2]) of the last dimension through its angle; odd hs keeps the last."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half].float(), x[..., half:2 * half].float(), x[..., 2 * half:]
    turned = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)
    return torch.cat((turned, rest), dim=-1)


class ReferencePosition(Position):
    name = "reference"

    def build(self, shape: ModelShape) -> ReferencePositionModule:
        return ReferencePositionModule(shape)


def reference_model(shape: ModelShape, position: Position, norm: str = "layernorm"):
    """The core ``LanguageModel`` with ``position`` and the kit's reference attention and ffn."""
    from lmlab.model import LanguageModel

    return LanguageModel(shape, position=position, attention=ReferenceAttention(), ffn=ReferenceFFN(), norm=norm)
