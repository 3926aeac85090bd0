"""The ffn slot: the position-wise feed-forward part of each block."""

import torch
from torch import nn

from lmlab.api.plugin import Plugin
from lmlab.api.shape import ModelShape


class FFNModule(nn.Module):
    """The position-wise part of one block: ``forward(x (B, T, C)) → (B, T, C)``, each position on
    its own.

    The block calls ``forward`` on its normalised input (after the mixer's residual add) and adds
    the result to the residual stream (after dropout): in training (train mode, gradients on, under
    the precision's autocast; again during backward when ``train.checkpointing`` recomputes it), in
    evaluation and in decoding (eval mode, no gradients). ``x`` is (B, T, C), C =
    ``shape.d_model``; under a ``*-mixed`` precision dtypes follow ``torch.autocast``'s rules.

    A module with an auxiliary training loss (a router's load balancing) stores it in ``aux_loss``
    during forward; the model adds it to the objective's loss and logs it.
    """

    aux_loss: torch.Tensor | None = None
    """A 0-dim tensor set by every ``forward`` (None: no auxiliary loss). After each training
    forward pass the core sums the ``aux_loss`` of all blocks, adds the sum to the objective's loss
    (what is minimised) and logs it as ``aux_loss``; ``val_loss`` leaves it out."""
    skip: bool = False
    """True for a module that stands for "no feed-forward": the block then has no ffn part at all
    (no norm, no residual add), as in the original Mamba architecture. (API 1.1)"""

    def reset_parameters(self, shape: ModelShape) -> None:
        """Initialise weights; output projections into the residual use ``shape.residual_init_std``.

        Called once when the model is built, before any starting weights are loaded. Default:
        nothing."""

    def tensor_parallel_plan(self, tp_size: int) -> dict | None:
        """How to split this module over ``tp_size`` tensor-parallel ranks (API 1.3): a plan for
        ``torch.distributed.tensor.parallel.parallelize_module(self, tp_mesh, plan)`` mapping
        submodule names to ``ParallelStyle`` objects, as in Megatron-LM (Shoeybi et al. 2019): the
        projections into the hidden width column-wise (``ColwiseParallel``), the one back row-wise
        (``RowwiseParallel``), so the nonlinearity runs on each rank's slice of the hidden units and
        one all-reduce sums the partial outputs. Same contract as
        [AttentionModule.tensor_parallel_plan][lmlab.api.attention.AttentionModule.tensor_parallel_plan]:
        calling it changes nothing, parameter
        names stay, ``ValueError`` when ``tp_size`` does not fit; None (the default) means the module
        does not support tensor parallelism. A ``skip`` module is never asked.
        """
        return None

    def peft_roles(self) -> dict[str, str]:
        """Which submodules play which role for PEFT methods (API 1.4): role → submodule name, with
        ``up`` (into the hidden width), ``down`` (back to ``d_model``) and ``gate`` (a GLU's gate
        projection), e.g. ``{"up": "c_fc", "down": "c_proj"}``. Same contract as
        [AttentionModule.peft_roles][lmlab.api.attention.AttentionModule.peft_roles]; the default,
        empty, offers nothing to adapt
        by role (MoE experts held as stacked weight tensors)."""
        return {}


class FFN(Plugin):
    """The position-wise part of each block (an MLP, a gated unit, a mixture of experts):
    [build][lmlab.api.ffn.FFN.build] makes one [FFNModule][lmlab.api.ffn.FFNModule] per layer."""

    slot = "ffn"

    def build(self, shape: ModelShape, layer: int) -> FFNModule:
        """Make the feed-forward part of block ``layer``.

        Called once per block whenever a model is built, as
        [Attention.build][lmlab.api.attention.Attention.build] is (for a run, on the meta device
        for ``lmlab check``, on fake tensors for ``lmlab plan``, for a trained run loaded back).

        Args:
            shape: The model's shape.
            layer: The block's index, 0 to ``shape.n_layers - 1``.

        Returns:
            A new module (never one shared between blocks).
        """
        raise NotImplementedError
