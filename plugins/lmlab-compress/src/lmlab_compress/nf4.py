"""``nf4``: 4-bit NormalFloat weights (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized
LLMs"), by bitsandbytes.

Trained weights are close to normally distributed, so NF4's 16 levels are the quantiles of a normal
distribution (rescaled to [−1, 1], with an exact 0): each level is used about equally often, which
is what makes a 4-bit code information-theoretically optimal for such data. Each block of
``blocksize`` consecutive weights (row-major over the whole matrix) is divided by its absolute
maximum, then rounded to the nearest level; the weight is read back as level · absmax.

The layer stores what bitsandbytes' ``QuantState`` needs as plain buffers: the packed codes (two per
byte, the first in the high nibble, as bitsandbytes packs them) and the float32 absmax per block;
the code table, block size and shape are rebuilt from the options. 4 + 32/blocksize bits per weight
(4.5 at the default 64). The forward dequantises with bitsandbytes' CPU kernel and calls F.linear.
"""

import logging
from functools import cache
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.api import Field, Options
from lmlab_compress.linears import LinearQuantizer, skip_field

#: The NF4 levels as QLoRA's appendix lists them (bitsandbytes' ``get_4bit_type("nf4")``): the reference
#: of the pure-torch dequantisation the tests check bitsandbytes against.
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230390262604, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)


@cache
def bnb_functional():
    """bitsandbytes.functional, imported on first use (a second to import). Its CPU backend logs a
    warning at import when the optional ``kernels`` package (which fetches a fused kernel from the
    Hugging Face Hub at run time) is missing; the built-in CPU kernels used here do not need it."""
    quiet = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import bitsandbytes.functional as functional
    finally:
        quiet.setLevel(level)
    return functional


def dequantize_reference(packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int], blocksize: int):
    """Pure-torch NF4 dequantisation: level[code] · absmax of the code's block (float32)."""
    flat = packed.reshape(-1)
    codes = torch.stack((flat >> 4, flat & 0x0F), -1).reshape(-1).long()
    n = shape[0] * shape[1]
    values = torch.tensor(NF4_LEVELS, device=packed.device)[codes[:n]]
    blocks = torch.arange(n, device=packed.device) // blocksize
    return (values * absmax.float()[blocks]).reshape(shape)


class NF4Linear(nn.Module):
    """A linear layer with NF4 weights: ``qweight`` (out · in / 2,) uint8, ``absmax`` (blocks,) float32."""

    def __init__(self, in_features: int, out_features: int, blocksize: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.blocksize = in_features, out_features, blocksize
        n = in_features * out_features
        self.register_buffer("qweight", torch.zeros((n + 1) // 2, dtype=torch.uint8))
        self.register_buffer("absmax", torch.ones(-(-n // blocksize)))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, blocksize: int) -> "NF4Linear":
        module = cls(linear.in_features, linear.out_features, blocksize, linear.bias is not None)
        packed, state = bnb_functional().quantize_4bit(linear.weight.detach().float().contiguous(),
                                                        blocksize=blocksize, quant_type="nf4")
        module.qweight.copy_(packed.reshape(-1))
        module.absmax.copy_(state.absmax)
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach().float())
        return module.to(linear.weight.device)

    def quant_state(self, dtype: torch.dtype = torch.float32):
        functional = bnb_functional()
        return functional.QuantState(absmax=self.absmax, shape=torch.Size((self.out_features, self.in_features)),
                                     code=functional.get_4bit_type("nf4", device=self.absmax.device),
                                     blocksize=self.blocksize, quant_type="nf4", dtype=dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer computes with (out, in), by bitsandbytes; never cached."""
        return bnb_functional().dequantize_4bit(self.qweight.view(-1, 1), self.quant_state(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, blocksize={self.blocksize}, "
                f"bias={self.bias is not None}")


class NF4Options(Options):
    blocksize: Literal[32, 64, 128, 256, 512, 1024, 2048, 4096] = Field(
        64, help="weights per absmax (row-major over the whole matrix): QLoRA uses 64")
    skip: list[str] = skip_field()


class NF4(LinearQuantizer):
    """``nf4``: QLoRA's 4-bit NormalFloat weights, blockwise absmax, through bitsandbytes."""

    Options = NF4Options
    method_name = "nf4"

    def quantize(self, name: str, linear: nn.Linear, state) -> nn.Module:
        return NF4Linear.from_linear(linear, self.options.blocksize)

    def empty(self, linear: nn.Linear, record: dict) -> nn.Module:
        return NF4Linear(linear.in_features, linear.out_features, record["blocksize"],
                         linear.bias is not None).to(linear.weight.device)

    def record_extra(self, state: dict) -> dict:
        return {"blocksize": self.options.blocksize}
