"""No position information: ``none``.

The token embeddings go to the blocks as they are and attention sees no positions. A causal
transformer can still infer some order from the mask alone (Haviv et al. 2022, "Transformer Language
Models without Positional Encodings Still Learn Positional Information"), and mixers that are
order-aware by construction (a state-space model such as Mamba, a convolution) need nothing more.
"""

from lmlab.api import ModelShape, Position, PositionModule


class NoPositionModule(PositionModule):
    """The base class's defaults: embed, rotate and attention_bias change nothing."""

    per_row = True  # the defaults ignore positions, whatever their shape
    max_positions = None


class NoPosition(Position):
    """``none``: leave token order to the mixer."""

    api = ">=1.8,<2"  # per_row

    def build(self, shape: ModelShape) -> NoPositionModule:
        return NoPositionModule()
