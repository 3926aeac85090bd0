"""Mamba's causal depthwise convolution over time, out_t = Σ_k w_k x_{t-K+1+k} (+ bias), batch-major.

On a CPU ``nn.Conv1d`` with groups = channels is slow, its backward pass most of all; K shifted
multiply-adds over (B, T, D) rows are several times faster. The steps before the first see zeros: a
shifted product simply leaves out the first steps, so nothing is padded or copied, and x may be any
strided view (the x half of in_proj's output). The backward pass is the same shifted adds run the other
way and one product per tap for the weight, written out: recorded by autograd, each in-place add on a
shifted slice would cost a copy of the gradient.
"""

import torch
from torch.autograd.function import once_differentiable


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (B, T, D), weight (K, D), bias (D) or None → a new contiguous (B, T, D)."""
    K, T = weight.shape[0], x.shape[1]
    out = x * weight[K - 1] if bias is None else torch.addcmul(bias, x, weight[K - 1])
    for k in range(max(0, K - T), K - 1):  # tap k reaches K-1-k steps back (none past the start)
        shift = K - 1 - k
        out[:, shift:].addcmul_(x[:, :T - shift], weight[k])
    return out


def causal_conv_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool,
                         grad_x: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The gradients (x, weight, bias) of :func:`causal_conv` from that of its output; ``grad_x`` is
    where x's goes (any strided (B, T, D) view, e.g. the x half of in_proj's gradient), else a new tensor."""
    K, T = weight.shape[0], x.shape[1]
    grad_x = torch.mul(grad, weight[K - 1], out=grad_x) if grad_x is not None else grad * weight[K - 1]
    grad_w = torch.zeros_like(weight)
    torch.sum(grad * x, (0, 1), out=grad_w[K - 1])
    for k in range(max(0, K - T), K - 1):
        shift = K - 1 - k
        grad_x[:, :T - shift].addcmul_(grad[:, shift:], weight[k])
        torch.sum(grad[:, shift:] * x[:, :T - shift], (0, 1), out=grad_w[k])  # Σ_t g_t x_{t-K+1+k}
    return grad_x, grad_w, grad.sum((0, 1)) if has_bias else None


class CausalConvSiLU(torch.autograd.Function):
    """silu(:func:`causal_conv`), with its backward pass written out."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        pre = causal_conv(x, weight, bias)
        ctx.save_for_backward(x, weight, pre)
        ctx.has_bias = bias is not None
        return torch.nn.functional.silu(pre)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight, pre = ctx.saved_tensors
        return causal_conv_backward(torch.ops.aten.silu_backward(grad, pre), x, weight, ctx.has_bias)
