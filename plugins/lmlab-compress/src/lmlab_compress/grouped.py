"""Grouped low-bit weight quantisation and ``rtn``, plain round-to-nearest: the baseline of Frantar et
al. 2022 ("GPTQ") and Lin et al. 2023 ("AWQ"), and the quantiser AWQ itself uses.

Each output row of a weight is cut into groups of ``group_size`` consecutive input weights; a group
gets its own scale ``s`` and integer zero point ``z`` (asymmetric: the range [min, max] of the group,
widened to take in 0 so that z is a code, mapped onto the codes 0 … 2^bits − 1) or only a scale
(symmetric: ±max|w| onto −(2^(bits−1) − 1) … 2^(bits−1) − 1, z fixed at 2^(bits−1)). A weight is
stored as ``q = clamp(round(w / s) + z)`` and read back as ``(q − z) · s``, so rounding moves it by at
most s / 2. Scales are float16, rounded up so the group's range still fits the codes; zero points
one byte each; the codes are bit-packed (:mod:`lmlab_compress.packing`): at 4 bits and groups of
32, a weight costs 4 + 24/32 = 4.75 bits instead of 32.

The forward dequantises the whole weight to the input's dtype and calls ``F.linear``; nothing is
cached, so that path is slower than float32, most of all for a decode step's one row. So at 4 bits,
with groups of 32 to 256, a call of at most ``KERNEL_ROWS`` rows on the CPU goes to torch's own int4
kernel (``_weight_int4pack_mm_for_cpu``) on bfloat16 activations instead. At one token of a
1024 → 4096 layer that takes 0.42 of float32's time where dequantising takes 6.4×; on a 128-wide
layer the call's casts around the kernel leave it at 3× float32's, a third of dequantising's
(``bench/quant_linear.py``; figures in the plugin's README). The kernel is slow on float32 inputs and
from a few dozen rows, hence bfloat16 and the row bound. Rounding activations and scales to bfloat16
adds an error about 20× below the 4-bit weights' own. Its packed layout depends on the CPU's vector
width, so it is built from the codes when the layer is made or loaded and kept out of the state dict,
which stays portable; it costs about as many bytes again as the codes.
"""

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.api import Field, Options, UserError
from lmlab_compress.linears import LinearQuantizer, skip_field
from lmlab_compress.packing import pack, packed_length, unpack, unpack_float

#: calls of at most this many rows (a decode step's tokens) use torch's int4 kernel where it runs
KERNEL_ROWS = 8
#: the group sizes that kernel takes
KERNEL_GROUPS = (32, 64, 128, 256)
# Looked up once: resolving an op through torch.ops costs microseconds, as much as a small layer's matmul.
_INT4_MM = getattr(getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None), "default", None)
_INT4_PACK = getattr(getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None), "default", None)


def _round_up_fp16(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` as float16, never below the float32 value (a smaller scale would push the group's
    extreme weights past the last code)."""
    half = scale.clamp(2.0 ** -24, 65504.0).half()
    low = half.float() < scale
    return torch.where(low, torch.nextafter(half, torch.full_like(half, torch.inf)), half)


def quantize_groups(weight: torch.Tensor, bits: int, group_size: int, asymmetric: bool = True,
                    clip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest grouped quantisation of ``weight`` (out, in).

    ``clip`` (out, in / group_size), AWQ's clipping: each group's weights are first clamped to
    ± ratio · max|w| of the group. Returns codes (out, in) uint8, scales (out, groups) float16 and
    zero points (out, groups) uint8, with ``weight ≈ (codes − zero) · scale`` group-wise.
    """
    out_features, in_features = weight.shape
    w = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    if clip is not None:
        bound = w.abs().amax(-1, keepdim=True) * clip.unsqueeze(-1)
        w = torch.minimum(torch.maximum(w, -bound), bound)
    top = (1 << bits) - 1
    if asymmetric:
        # The range always takes in 0 (as GPTQ's quantiser): the zero point is then a code in [0, top].
        low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = _round_up_fp16((high - low) / top)
        zero = (-low / scale.float()).round().clamp(0, top)
    else:
        half_range = (1 << (bits - 1)) - 1
        scale = _round_up_fp16(w.abs().amax(-1) / half_range)
        zero = torch.full_like(w[..., 0], 1 << (bits - 1))
    codes = (w / scale.float().unsqueeze(-1)).round_().add_(zero.unsqueeze(-1)).clamp_(0, top)
    return codes.reshape(out_features, in_features).to(torch.uint8), scale, zero.to(torch.uint8)


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(codes − zero) · scale group-wise, float32 (out, in); float32 ``codes`` are used in place."""
    out_features, groups = scale.shape
    w = codes.reshape(out_features, groups, -1).float()
    return w.sub_(zero.float().unsqueeze(-1)).mul_(scale.float().unsqueeze(-1)).reshape(out_features, -1)


def fake_quantize(weight: torch.Tensor, bits: int, group_size: int, asymmetric: bool = True,
                  clip: torch.Tensor | None = None) -> torch.Tensor:
    """``weight`` quantised and read back (float32): what the quantised layer will compute with."""
    return dequantize_groups(*quantize_groups(weight, bits, group_size, asymmetric, clip))


class GroupQuantLinear(nn.Module):
    """A linear layer with grouped low-bit weights: ``qweight`` (out, packed bytes) uint8, ``scales``
    (out, in / group_size) float16, ``zeros`` (same shape) uint8, ``bias`` as the float layer had it.

    With ``input_scaled`` (AWQ), a float32 ``input_scale`` (in,) multiplies the input first: the
    layer holds W · diag(s) quantised and computes Q(W · diag(s)) · (x / s).
    """

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, bias: bool = False,
                 input_scaled: bool = False):
        super().__init__()
        if in_features % group_size:
            raise ValueError(f"group_size {group_size} does not divide in_features {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        groups = in_features // group_size
        self.register_buffer("qweight", torch.zeros(out_features, packed_length(in_features, bits), dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=torch.float16))
        self.register_buffer("zeros", torch.zeros(out_features, groups, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.register_buffer("input_scale", torch.ones(in_features) if input_scaled else None)
        # torch's int4 kernel's copy of the weight, rebuilt from the codes (pack_kernel), never saved
        self.register_buffer("kernel_weight", None, persistent=False)
        self.register_buffer("kernel_scales", None, persistent=False)
        self.register_load_state_dict_post_hook(lambda module, _keys: module.pack_kernel())

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int, asymmetric: bool = True,
                    clip: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
                    weight: torch.Tensor | None = None) -> "GroupQuantLinear":
        """Quantise ``linear`` (or ``weight`` in its place: AWQ's W · diag(s))."""
        module = cls(linear.in_features, linear.out_features, bits, group_size, linear.bias is not None,
                     input_scaled=input_scale is not None)
        codes, scales, zeros = quantize_groups(linear.weight if weight is None else weight, bits, group_size,
                                               asymmetric, clip)
        module.qweight.copy_(pack(codes, bits))
        module.scales.copy_(scales)
        module.zeros.copy_(zeros)
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach().float())
        if input_scale is not None:
            module.input_scale.copy_(input_scale)
        module = module.to(linear.weight.device)
        module.pack_kernel()
        return module

    def pack_kernel(self) -> None:
        """Build (or drop) the int4 kernel's copy of the weight from the codes: on the CPU, at 4 bits and
        a group size the kernel takes, where this torch has it."""
        self.kernel_weight = self.kernel_scales = None
        if self.bits != 4 or self.group_size not in KERNEL_GROUPS or self.qweight.device.type != "cpu" \
                or _INT4_MM is None or _INT4_PACK is None:
            return
        try:
            weight = _INT4_PACK(self.codes().to(torch.int32), 1)
            # The kernel reads w = (q − 8) · scale + zero per (group, output); ours is (q − z) · s,
            # which is that with zero = (8 − z) · s.
            s, z = self.scales.float(), self.zeros.float()
            scales = torch.stack((s, (8 - z) * s), -1).transpose(0, 1).contiguous().to(torch.bfloat16)
            _INT4_MM(torch.zeros(1, self.in_features, dtype=torch.bfloat16), weight, self.group_size, scales)
        except (RuntimeError, NotImplementedError):  # a shape or CPU the kernel refuses: dequantise instead
            return
        self.kernel_weight, self.kernel_scales = weight, scales

    def codes(self) -> torch.Tensor:
        return unpack(self.qweight, self.bits, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer computes with, (out, in); built anew on each call (never cached)."""
        codes = unpack_float(self.qweight, self.bits, self.in_features)
        return dequantize_groups(codes, self.scales, self.zeros).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = x * self.input_scale.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        rows = x.numel() // self.in_features
        # (a model cast with .float() or moved off the CPU since packing takes the dequantising path)
        if self.kernel_weight is not None and rows <= KERNEL_ROWS and x.device.type == "cpu" \
                and self.kernel_scales.dtype == torch.bfloat16:
            y = _INT4_MM(x.reshape(rows, self.in_features).to(torch.bfloat16), self.kernel_weight, self.group_size,
                         self.kernel_scales)
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
            return y if bias is None else y + bias
        return F.linear(x, self.dequantize(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}, "
                f"input_scaled={self.input_scale is not None}")


class GroupOptions(Options):
    bits: Literal[3, 4] = Field(4, help="bits per weight: 4 (16 levels) or 3 (8)")
    group_size: int = Field(32, gt=0, help="input weights per scale and zero point; must divide each layer's "
                                           "in_features (smaller: more accurate, more bytes)")
    asymmetric: bool = Field(True, help="a zero point per group (its range [min, max]); false: symmetric ±max")
    skip: list[str] = skip_field()


class GroupQuantizer(LinearQuantizer):
    """What ``rtn`` and ``awq`` share: the options check and the module they leave."""

    Options = GroupOptions
    input_scaled = False

    def check_layer(self, name: str, linear: nn.Linear) -> None:
        g = self.options.group_size
        if linear.in_features % g:
            raise UserError(f"{g} does not divide the {linear.in_features} inputs of {name} (groups cut each "
                            "row of the weight evenly; pick a divisor, or skip the layer)",
                            key=f"{self.key_prefix}.group_size")

    def empty(self, linear: nn.Linear, record: dict) -> nn.Module:
        return GroupQuantLinear(linear.in_features, linear.out_features, record["bits"], record["group_size"],
                                linear.bias is not None, input_scaled=self.input_scaled).to(linear.weight.device)

    def record_extra(self, state: dict) -> dict:
        o = self.options
        return {"bits": o.bits, "group_size": o.group_size, "asymmetric": o.asymmetric}


class RoundToNearest(GroupQuantizer):
    """``rtn``: each weight rounded to the nearest code of its group, no data needed."""

    method_name = "rtn"

    def quantize(self, name: str, linear: nn.Linear, state) -> nn.Module:
        o = self.options
        return GroupQuantLinear.from_linear(linear, o.bits, o.group_size, o.asymmetric)
