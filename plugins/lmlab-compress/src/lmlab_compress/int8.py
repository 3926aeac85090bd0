"""``int8``: 8-bit weights and 8-bit activations (W8A8), as torchao's ``Int8DynamicActivationInt8Weight``
computes them (after Dettmers et al. 2022, "LLM.int8()", without its outlier decomposition, and
Xiao et al. 2023, "SmoothQuant", without its smoothing).

Weights: symmetric, one float32 scale per output channel, ``w ≈ q · s_w`` with q in [−128, 127] and
s_w = max |w| / 127.5 (torchao's symmetric int8 mapping, so both layers hold the same codes).
Activations: quantised on the fly the same way, one scale per token, so an outlier token
costs only its own precision. The product of int8 codes is summed exactly in int32 and scaled back:
y = (q_x q_wᵀ) · s_x · s_w.

On the CPU ``torch._int_mm`` computes the integer product: the kernel torchao's
``int_scaled_matmul`` calls on a CPU with AMX (it converts to uint8 first only on VNNI-without-AMX
CPUs), called directly so that loading a model does not import torchao (two seconds). On this
project's CPU it beat float32 ``F.linear`` on wide layers (3.8× at 8 tokens × 1024 → 4096, 4.5× at
512 tokens); on narrow ones (128 → 512) the per-token quantisation of x (a few elementwise passes)
costs about what the product saves (``bench/quant_linear.py``, the plugin README's table). Elsewhere (CUDA's ``_int_mm`` wants more than 16 rows and sizes in multiples of 8)
the same integer codes are multiplied as float32: exact for the int8 sums these sizes produce.
"""

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.api import Options
from lmlab_compress.linears import LinearQuantizer, skip_field


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of each row of ``x`` (…, K) and the row's float32 scale (…, 1): max |x| / 127.5
    onto [−128, 127], as torchao's ``choose_qparams_affine`` and ``quantize_affine`` compute them."""
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / 127.5).clamp_(min=torch.finfo(torch.float32).eps)
    return (x * (1.0 / scale)).round_().clamp_(-128, 127).to(torch.int8), scale


def int_mm_runs(xq: torch.Tensor, wq: torch.Tensor) -> bool:
    """Whether torch._int_mm takes these operands (CUDA's wants > 16 rows, sizes in multiples of 8)."""
    if xq.device.type == "cpu":
        return True
    m, k = xq.shape
    return xq.device.type == "cuda" and m > 16 and k % 8 == 0 and wq.shape[0] % 8 == 0


def float_matmul(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """The integer product computed in float32: exact while K · 128² ≤ 2²⁴ (K ≤ 1024), and beyond
    that rounded as float32 rounds, far below int8's own steps."""
    return F.linear(xq.float(), wq.float())


def int8_matmul(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """Σ_k xq[m, k] · wq[n, k] (M, N) as float32: summed in int32 by torch._int_mm where it runs."""
    if int_mm_runs(xq, wq):
        return torch._int_mm(xq, wq.t()).float()
    return float_matmul(xq, wq)


class Int8Linear(nn.Module):
    """A linear layer with int8 weights ``weight`` (out, in), float32 ``weight_scale`` (out,) and dynamic
    per-token int8 activations."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        module = cls(linear.in_features, linear.out_features, linear.bias is not None)
        codes, scale = quantize_rows(linear.weight.detach())
        module.weight.copy_(codes)
        module.weight_scale.copy_(scale.squeeze(-1))
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach().float())
        return module.to(linear.weight.device)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale.unsqueeze(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale = quantize_rows(x.reshape(-1, self.in_features))
        y = int8_matmul(xq, self.weight).mul_(x_scale).mul_(self.weight_scale)
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Options(Options):
    skip: list[str] = skip_field()


class Int8(LinearQuantizer):
    """``int8``: per-channel int8 weights, per-token dynamic int8 activations."""

    Options = Int8Options
    method_name = "int8"

    def quantize(self, name: str, linear: nn.Linear, state) -> nn.Module:
        return Int8Linear.from_linear(linear)

    def empty(self, linear: nn.Linear, record: dict) -> nn.Module:
        return Int8Linear(linear.in_features, linear.out_features, linear.bias is not None).to(linear.weight.device)
