"""Bottleneck adapters: ``adapter`` (Houlsby et al. 2019, "Parameter-Efficient Transfer Learning for NLP").

A small residual network is inserted after the attention and after the feed-forward part of every
block, on their outputs before they join the residual stream:

    h ← h + W_up · dropout(f(W_down · h + b_down)) + b_up        W_down: size × d_model, W_up: d_model × size

with ``size`` ≪ d_model. Only the adapters train (2·size·d_model + size + d_model numbers each). The
up-projection starts at zero, so every adapter starts as the identity and the adapted model as the base
model ("near-identity initialisation" in the paper). Because the adapter sees the module's output and
not its weights, it works after any attention or ffn plugin (Mamba and MoE included), with no roles
needed. The nonlinearity makes it impossible to fold into the base weights, so it does not merge:
`lmlab generate` runs the unmerged model. (Houlsby et al. also train the layer norms; this plugin
trains the adapters alone.)

peft has no bottleneck adapter; this one is plain PyTorch: each adapter is a submodule of its block
(``blocks.<i>.attn_adapter``, ``blocks.<i>.ffn_adapter``, so no base parameter changes its name) and
is called by a forward hook on the block's ``attn`` or ``ffn`` module.
"""

import re
from typing import Literal

import torch
from torch import nn

from lmlab.api import Field, Options, Peft, RunSettings

ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU}
KEY = re.compile(r"^blocks\.\d+\.(attn|ffn)_adapter\.")


class Bottleneck(nn.Module):
    """h + up(dropout(act(down(h)))), the identity at initialisation."""

    def __init__(self, d_model: int, size: int, activation: str, dropout: float):
        super().__init__()
        self.down = nn.Linear(d_model, size)
        self.act = ACTIVATIONS[activation]()
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.up = nn.Linear(size, d_model)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, T, C) → (B, T, C)
        return h + self.up(self.dropout(self.act(self.down(h))))


class _AfterHook:
    """Forward hook: the wrapped module's output goes through the adapter."""

    def __init__(self, adapter: Bottleneck):
        self.adapter = adapter

    def __call__(self, module, args, output):
        return self.adapter(output)


class BottleneckAdapterOptions(Options):
    size: int | None = Field(None, gt=0, help="bottleneck width; default (unset) = d_model / 16, at least 1")
    activation: Literal["gelu", "relu", "silu"] = Field("gelu", help="the nonlinearity between the projections")
    dropout: float = Field(0.1, ge=0, lt=1, help="dropout on the bottleneck activation")
    after: list[Literal["attention", "ffn"]] = Field(
        ["attention", "ffn"], min_length=1, help="insert an adapter after these parts of every block")


class BottleneckAdapter(Peft):
    """``adapter``: Houlsby et al.'s residual bottleneck after attention and ffn, up-projection zero."""

    Options = BottleneckAdapterOptions
    api = ">=1.20,<2"  # apply receives RunSettings; Peft (1.4)
    parallel = ("single", "ddp")

    def apply(self, model: nn.Module, run: RunSettings) -> None:
        o = self.options
        model.requires_grad_(False)
        d_model = model.shape.d_model
        size = o.size or max(1, d_model // 16)
        for block in model.blocks:
            parts = [("attn", "attention")] + ([("ffn", "ffn")] if getattr(block, "has_ffn", True) else [])
            for attr, part in parts:
                if part not in o.after:
                    continue
                adapter = Bottleneck(d_model, size, o.activation, o.dropout).to(next(model.parameters()).device)
                block.add_module(f"{attr}_adapter", adapter)
                getattr(block, attr).register_forward_hook(_AfterHook(adapter))

    def is_adapter_key(self, key: str) -> bool:
        return KEY.match(key) is not None
