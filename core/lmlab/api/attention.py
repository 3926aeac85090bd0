"""The attention slot: the token mixer of each block (softmax attention or a state-space mixer).

Mixers are causal unless asked otherwise: ``MixerContext.causal`` is False only in a model built for
an objective that is not (``Objective.causal = False``, masked language modelling), and the core
builds such a model only with an attention plugin that declares ``bidirectional = True`` (API 1.4).
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from lmlab.api.plugin import Plugin
from lmlab.api.position import PositionModule
from lmlab.api.shape import ModelShape


@dataclass
class MixerContext:
    """What every layer of one forward pass shares: built once per forward by the model.

    ``positions`` (T,) are the absolute positions of the T input tokens; ``start`` is how many tokens
    the inference cache already holds (0 in training, where ``cache`` is None). ``causal`` (API 1.4):
    True, output t sees inputs ≤ t only; False, every output sees every input (no mask at all; a
    position scheme's ``attention_bias`` still applies, for keys on both sides). It is fixed for a
    model when it is built, so a module may branch on it without a cost per step.
    """

    position: PositionModule
    positions: torch.Tensor
    start: int = 0
    causal: bool = True


class AttentionModule(nn.Module):
    """forward(x (B, T, C), ctx, state) → (B, T, C). Causal when ``ctx.causal`` (output t sees inputs
    ≤ t only); when the plugin declares ``Attention.bidirectional``, with ``ctx.causal`` False every
    output sees every input."""

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

    def peft_roles(self) -> dict[str, str]:
        """Which submodules play which role for PEFT methods (API 1.4): role → submodule name, e.g.
        ``{"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"}`` for softmax attention
        (queries, keys, values, output projection); a mixer without those names its own (Mamba:
        ``in``, ``x``, ``o``). Manifests name roles (``[peft] targets = ["q", "v"]``), so one
        manifest adapts the same layers whichever attention plugin built them. The submodules are
        usually ``nn.Linear``; a PEFT method may replace them with wrappers, so the forward pass must
        only call them. The default, empty, offers nothing to adapt by role."""
        return {}


class Attention(Plugin):
    """The token mixer of each block: :meth:`build` makes one :class:`AttentionModule` per layer, causal,
    and bidirectional too when the plugin declares :attr:`bidirectional`."""

    slot = "attention"
    #: Whether the modules honour ``MixerContext.causal = False`` (API 1.4). A model for a bidirectional
    #: objective (``mlm``) is built only with a plugin that says True; ``lmlab.testing.check_attention``
    #: then checks that every output really sees every input. A recurrent mixer stays False.
    bidirectional: ClassVar[bool] = False

    def build(self, shape: ModelShape, layer: int) -> AttentionModule:
        """Called once per block when the model is assembled."""
        raise NotImplementedError
