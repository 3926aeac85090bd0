"""The transformer's position-wise feed-forward network: ``mlp``.

Two linear maps with a nonlinearity between them, applied to every position independently
(Vaswani et al. 2017, "Attention Is All You Need"). GPT-2 and nanoGPT widen to 4 x d_model and use
GELU (Hendrycks & Gimpel 2016, "Gaussian Error Linear Units"); GPT-2 itself used the tanh
approximation (``gelu-tanh``), the original transformer used ReLU (``relu``).
"""

from typing import Literal

import torch
from torch import nn

from lmlab.api import FFN, FFNModule, Field, ModelShape, Options

ACTIVATIONS = {
    "gelu": lambda: nn.GELU(),
    "gelu-tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": lambda: nn.ReLU(),
}


class MLP(FFNModule):
    """c_proj(act(c_fc(x))), with nanoGPT's parameter names so GPT-2 weights load as they are."""

    def __init__(self, shape: ModelShape, hidden: int, activation: str):
        super().__init__()
        self.c_fc = nn.Linear(shape.d_model, hidden, bias=shape.bias)
        self.act = ACTIVATIONS[activation]()
        self.c_proj = nn.Linear(hidden, shape.d_model, bias=shape.bias)
        # No dropout here: the model applies residual dropout to every block output.
        self.reset_parameters(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))  # (B, T, C) → (B, T, hidden) → (B, T, C)

    def tensor_parallel_plan(self, tp_size: int) -> dict:
        # Megatron-LM (Shoeybi et al. 2019): each rank holds a slice of the hidden units, so the
        # elementwise activation needs no communication; one all-reduce after c_proj.
        hidden = self.c_fc.out_features
        if hidden % tp_size:  # an uneven split would need the shard sizes passed along; refuse it instead
            raise ValueError(f"{tp_size} tensor-parallel ranks must split the {hidden} hidden units evenly")
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()}

    def peft_roles(self) -> dict[str, str]:
        return {"up": "c_fc", "down": "c_proj"}

    def reset_parameters(self, shape: ModelShape) -> None:
        nn.init.normal_(self.c_fc.weight, mean=0.0, std=shape.init_std)
        nn.init.normal_(self.c_proj.weight, mean=0.0, std=shape.residual_init_std)
        for linear in (self.c_fc, self.c_proj):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)


class MLPOptions(Options):
    hidden: int | None = Field(None, gt=0, help="hidden width; default (unset) = 4 x model.d_model")
    activation: Literal["gelu", "gelu-tanh", "relu"] = Field(
        "gelu", help="nonlinearity: exact GELU, GPT-2's tanh-approximated GELU, or ReLU")


class MLPFeedForward(FFN):
    """``mlp``: Linear → activation → Linear, as in GPT-2 / nanoGPT."""

    Options = MLPOptions
    api = ">=1.4,<2"  # peft_roles; tensor_parallel_plan (1.3)

    def build(self, shape: ModelShape, layer: int) -> MLP:
        return MLP(shape, self.options.hidden or 4 * shape.d_model, self.options.activation)
