"""T5's relative position bias: ``t5`` (Raffel et al. 2020, "Exploring the Limits of Transfer Learning
with a Unified Text-to-Text Transformer", §2.1).

Nothing is added to the embeddings or to queries and keys. Every attention layer adds a learned scalar
per head to its scores, chosen by the relative position of key and query:

    score[h, i, j] = q_i · k_j + b[bucket(pos_j - pos_i), h]

with ``b`` a (num_buckets, n_heads) table. Relative positions are grouped into buckets: the nearest
distances each have their own bucket, larger ones share logarithmically wider buckets up to
``max_distance``, and everything farther shares the last bucket, so the table is small and defined for
every distance. One table serves every layer, as in T5, where only the first layer of a stack holds
it and passes its bias on.

A stack whose mixers see both sides (``ModelShape.causal`` False: T5's encoder, or a model for a
bidirectional objective) is *bidirectional*: half the buckets are for keys before the query, half for
keys after it. A causal stack (T5's decoder) only sees keys at or before the query, so all buckets go
to that side and keys after the query share bucket 0 with the query's own position (the causal mask
removes them anyway). The bucketing is Hugging Face's ``T5Attention._relative_position_bucket``
(itself Mesh TensorFlow's) operation for operation, so the buckets are identical and a T5 checkpoint's
``relative_attention_bias.weight`` loads unchanged.
"""

import math

import torch
from torch import nn

from lmlab.api import Field, ModelShape, Options, Position, PositionModule, UserError


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """The bucket (int64, in [0, num_buckets)) of each relative position ``key - query``; Hugging Face's
    ``T5Attention._relative_position_bucket``, with the same float32 log formula so the buckets agree."""
    relative_position = relative_position.long()
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets  # keys after the query: upper half
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)  # keys after the query count as distance 0
    # Half of the buckets are exact distances 0 .. max_exact - 1, the other half logarithmic bins up to
    # max_distance. The clamp only keeps log(0) = -inf out of the unused branch (its cast to int64 is
    # undefined); it changes no value torch.where picks, since those have distance >= max_exact.
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    if_large = max_exact + (
        torch.log(distance.clamp(min=max_exact).float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    if_large = if_large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, if_large)


class T5RelativeBias(PositionModule):
    """Adds relative_attention_bias(bucket(k_pos - q_pos))[h] to the scores of head h."""

    biases = True
    per_row = True
    max_positions = None  # every distance falls in a bucket (the farthest share the last one)

    def __init__(self, n_heads: int, num_buckets: int, max_distance: int, bidirectional: bool):
        super().__init__()
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        # The name of T5's parameter, so a checkpoint's ``relative_attention_bias.weight`` maps 1:1.
        self.relative_attention_bias = nn.Embedding(num_buckets, n_heads)

    def buckets(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """The bucket of every (query, key) pair: ([B,] Tq, Tk) int64."""
        return relative_position_bucket(k_positions - q_positions[..., None], self.bidirectional,
                                        self.num_buckets, self.max_distance)

    def attention_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        values = self.relative_attention_bias(self.buckets(q_positions, k_positions))  # ([B,] Tq, Tk, H)
        return values.movedim(-1, -3)                                                  # ([B,] H, Tq, Tk)

    def reset_parameters(self, shape: ModelShape) -> None:
        # The model's init_std, as for the other weights. T5 itself (Hugging Face's _init_weights, from
        # Mesh TensorFlow) draws this table with std initializer_factor · d_model ** -0.5.
        nn.init.normal_(self.relative_attention_bias.weight, mean=0.0, std=shape.init_std)


class T5RelativePositionOptions(Options):
    num_buckets: int = Field(32, ge=4, le=4096,
                             help="rows of the bias table: relative-position buckets (split in two halves, before "
                                  "and after the query, in a bidirectional stack)")
    max_distance: int = Field(128, ge=2, le=1_000_000,
                              help="distance at which the logarithmic buckets end: all farther keys share the last "
                                   "bucket of their side")


class T5RelativePosition(Position):
    """``t5``: T5's learned, bucketed relative position bias on the attention scores (Raffel et al. 2020)."""

    Options = T5RelativePositionOptions
    api = ">=1.13,<2"  # ModelShape.causal

    def build(self, shape: ModelShape) -> T5RelativeBias:
        num_buckets, max_distance = self.options.num_buckets, self.options.max_distance
        bidirectional = not shape.causal
        # Exact buckets cover distances below max_exact; the logarithmic ones need room above it.
        max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
        if max_distance <= max_exact:
            raise UserError(f"t5 gives its first {max_exact} relative distances a bucket each and the rest "
                            f"logarithmic buckets up to position.max_distance, which must therefore exceed "
                            f"{max_exact} (num_buckets = {num_buckets}, "
                            f"{'bidirectional' if bidirectional else 'causal'}); got {max_distance}",
                            key="position.max_distance")
        return T5RelativeBias(shape.n_heads, num_buckets, max_distance, bidirectional)
