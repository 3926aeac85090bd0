"""Gated feed-forward network with a SiLU (Swish) gate: ``swiglu``.

Shazeer 2020, "GLU Variants Improve Transformer": replace the first linear map and its activation
with the product of two linear maps, one passed through SiLU (Swish-1):
``down(silu(gate(x)) * up(x))``. Used by PaLM and Llama (Touvron et al. 2023). With three weight
matrices instead of two, Llama shrinks the hidden width to 2/3 of 4 x d_model to keep the parameter
count, then rounds it up to a multiple of ``multiple_of`` for efficient matmuls.
"""

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.api import FFN, FFNModule, Field, ModelShape, Options


def llama_hidden(d_model: int, multiple_of: int) -> int:
    """Llama's width: 2/3 of 4 x d_model, rounded up to a multiple of ``multiple_of``."""
    hidden = int(2 * (4 * d_model) / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class SwiGLU(FFNModule):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), with Llama's parameter names."""

    def __init__(self, shape: ModelShape, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(shape.d_model, hidden, bias=shape.bias)
        self.up_proj = nn.Linear(shape.d_model, hidden, bias=shape.bias)
        self.down_proj = nn.Linear(hidden, shape.d_model, bias=shape.bias)
        # No dropout here: the model applies residual dropout to every block output.
        self.reset_parameters(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, C) → (B, T, hidden) → (B, T, C)

    def tensor_parallel_plan(self, tp_size: int) -> dict:
        # Megatron-LM (Shoeybi et al. 2019): gate and up split alike, so each rank gates its own
        # slice of the hidden units; one all-reduce after down_proj.
        hidden = self.up_proj.out_features
        if hidden % tp_size:  # an uneven split would need the shard sizes passed along; refuse it instead
            raise ValueError(f"{tp_size} tensor-parallel ranks must split the {hidden} hidden units evenly")
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}

    def peft_roles(self) -> dict[str, str]:
        return {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}

    def reset_parameters(self, shape: ModelShape) -> None:
        nn.init.normal_(self.gate_proj.weight, mean=0.0, std=shape.init_std)
        nn.init.normal_(self.up_proj.weight, mean=0.0, std=shape.init_std)
        nn.init.normal_(self.down_proj.weight, mean=0.0, std=shape.residual_init_std)
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)


class SwiGLUOptions(Options):
    hidden: int | None = Field(None, gt=0, help="hidden width; default (unset) = Llama's rule from multiple_of")
    multiple_of: int = Field(256, gt=0, help="round the default hidden width up to a multiple of this")


class SwiGLUFeedForward(FFN):
    """``swiglu``: SiLU-gated linear unit feed-forward (Shazeer 2020), as in Llama."""

    Options = SwiGLUOptions
    api = ">=1.4,<2"  # peft_roles; tensor_parallel_plan (1.3)

    def build(self, shape: ModelShape, layer: int) -> SwiGLU:
        return SwiGLU(shape, self.options.hidden or llama_hidden(shape.d_model, self.options.multiple_of))
