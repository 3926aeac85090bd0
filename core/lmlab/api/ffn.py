"""The ffn slot: the position-wise feed-forward part of each block."""

import torch
from torch import nn

from lmlab.api.plugin import Plugin
from lmlab.api.shape import ModelShape


class FFNModule(nn.Module):
    """forward(x (B, T, C)) → (B, T, C).

    A module with an auxiliary training loss (a router's load balancing) stores it in ``aux_loss``
    during forward; the model adds it to the objective's loss and logs it.
    """

    aux_loss: torch.Tensor | None = None
    #: True for a module that stands for "no feed-forward": the block then has no ffn part at all
    #: (no norm, no residual add), as in the original Mamba architecture. (API 1.1)
    skip: bool = False

    def reset_parameters(self, shape: ModelShape) -> None:
        """Initialise weights; output projections into the residual use ``shape.residual_init_std``."""

    def tensor_parallel_plan(self, tp_size: int) -> dict | None:
        """How to split this module over ``tp_size`` tensor-parallel ranks (API 1.3): a plan for
        ``torch.distributed.tensor.parallel.parallelize_module(self, tp_mesh, plan)`` mapping
        submodule names to ``ParallelStyle`` objects, as in Megatron-LM (Shoeybi et al. 2019): the
        projections into the hidden width column-wise (``ColwiseParallel``), the one back row-wise
        (``RowwiseParallel``), so the nonlinearity runs on each rank's slice of the hidden units and
        one all-reduce sums the partial outputs. Same contract as
        :meth:`lmlab.api.AttentionModule.tensor_parallel_plan`: calling it changes nothing, parameter
        names stay, ``ValueError`` when ``tp_size`` does not fit; None (the default) means the module
        does not support tensor parallelism. A ``skip`` module is never asked.
        """
        return None

    def peft_roles(self) -> dict[str, str]:
        """Which submodules play which role for PEFT methods (API 1.4): role → submodule name, with
        ``up`` (into the hidden width), ``down`` (back to ``d_model``) and ``gate`` (a GLU's gate
        projection), e.g. ``{"up": "c_fc", "down": "c_proj"}``. Same contract as
        :meth:`lmlab.api.AttentionModule.peft_roles`; the default, empty, offers nothing to adapt
        by role (MoE experts held as stacked weight tensors)."""
        return {}


class FFN(Plugin):
    """The position-wise part of each block (an MLP, a gated unit, a mixture of experts): :meth:`build`
    makes one :class:`FFNModule` per layer."""

    slot = "ffn"

    def build(self, shape: ModelShape, layer: int) -> FFNModule:
        """Called once per block when the model is assembled."""
        raise NotImplementedError
