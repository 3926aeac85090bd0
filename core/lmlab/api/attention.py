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

    def tensor_parallel_plan(self, tp_size: int) -> dict | None:
        """How to split this module over ``tp_size`` tensor-parallel ranks (API 1.3): a plan for
        ``torch.distributed.tensor.parallel.parallelize_module(self, tp_mesh, plan)``, mapping
        submodule names to ``ParallelStyle`` objects, in the manner of Megatron-LM (Shoeybi et al.
        2019): query/key/value projections column-wise and the output projection row-wise, so each
        rank computes ``n_heads / tp_size`` whole heads and one all-reduce sums the partial outputs.

        The parallel plugin calls this when the model is built (to refuse a bad layout before any
        process starts), and again in every process before it applies the plan. Calling it changes
        nothing; applying the plan must leave the module computing with its local share (its heads,
        its slice of an ``attention_bias``), taking and returning replicated ``(B, T, C)`` tensors.
        Parameter names must not change: checkpoints hold the gathered full weights under the
        single-device names (a fused projection whose sharding is not a plain split of its rows
        restores that layout in its state dict, for saving and loading). Raise ``ValueError``
        saying why when the module cannot be split ``tp_size`` ways (heads not divisible); the
        default, None, means the module does not support tensor parallelism.
        """
        return None


class Attention(Plugin):
    slot = "attention"

    def build(self, shape: ModelShape, layer: int) -> AttentionModule:
        """Called once per block when the model is assembled."""
        raise NotImplementedError
