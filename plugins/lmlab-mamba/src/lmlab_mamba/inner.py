"""The mamba mixer between its two projections as one autograd Function: the float32 training path.

From in_proj's output xz to out_proj's input, the mixer is a dozen ops on (B, T, d_inner) tensors
around the scan (convolution, silu, x_proj, Δ's projection and softplus, the D skip, the gate). Recorded
one by one, autograd adds up x's three gradients (from x_proj, the scan and the D skip) in fresh
tensors, and the split of xz into x and z costs a concatenation of their gradients in the backward
pass. Written out, as ``mamba_ssm``'s ``mamba_inner_fn`` does on a GPU, the gradients accumulate in
place and land directly in the two halves of xz's gradient. Same arithmetic, same results: the tests
check it against the op-by-op path, which stays for decoding, 16-bit and autocast, torch.compile, and
x_proj wrapped by a PEFT method.
"""

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from lmlab_mamba.conv import causal_conv, causal_conv_backward
from lmlab_mamba.scan import scan_backward, scan_forward

SOFTPLUS_THRESHOLD = 20.0  # F.softplus's default, beyond which softplus(x) = x


class MambaInner(torch.autograd.Function):
    """silu(conv(x)) → x_proj → Δ, B, C → scan → (y + D x) ⊙ silu(z), for xz (B, T, 2·d_inner).

    Arguments: xz, conv weight (K, d_inner) and bias or None, x_proj's weight (R + 2N, d_inner),
    dt_proj's weight (d_inner, R) and bias, A_log (d_inner, N), D (d_inner), chunk length or None (auto),
    and whether a backward pass will follow (the caller knows: inside forward, grad mode is always off).
    """

    @staticmethod
    def forward(ctx, xz, conv_w, conv_b, x_proj_w, dt_w, dt_b, A_log, D, chunk_size, training):
        d_inner, rank, n = D.shape[0], dt_w.shape[1], A_log.shape[1]
        batch, steps = xz.shape[:2]
        x, z = xz[..., :d_inner], xz[..., d_inner:]
        pre = causal_conv(x, conv_w, conv_b)                                   # (B, T, Di)
        xc = F.silu(pre)
        dbc = torch.mm(xc.view(-1, d_inner), x_proj_w.t())                     # (B·T, R + 2N): Δ low rank, B, C
        dt_pre = torch.addmm(dt_b, dbc[:, :rank], dt_w.t()).view_as(xc)
        dt = F.softplus(dt_pre)
        A = -torch.exp(A_log)
        B, C = _input_and_output_matrices(dbc, rank, n, batch, steps)
        y, _, kept = scan_forward(xc, dt, A, B, C, None, chunk_size, training)
        y.addcmul_(xc, D)                                                      # + D x
        gate = F.silu(z)
        if training:
            ctx.save_for_backward(xz, pre, xc, dbc, dt_pre, dt, A, y, gate, conv_w, x_proj_w, dt_w, D)
            ctx.kept, ctx.has_conv_bias = kept, conv_b is not None
        return y * gate

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        xz, pre, xc, dbc, dt_pre, dt, A, y, gate, conv_w, x_proj_w, dt_w, D = ctx.saved_tensors
        d_inner, rank, n = D.shape[0], dt_w.shape[1], A.shape[1]
        batch, steps = xz.shape[:2]
        grad_xz = torch.empty_like(xz)
        # The gate: out = y ⊙ silu(z).
        torch.ops.aten.silu_backward.grad_input(grad * y, xz[..., d_inner:], grad_input=grad_xz[..., d_inner:])
        grad_y = grad * gate
        grad_D = (grad_y * xc).sum((0, 1))
        # The scan, then the D skip, which also reads x.
        B, C = _input_and_output_matrices(dbc, rank, n, batch, steps)
        grad_xc, grad_dt, grad_A, grad_B, grad_C, _ = scan_backward(xc, dt, A, B, C, ctx.kept, grad_y, None)
        grad_xc = grad_xc.contiguous()  # a view past the last chunk's padding unless L divides T
        grad_xc.addcmul_(grad_y, D)
        # Δ = softplus(dt_proj(Δ low rank)), and x_proj, whose input is x as well.
        grad_dt_pre = torch.ops.aten.softplus_backward(grad_dt, dt_pre, 1.0, SOFTPLUS_THRESHOLD).view(-1, d_inner)
        grad_dbc = torch.cat([grad_dt_pre @ dt_w, grad_B.reshape(-1, n), grad_C.reshape(-1, n)], 1)
        grad_dt_w = grad_dt_pre.t() @ dbc[:, :rank] if ctx.needs_input_grad[4] else None
        grad_dt_b = grad_dt_pre.sum(0) if ctx.needs_input_grad[5] else None
        grad_x_proj_w = grad_dbc.t() @ xc.view(-1, d_inner) if ctx.needs_input_grad[3] else None
        grad_xc.view(-1, d_inner).addmm_(grad_dbc, x_proj_w)
        # silu, then the convolution, whose input gradient lands in the x half of xz's.
        grad_pre = torch.ops.aten.silu_backward(grad_xc, pre)
        _, grad_conv_w, grad_conv_b = causal_conv_backward(grad_pre, xz[..., :d_inner], conv_w, ctx.has_conv_bias,
                                                           grad_x=grad_xz[..., :d_inner])
        return grad_xz, grad_conv_w, grad_conv_b, grad_x_proj_w, grad_dt_w, grad_dt_b, grad_A * A, grad_D, None, None


def _input_and_output_matrices(dbc: torch.Tensor, rank: int, n: int, batch: int, steps: int):
    """B and C (batch, steps, N) as views of x_proj's output (B·T, R + 2N), whose columns are Δ's low
    rank, then B, then C."""
    return dbc[:, rank:rank + n].view(batch, steps, n), dbc[:, rank + n:].view(batch, steps, n)
