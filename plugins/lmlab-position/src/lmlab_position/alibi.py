"""Attention with linear biases: ``alibi`` (Press, Smith & Lewis 2022, "Train Short, Test Long:
Attention with Linear Biases Enables Input Length Extrapolation").

No position is added to the embeddings or to queries and keys. Instead every attention layer adds a
penalty proportional to the distance between query and key to its scores, before the softmax:

    score[h, i, j] = q_i · k_j / sqrt(d) - m_h · |i - j|

Each head h has a fixed slope m_h. For n heads, a power of two, the slopes are the geometric sequence
that starts at 2^(-8/n) with ratio 2^(-8/n) (8 heads: 1/2, 1/4, ..., 1/256), so some heads look far
back and some only at the last few tokens. For other head counts the paper's reference code takes the
slopes of the closest smaller power of two, 2^⌊log2 n⌋, and fills up with every other slope of twice
that many. Because the penalty is defined for every distance, a model trained on short contexts runs
on longer ones; the paper shows it extrapolates where sinusoidal and rotary encodings degrade.

Under causal attention only keys j ≤ i are seen, where |i - j| = i - j, the paper's formula. The bias is
symmetric so that bidirectional attention (a masked-LM objective) penalises distance on both sides of
the query alike, as encoder uses of ALiBi do (e.g. MosaicBERT, Portes et al. 2023); the causal mask
removes keys after the query either way.
"""

import math

import torch

from lmlab.api import ModelShape, Position, PositionModule


def alibi_slopes(n_heads: int) -> list[float]:
    """The per-head slopes of the paper's reference code (``get_slopes``, ofirpress/attention_with_linear_biases)."""
    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        return power_of_two(n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    return power_of_two(closest) + alibi_slopes(2 * closest)[0::2][: n_heads - closest]


class ALiBi(PositionModule):
    """Adds -slope_h · |q_pos - k_pos| to the scores of head h; no parameters, nothing saved."""

    biases = True
    per_row = True
    max_positions = None  # a linear penalty exists for every distance

    def __init__(self, n_heads: int):
        super().__init__()
        # A buffer so it follows the model to its device (no host-to-device copy per layer call);
        # not persistent, so checkpoints hold nothing derived.
        self.register_buffer("slopes", torch.tensor(alibi_slopes(n_heads)), persistent=False)  # (H,)

    def attention_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        distance = (q_positions[..., None] - k_positions).abs().float()                        # ([B,] Tq, Tk)
        return -self.slopes.float()[:, None, None] * distance.unsqueeze(-3)                    # ([B,] H, Tq, Tk)


class ALiBiPosition(Position):
    """``alibi``: per-head linear distance penalties on the attention scores (Press et al. 2022)."""

    api = ">=1.8,<2"  # per_row

    def build(self, shape: ModelShape) -> ALiBi:
        return ALiBi(shape.n_heads)
