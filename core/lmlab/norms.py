"""Normalisation layers the core offers through ``[model] norm``."""

import torch
from torch import nn

from lmlab.api import ModelShape, UserError


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), as in Llama: x / rms(x) * weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 (as Hugging Face Llama does) so bf16 runs keep precision.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def build_norm(kind: str, shape: ModelShape, eps: float = 1e-5) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(shape.d_model, eps=eps, bias=shape.bias)
    if kind == "rmsnorm":
        return RMSNorm(shape.d_model, eps=eps)
    raise UserError(f"unknown norm {kind!r} (layernorm, rmsnorm)", key="model.norm")
