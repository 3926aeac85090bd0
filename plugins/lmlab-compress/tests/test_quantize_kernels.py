"""The quantisers' numerics: bit packing, grouped rounding, AWQ's search, int8 and NF4 layers."""

import pytest
import torch
from torch import nn

from lmlab.api import Calibration
from lmlab_compress.awq import AWQ, output_error
from lmlab_compress.grouped import GroupQuantLinear, RoundToNearest, dequantize_groups, quantize_groups
from lmlab_compress.int8 import Int8Linear, float_matmul, int8_matmul, int_mm_runs, quantize_rows
from lmlab_compress.nf4 import NF4_LEVELS, NF4Linear, bnb_functional, dequantize_reference
from lmlab_compress.packing import pack, packed_length, unpack, unpack_float


def relative_error(actual, expected):
    return float((actual - expected).detach().norm() / expected.detach().norm())


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 24, 37])
def test_packing_round_trip_is_exact_and_takes_bits_per_value(bits, n):
    values = torch.randint(0, 1 << bits, (3, 5, n), generator=torch.Generator().manual_seed(bits * 100 + n))
    packed = pack(values, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, packed_length(n, bits))
    assert torch.equal(unpack(packed, bits, n), values.to(torch.uint8))
    assert torch.equal(unpack_float(packed, bits, n), values.float())
    assert packed_length(8 * n, bits) == n * bits  # whole chunks: exactly `bits` bits per value


def test_packing_layout_low_bits_first():
    assert pack(torch.tensor([[1, 2]]), 4).tolist() == [[0x21]]
    # 3 bits: eight values in a 24-bit little-endian word
    word = sum(v << (3 * i) for i, v in enumerate(range(8)))
    assert pack(torch.arange(8)[None], 3).tolist() == [[word & 255, (word >> 8) & 255, word >> 16]]
    with pytest.raises(ValueError):
        pack(torch.tensor([[16]]), 4)


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("asymmetric", [True, False])
def test_round_to_nearest_moves_each_weight_by_at_most_half_a_step(bits, asymmetric):
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    weight[3, :32] += 0.5  # a group that is all positive: its range still takes in 0
    codes, scales, zeros = quantize_groups(weight, bits, 32, asymmetric)
    assert codes.dtype == zeros.dtype == torch.uint8 and scales.dtype == torch.float16
    assert int(codes.max()) < 1 << bits and scales.shape == zeros.shape == (48, 4)
    error = (dequantize_groups(codes, scales, zeros) - weight).abs().reshape(48, 4, 32)
    half_step = scales.float().unsqueeze(-1) / 2
    assert bool((error <= half_step * (1 + 1e-5) + 1e-8).all())
    # and the steps are as fine as the range allows: the widest group's extremes use the end codes
    assert int(codes.max()) == (1 << bits) - 1


def test_group_quant_linear_computes_with_its_dequantised_weight():
    linear = nn.Linear(64, 24)
    scale = torch.rand(64) + 0.5
    module = GroupQuantLinear.from_linear(linear, 4, 16, input_scale=scale)
    x = torch.randn(2, 5, 64)
    expected = nn.functional.linear(x * scale, module.dequantize(), linear.bias)
    torch.testing.assert_close(module(x), expected)
    assert module(x.bfloat16()).dtype == torch.bfloat16
    assert module.qweight.shape == (24, 32) and relative_error(module.dequantize(), linear.weight) < 0.15


KERNEL = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                            reason="this torch has no int4 CPU kernel")


@KERNEL
def test_a_decode_step_takes_the_int4_kernel_on_the_same_codes_and_a_loaded_layer_rebuilds_it():
    torch.manual_seed(0)
    linear = nn.Linear(128, 512)
    module = GroupQuantLinear.from_linear(linear, 4, 32, input_scale=torch.rand(128) + 0.5)
    assert module.kernel_weight is not None
    assert set(module.state_dict()) == {"qweight", "scales", "zeros", "bias", "input_scale"}  # portable
    with torch.no_grad():
        for rows in (1, 8):  # the kernel's rows: bfloat16 activations, the same weights
            x = torch.randn(rows, 128)
            dequantised = nn.functional.linear(x * module.input_scale, module.dequantize(), linear.bias)
            got = module(x)
            quantisation = (dequantised - linear(x)).abs().max()
            assert 0 < (got - dequantised).abs().max() < 0.15 * quantisation
        x = torch.randn(9, 128)  # more rows: the dequantised weight, exactly
        torch.testing.assert_close(module(x), nn.functional.linear(x * module.input_scale, module.dequantize(),
                                                                   linear.bias), rtol=0, atol=0)
        loaded = nn.Sequential(GroupQuantLinear(128, 512, 4, 32, bias=True, input_scaled=True))
        assert loaded[0].kernel_weight is None
        loaded.load_state_dict({f"0.{k}": v for k, v in module.state_dict().items()})
        x = torch.randn(1, 1, 128)
        assert torch.equal(loaded(x), module(x))


@pytest.mark.parametrize("bits, group", [(3, 32), (4, 16)])
def test_the_int4_kernel_is_left_out_where_it_does_not_apply(bits, group):
    module = GroupQuantLinear.from_linear(nn.Linear(64, 32), bits, group)
    assert module.kernel_weight is None
    x = torch.randn(1, 64)
    with torch.no_grad():
        torch.testing.assert_close(module(x), nn.functional.linear(x, module.dequantize(), module.bias),
                                   rtol=0, atol=0)


class Outliers(nn.Module):
    """Tokens → embeddings with a few channels 30× larger than the rest (as LLM activations have) → a
    linear layer: the setting AWQ is made for."""

    def __init__(self, vocab=64, width=128, out=96):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        with torch.no_grad():
            self.emb.weight[:, :4] *= 30
        self.proj = nn.Linear(width, out, bias=False)

    def forward(self, idx):
        return self.proj(self.emb(idx))


def test_awq_beats_round_to_nearest_where_a_few_input_channels_are_large():
    torch.manual_seed(0)
    toy = Outliers()
    calibration = Calibration(torch.randint(0, 64, (16, 33)), batch_size=4)
    held_out = toy.emb(torch.randint(0, 64, (512,))).detach()
    reference = toy.proj(held_out)
    errors = {}
    for method in (RoundToNearest(), AWQ(AWQ.Options(search="output"))):  # the paper's criterion
        model = Outliers()
        model.load_state_dict(toy.state_dict())
        record = method.compress(model, calibration)
        errors[method.method_name] = relative_error(model.proj(held_out), reference)
    assert record["scales"]["proj"]["alpha"] > 0  # it did scale the salient channels up
    assert errors["awq"] < 0.8 * errors["rtn"], errors  # measured: 0.71×


def test_awq_error_measure_is_the_output_error_on_the_inputs():
    x = torch.randn(300, 16)
    delta = torch.randn(5, 16)
    torch.testing.assert_close(output_error(delta, x.t() @ x), (x @ delta.t()).pow(2).sum(), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("width", [256, 1024])
def test_int8_products_are_exact_by_int_mm_and_by_the_float_fallback(tokens, width):
    g = torch.Generator().manual_seed(tokens)
    xq = torch.randint(-127, 128, (tokens, width), generator=g, dtype=torch.int8)
    wq = torch.randint(-127, 128, (96, width), generator=g, dtype=torch.int8)
    exact = (xq.long() @ wq.long().t()).float()
    assert int_mm_runs(xq, wq)  # on the CPU, always torch._int_mm
    assert torch.equal(int8_matmul(xq, wq), exact)
    assert torch.equal(float_matmul(xq, wq), exact)  # K ≤ 1040: float32 sums of int8 products are exact


def test_int8_linear_is_close_to_float():
    torch.manual_seed(0)
    linear = nn.Linear(256, 128)
    module = Int8Linear.from_linear(linear)
    assert module.weight.dtype == torch.int8 and module.weight_scale.dtype == torch.float32
    x = torch.randn(4, 9, 256)
    assert relative_error(module(x), linear(x)) < 0.01  # 8 bits on both sides: ~0.5% each
    codes, scale = quantize_rows(x)
    assert -128 <= int(codes.min()) and int(codes.max()) <= 127 and int(codes.abs().max()) >= 127
    assert scale.shape == (4, 9, 1)
    expected = nn.functional.linear(codes.float() * scale, module.dequantize(), linear.bias)
    torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-5)


def test_int8_linear_computes_what_torchaos_int8_dynamic_activation_int8_weight_computes():
    """The peer library on identical weights: torchao's W8A8 config (per-row int8 weights, per-token
    symmetric int8 activations). The same codes and scales, the same integer products: what is left
    is the order of the float multiplications by the two scales."""
    torchao_quant = pytest.importorskip("torchao.quantization")
    torch.manual_seed(0)
    linear = nn.Linear(512, 256, bias=False)
    ours = Int8Linear.from_linear(linear)
    theirs = nn.Sequential(nn.Linear(512, 256, bias=False))
    theirs[0].weight.data.copy_(linear.weight.data)
    torchao_quant.quantize_(theirs, torchao_quant.Int8DynamicActivationInt8WeightConfig())
    x = torch.randn(2, 33, 512)
    with torch.no_grad():
        mine, peer, exact = ours(x), theirs(x), linear(x)
    assert torch.equal(ours.weight, theirs[0].weight.qdata)
    torch.testing.assert_close(ours.weight_scale, theirs[0].weight.scale.flatten(), rtol=1e-6, atol=0)
    quantisation = (peer - exact).abs().max()
    assert (mine - peer).abs().max() < 1e-3 * quantisation, ((mine - peer).abs().max(), quantisation)


def test_nf4_layer_matches_a_pure_torch_dequantisation_and_float():
    torch.manual_seed(0)
    linear = nn.Linear(128, 96)
    module = NF4Linear.from_linear(linear, 64)
    code = bnb_functional().get_4bit_type("nf4", device="cpu")
    torch.testing.assert_close(code, torch.tensor(NF4_LEVELS), rtol=0, atol=1e-6)
    reference = dequantize_reference(module.qweight, module.absmax, (96, 128), 64)
    torch.testing.assert_close(module.dequantize(), reference, rtol=1e-6, atol=1e-7)
    x = torch.randn(3, 128)
    torch.testing.assert_close(module(x), nn.functional.linear(x, reference, linear.bias), rtol=1e-5, atol=1e-5)
    # absmax of each block of 64 weights, row-major over the matrix
    torch.testing.assert_close(module.absmax, linear.weight.detach().reshape(-1, 64).abs().amax(-1))
    assert relative_error(module(x) - linear.bias, linear(x) - linear.bias) < 0.12
