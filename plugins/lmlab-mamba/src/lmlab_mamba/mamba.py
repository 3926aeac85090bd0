"""Mamba's selective state-space mixer: ``mamba``.

Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces". In place of
attention each block runs a gated, input-dependent linear recurrence over the sequence::

    x, z = in_proj(u)                        two branches of width d_inner = expand · d_model
    x    = silu(causal depthwise conv1d(x))  short local mixing (kernel d_conv)
    Δ, B, C = x_proj(x)                      Δ through a low-rank dt_proj and softplus: (B, T, d_inner)
    h_t  = exp(Δ_t A) h_{t-1} + Δ_t B_t x_t  A = -exp(A_log) (d_inner, d_state), fixed per channel
    y_t  = C_t · h_t + D x_t
    out  = out_proj(y ⊙ silu(z))

Because Δ, B and C depend on the token, the model chooses what to keep and what to forget (the
"selection mechanism"); A is initialised S4D-real (A_n = -n) and Δ's bias so that softplus(bias) is
log-uniform in [dt_min, dt_max]. Token order comes from the recurrence itself, so the mixer needs no
position scheme (use position ``none``); it refuses schemes that rotate queries or bias attention
scores, which it has no place for.

Parameter names and layouts are those of Hugging Face transformers' ``MambaMixer`` (and of the
reference ``mamba_ssm.Mamba``), so checkpoints convert one to one. The scan is the chunked parallel
scan of ``lmlab_mamba.scan`` in plain PyTorch; in float32 training the whole mixer between its
projections is one autograd Function (``lmlab_mamba.inner``), and the op-by-op forward below serves
everything else. With ``use_cuda_kernels`` and ``mamba_ssm`` installed, CUDA inputs go through its
fused kernels instead. Decoding keeps a :class:`MambaState`: the last d_conv inputs of the
convolution and the (d_inner, d_state) recurrent state, whatever the length.
"""

import math
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from pydantic import PositiveInt
from torch import nn

from lmlab.api import Attention, AttentionModule, Field, MixerContext, ModelShape, Options, UserError
from lmlab_mamba.conv import CausalConvSiLU
from lmlab_mamba.inner import MambaInner
from lmlab_mamba.scan import selective_scan, selective_step


class MambaState:
    """Inference state of one mixer: conv_state (B, d_inner, d_conv), ssm_state (B, d_inner, d_state).

    conv_state holds the last d_conv inputs of the convolution (oldest first), as in Hugging Face's
    cache; ssm_state stays float32 whatever the model's dtype, since it accumulates over the whole text.
    """

    def __init__(self, batch_size: int, d_inner: int, d_conv: int, d_state: int, device=None, dtype=None):
        self.conv_state = torch.zeros(batch_size, d_inner, d_conv, device=device, dtype=dtype)
        self.ssm_state = torch.zeros(batch_size, d_inner, d_state, device=device, dtype=torch.float32)

    def reorder(self, index: torch.Tensor) -> None:
        self.conv_state = self.conv_state.index_select(0, index)
        self.ssm_state = self.ssm_state.index_select(0, index)


class MambaMixer(AttentionModule):
    """The Mamba block's mixer (everything between the block's norm and its residual add)."""

    def __init__(self, shape: ModelShape, *, d_inner: int, d_state: int, d_conv: int, dt_rank: int,
                 conv_bias: bool, dt_min: float, dt_max: float, chunk_size: int | None, cuda_kernels: bool):
        super().__init__()
        self.d_inner, self.d_state, self.d_conv, self.dt_rank = d_inner, d_state, d_conv, dt_rank
        self.dt_min, self.dt_max, self.chunk_size = dt_min, dt_max, chunk_size
        self.in_proj = nn.Linear(shape.d_model, 2 * d_inner, bias=shape.bias)    # rows: x, then gate z
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1, bias=conv_bias)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)        # rows: Δ (low rank), B, C
        self.dt_proj = nn.Linear(dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(d_inner, d_state))
        self.D = nn.Parameter(torch.empty(d_inner))
        self.out_proj = nn.Linear(d_inner, shape.d_model, bias=shape.bias)
        # Mamba trains A_log and D without weight decay; the mark is the reference implementation's.
        self.A_log._no_weight_decay = True
        self.D._no_weight_decay = True
        self.kernels = _load_cuda_kernels() if cuda_kernels else None
        self.reset_parameters(shape)

    def reset_parameters(self, shape: ModelShape) -> None:
        nn.init.normal_(self.in_proj.weight, 0.0, shape.init_std)
        nn.init.normal_(self.out_proj.weight, 0.0, shape.residual_init_std)  # writes into the residual
        for linear in (self.in_proj, self.out_proj):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        # The mixer's inner layers keep PyTorch's default (Kaiming-uniform) init, as mamba_ssm does.
        self.conv1d.reset_parameters()
        self.x_proj.reset_parameters()
        with torch.no_grad():
            # Δ's projection: uniform ±dt_rank^-0.5; its bias the inverse softplus of a log-uniform
            # Δ in [dt_min, dt_max], so every channel starts with its own time scale.
            bound = self.dt_rank ** -0.5
            self.dt_proj.weight.uniform_(-bound, bound)
            dt = torch.exp(torch.rand(self.d_inner) * (math.log(self.dt_max) - math.log(self.dt_min))
                           + math.log(self.dt_min)).clamp(min=1e-4)
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)
            # S4D-real: A_n = -n for n = 1..d_state, the same for every channel.
            self.A_log.copy_(torch.log(torch.arange(1, self.d_state + 1, dtype=torch.float32)).expand_as(self.A_log))
            self.D.fill_(1.0)

    def peft_roles(self) -> dict[str, str]:
        # dt_proj is left out: the forward pass reads its weight directly (an addmm), so a PEFT wrapper
        # around it would never be called.
        return {"in": "in_proj", "x": "x_proj", "o": "out_proj"}

    def new_state(self, batch_size: int, max_len: int, device, dtype) -> MambaState:
        return MambaState(batch_size, self.d_inner, self.d_conv, self.d_state, device=device, dtype=dtype)

    def forward(self, u: torch.Tensor, ctx: MixerContext, state: MambaState | None = None) -> torch.Tensor:
        if ctx.position.rotates or ctx.position.biases:
            raise UserError("mamba takes token order from its recurrence and has no queries to rotate or "
                            "scores to bias; use position none (or learned / sinusoidal)", key="position.use")
        if not getattr(ctx, "causal", True):  # MixerContext.causal is API 1.4
            raise UserError("mamba is a causal recurrence (each output sees only earlier inputs) and cannot "
                            "attend bidirectionally, as a non-causal objective (mlm) asks", key="attention.use")
        if state is None and self.kernels is not None and u.is_cuda:
            return self._forward_cuda(u)
        # Batch-major throughout, as the block hands it over: no transposes, and every op splits its
        # work between threads by batch rows (see lmlab_mamba.scan).
        xz = self.in_proj(u)                                                  # (B, T, 2 Di)
        if state is None and self._fusable(xz):
            training = torch.is_grad_enabled() and (xz.requires_grad or any(p.requires_grad for p in self.parameters()))
            return self.out_proj(MambaInner.apply(
                xz, self._conv_taps(), self.conv1d.bias, self.x_proj.weight, self.dt_proj.weight,
                self.dt_proj.bias, self.A_log, self.D, self.chunk_size, training))
        x, z = xz.chunk(2, dim=-1)                                            # (B, T, Di) each
        x = self._conv_silu(x, state)                                         # (B, T, Di)
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        # dt_proj as addmm with its weight transposed into a contiguous (dt_rank, Di) copy: with such a
        # narrow inner dimension the GEMMs of the backward pass run several times faster that way round.
        dt = torch.addmm(self.dt_proj.bias, dt.reshape(-1, self.dt_rank), self.dt_proj.weight.t().contiguous())
        dt = F.softplus(dt.view_as(x).float())                                # (B, T, Di) Δ > 0
        A = -torch.exp(self.A_log.float())                                    # (Di, N)
        xf, B, C = x.float(), B.float(), C.float()                            # the scan runs in float32
        if state is not None and u.shape[1] == 1:
            y, h = selective_step(xf[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], state.ssm_state)
            y = y[:, None]                                                    # (B, 1, Di)
        else:
            h0 = state.ssm_state if state is not None else None
            y, h = selective_scan(xf, dt, A, B, C, h0, self.chunk_size)       # (B, T, Di), (B, Di, N)
        if state is not None:
            state.ssm_state = h
        y = torch.addcmul(y, xf, self.D.float()).to(u.dtype) * F.silu(z)      # (B, T, Di)
        return self.out_proj(y)                                               # (B, T, C)

    def _fusable(self, xz: torch.Tensor) -> bool:
        """Whether the one-Function path of :mod:`lmlab_mamba.inner` applies: float32 throughout and no
        autocast (which would run x_proj in 16 bits), not while torch.compile traces (it compiles the
        op-by-op path), and x_proj and dt_proj plain Linear layers (a PEFT method's wrapper must be
        called, not read)."""
        return (xz.dtype == torch.float32 and self.A_log.dtype == torch.float32
                and self.conv1d.weight.dtype == torch.float32 and self.x_proj.weight.dtype == torch.float32
                and not torch.is_autocast_enabled(xz.device.type) and not torch.compiler.is_compiling()
                and type(self.x_proj) is nn.Linear and type(self.dt_proj) is nn.Linear)

    def _conv_taps(self) -> torch.Tensor:
        """The convolution's weight (Di, 1, K) as (K, Di) taps, a view: its gradient reaches the weight."""
        return self.conv1d.weight[:, 0].t()

    def _conv_silu(self, x: torch.Tensor, state: MambaState | None) -> torch.Tensor:
        """silu of the causal depthwise convolution over time, x (B, T, Di) → (B, T, Di):
        out_t = Σ_k w_k x_{t-K+1+k}, as K shifted multiply-adds (see :mod:`lmlab_mamba.conv`)."""
        w = self._conv_taps()
        if state is None:
            return CausalConvSiLU.apply(x, w, self.conv1d.bias)
        T, K = x.shape[1], self.d_conv
        # The cache holds the last K inputs; the first of them is one step more than the kernel reaches.
        window = torch.cat([state.conv_state.transpose(1, 2), x.to(state.conv_state.dtype)], 1)  # (B, K+T, Di)
        state.conv_state = window[:, -K:].transpose(1, 2)                     # (B, Di, K)
        window, bias = window[:, 1:].to(x.dtype), self.conv1d.bias
        y = window[:, K - 1:] * w[K - 1] if bias is None else torch.addcmul(bias, window[:, K - 1:], w[K - 1])
        for k in range(K - 1):  # the kernel's taps, not time steps
            y = torch.addcmul(y, window[:, k:k + T], w[k])
        return F.silu(y)

    def _forward_cuda(self, u: torch.Tensor) -> torch.Tensor:
        """mamba_ssm's fused conv and scan kernels (training and state-less forward on CUDA)."""
        causal_conv1d_fn, selective_scan_fn = self.kernels
        x, z = self.in_proj(u).transpose(1, 2).chunk(2, dim=1)               # (B, Di, T) each
        x = causal_conv1d_fn(x.contiguous(), self.conv1d.weight.squeeze(1), self.conv1d.bias, activation="silu")
        dt, B, C = self.x_proj(x.transpose(1, 2)).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = (dt @ self.dt_proj.weight.t()).transpose(1, 2)                   # (B, Di, T); bias added in the kernel
        y = selective_scan_fn(x, dt.contiguous(), -torch.exp(self.A_log.float()),
                              B.transpose(1, 2).contiguous(), C.transpose(1, 2).contiguous(), self.D.float(),
                              z=z.contiguous(), delta_bias=self.dt_proj.bias.float(), delta_softplus=True)
        return self.out_proj(y.transpose(1, 2))                               # (B, T, C)


def _load_cuda_kernels():
    """(causal_conv1d_fn, selective_scan_fn) from mamba_ssm, or None when it is not installed."""
    try:
        from causal_conv1d import causal_conv1d_fn
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except ImportError:
        return None
    return causal_conv1d_fn, selective_scan_fn


class MambaOptions(Options):
    d_state: int = Field(16, ge=1, help="state size N per channel")
    d_conv: int = Field(4, ge=1, help="kernel width of the causal depthwise convolution")
    expand: int = Field(2, ge=1, help="inner width d_inner as a multiple of model.d_model")
    dt_rank: PositiveInt | Literal["auto"] = Field("auto", help='rank of Δ\'s projection; "auto" = ceil(d_model / 16)')
    dt_min: float = Field(0.001, gt=0, help="smallest initial Δ (log-uniform in [dt_min, dt_max])")
    dt_max: float = Field(0.1, gt=0, help="largest initial Δ")
    conv_bias: bool = Field(True, help="bias in the convolution")
    chunk_size: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        "auto", help='time steps the parallel scan takes at once, 1 to 64; "auto" = sized to the CPU\'s caches '
                     "from the batch and state size (8 for the quickstart)")
    use_cuda_kernels: bool | Literal["auto"] = Field(
        "auto", help='use mamba_ssm\'s fused kernels for CUDA inputs: "auto" = when installed; true = '
                     "require them; false = always the plain PyTorch scan")


class Mamba(Attention):
    """``mamba``: the selective state-space mixer of Gu & Dao 2023."""

    Options = MambaOptions
    api = ">=1.6,<2"  # check; bidirectional, peft_roles (1.4); _no_weight_decay (1.1)
    # A left-to-right recurrence: a bidirectional objective (mlm) is refused when the model is built.
    # (Running two scans, one per direction, would be a different mixer: BiMamba, Vim.)
    bidirectional = False

    def check(self, context) -> None:
        """Before anything is built (API 1.6): a position scheme that rotates queries or biases scores
        has nothing to act on in a recurrence."""
        position = context.model.position if context.model is not None else None  # meta device: flags only
        if position is not None and (position.rotates or position.biases):
            raise UserError("mamba takes token order from its recurrence and has no queries to rotate or "
                            "scores to bias; use position none (or learned / sinusoidal)", key="position.use")

    def build(self, shape: ModelShape, layer: int) -> MambaMixer:
        o = self.options
        dt_rank = math.ceil(shape.d_model / 16) if o.dt_rank == "auto" else o.dt_rank
        if o.dt_min > o.dt_max:
            raise UserError(f"dt_min {o.dt_min} is larger than dt_max {o.dt_max}", key="attention.dt_min")
        if o.use_cuda_kernels is True and _load_cuda_kernels() is None:
            raise UserError("needs mamba_ssm and causal_conv1d (pip install mamba-ssm causal-conv1d); "
                            'set it to "auto" to fall back to the PyTorch scan', key="attention.use_cuda_kernels")
        return MambaMixer(shape, d_inner=o.expand * shape.d_model, d_state=o.d_state, d_conv=o.d_conv,
                          dt_rank=dt_rank, conv_bias=o.conv_bias, dt_min=o.dt_min, dt_max=o.dt_max,
                          chunk_size=None if o.chunk_size == "auto" else o.chunk_size,
                          cuda_kernels=o.use_cuda_kernels is not False)
