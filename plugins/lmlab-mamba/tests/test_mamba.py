"""Properties of the ``mamba`` mixer on tiny fp32 shapes: decoding, causality, gradients, init, options."""

import math
from importlib.metadata import entry_points

import pytest
import torch
import torch.nn.functional as F

from lmlab.api import MixerContext, ModelShape, PositionModule, UserError
from lmlab_mamba.mamba import Mamba, MambaMixer, MambaState

SHAPE = ModelShape(n_layers=2, d_model=32, n_heads=4, block_size=16, vocab_size=11)


def build(shape: ModelShape = SHAPE, scramble: bool = True, **options) -> MambaMixer:
    torch.manual_seed(0)
    module = Mamba(Mamba.Options(**options)).build(shape, layer=0)
    if scramble:
        # Larger than the init so that every path (conv, gate, Δ, B, C, D) shows in the output.
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn_like(p) * 0.3)
    return module.eval()


def context(start: int, end: int, position: PositionModule | None = None) -> MixerContext:
    return MixerContext(position=position or PositionModule(), positions=torch.arange(start, end), start=start)


def test_mamba_is_registered_as_an_attention_plugin():
    (ep,) = entry_points(group="lmlab.attention", name="mamba")
    assert ep.load() is Mamba


@pytest.mark.parametrize("chunk_size", ["auto", 8, 3])
def test_decoding_with_prefill_single_steps_and_a_chunk_equals_the_full_forward(chunk_size):
    module = build(chunk_size=chunk_size)
    x = torch.randn(2, 13, SHAPE.d_model)
    with torch.no_grad():
        full = module(x, context(0, 13))
        state = module.new_state(2, max_len=13, device="cpu", dtype=torch.float32)
        pieces = [module(x[:, :5], context(0, 5), state)]                           # prefill
        pieces += [module(x[:, t:t + 1], context(t, t + 1), state) for t in range(5, 9)]  # recurrent steps
        pieces.append(module(x[:, 9:], context(9, 13), state))                      # a multi-token chunk
    assert full.abs().max() > 0.1  # a meaningful scale for the tolerance below
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)


def test_state_holds_the_conv_inputs_and_ssm_state_in_hugging_face_layout():
    module = build()
    state = module.new_state(3, max_len=100, device="cpu", dtype=torch.float32)
    assert isinstance(state, MambaState)
    d_inner = 2 * SHAPE.d_model
    assert state.conv_state.shape == (3, d_inner, 4) and state.ssm_state.shape == (3, d_inner, 16)
    x = torch.randn(3, 6, SHAPE.d_model)
    with torch.no_grad():
        module(x, context(0, 6), state)
        x_inner = module.in_proj(x)[..., :d_inner]                                   # (B, T, Di) pre-conv input
    # conv_state keeps the last d_conv inputs of the convolution, oldest first.
    torch.testing.assert_close(state.conv_state, x_inner[:, -4:].transpose(1, 2))


def test_reorder_keeps_the_chosen_rows_of_the_state():
    module = build()
    x = torch.randn(3, 10, SHAPE.d_model)
    index = torch.tensor([2, 0, 0])
    with torch.no_grad():
        expected = module(x[index], context(0, 10))[:, 6:]
        state = module.new_state(3, max_len=10, device="cpu", dtype=torch.float32)
        module(x[:, :6], context(0, 6), state)
        state.reorder(index)
        steps = [module(x[index][:, t:t + 1], context(t, t + 1), state) for t in range(6, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), expected, atol=1e-5, rtol=1e-5)


def test_outputs_do_not_depend_on_later_inputs():
    module = build()
    x = torch.randn(2, 16, SHAPE.d_model)
    changed = x.clone()
    changed[:, 7:] = torch.randn(2, 9, SHAPE.d_model)
    with torch.no_grad():
        y, y_changed = module(x, context(0, 16)), module(changed, context(0, 16))
    torch.testing.assert_close(y_changed[:, :7], y[:, :7], atol=1e-6, rtol=0)
    assert (y_changed[:, 7:] - y[:, 7:]).abs().max() > 1e-2


def test_every_parameter_receives_a_gradient():
    module = build().train()
    x = torch.randn(2, 16, SHAPE.d_model)
    module(x, context(0, 16)).square().mean().backward()
    for name, p in module.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name


def test_initialisation_follows_the_mamba_paper():
    shape = ModelShape(n_layers=4, d_model=64, n_heads=4, block_size=16, vocab_size=11)
    module = build(shape, scramble=False, d_state=8, dt_min=0.002, dt_max=0.05)
    d_inner = 2 * shape.d_model
    assert module.dt_rank == math.ceil(64 / 16)                      # "auto"
    # S4D-real: A_n = -n for n = 1..d_state, in every channel.
    torch.testing.assert_close(-torch.exp(module.A_log), -torch.arange(1.0, 9.0).expand(d_inner, 8))
    assert torch.all(module.D == 1.0)
    # softplus(dt bias) recovers Δ drawn log-uniformly from [dt_min, dt_max].
    dt = F.softplus(module.dt_proj.bias)
    assert dt.min() >= 0.002 * 0.999 and dt.max() <= 0.05 * 1.001
    assert dt.log().std() > 0.5  # spread over the log range, not constant
    # The output projection writes into the residual stream: GPT-2's scaled init.
    assert abs(module.out_proj.weight.std().item() - shape.residual_init_std) < 0.2 * shape.residual_init_std


def test_shapes_follow_the_options():
    module = build(scramble=False, d_state=4, d_conv=3, expand=3, dt_rank=5, conv_bias=False)
    shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
    assert shapes == {"A_log": (96, 4), "D": (96,), "in_proj.weight": (192, 32), "conv1d.weight": (96, 1, 3),
                      "x_proj.weight": (5 + 2 * 4, 96), "dt_proj.weight": (96, 5), "dt_proj.bias": (96,),
                      "out_proj.weight": (32, 96)}
    y = module(torch.randn(2, 7, 32), context(0, 7))
    assert y.shape == (2, 7, 32)


def test_bfloat16_runs_and_stays_close_to_float32():
    module = build()
    x = torch.randn(2, 16, SHAPE.d_model)
    with torch.no_grad():
        y32 = module(x, context(0, 16))
        y16 = module.to(torch.bfloat16)(x.to(torch.bfloat16), context(0, 16))
    assert y16.dtype == torch.bfloat16
    assert (y16.float() - y32).abs().max() < 0.05 * y32.abs().max()


class Rotating(PositionModule):
    rotates = True


class Biasing(PositionModule):
    biases = True


@pytest.mark.parametrize("position", [Rotating(), Biasing()])
def test_a_position_scheme_that_rotates_or_biases_is_refused_naming_the_key(position):
    with pytest.raises(UserError) as error:
        build()(torch.randn(1, 4, SHAPE.d_model), context(0, 4, position))
    assert error.value.key == "position.use"


def test_option_mistakes_are_reported_with_their_key():
    with pytest.raises(UserError) as error:
        Mamba(Mamba.Options(dt_min=0.5, dt_max=0.1)).build(SHAPE, 0)
    assert error.value.key == "attention.dt_min"
    for wrong in ({"d_stat": 16}, {"dt_rank": 0}, {"dt_rank": "full"}, {"chunk_size": 0},
                  {"chunk_size": 65}, {"chunk_size": "fast"}):
        with pytest.raises(ValueError):  # pydantic's error, which the manifest loader reports with the key
            Mamba.Options(**wrong)


def test_requiring_cuda_kernels_without_mamba_ssm_is_a_user_error():
    try:
        import mamba_ssm  # noqa: F401
        pytest.skip("mamba_ssm is installed")
    except ImportError:
        pass
    with pytest.raises(UserError) as error:
        Mamba(Mamba.Options(use_cuda_kernels=True)).build(SHAPE, 0)
    assert error.value.key == "attention.use_cuda_kernels"
    # "auto" (the default) falls back to the PyTorch scan silently.
    assert build(scramble=False).kernels is None


@pytest.mark.parametrize("steps, options", [(37, {}), (37, {"chunk_size": 8, "conv_bias": False}), (2, {}),
                                            (16, {"chunk_size": 4, "d_conv": 1})])
@pytest.mark.parametrize("bias", [False, True])
def test_the_fused_training_path_equals_the_op_by_op_one(monkeypatch, steps, options, bias):
    # lmlab_mamba.inner writes out the backward pass from in_proj's output to out_proj's input; the
    # op-by-op path, which autograd differentiates, is the reference. 37 steps leave a short last chunk,
    # 2 are fewer than the convolution's reach.
    shape = ModelShape(n_layers=2, d_model=32, n_heads=4, block_size=64, vocab_size=11, bias=bias)
    module = build(shape, **options).train()
    x = torch.randn(3, steps, SHAPE.d_model)
    weights = torch.randn(3, steps, SHAPE.d_model)

    def outputs_and_grads(fused: bool):
        monkeypatch.setattr(MambaMixer, "_fusable", lambda self, xz: fused)
        u = x.clone().requires_grad_()
        module.zero_grad()
        y = module(u, context(0, steps))
        (y * weights).sum().backward()
        return y, u.grad, {name: p.grad.clone() for name, p in module.named_parameters()}

    y, grad_u, grads = outputs_and_grads(True)
    y_ref, grad_u_ref, grads_ref = outputs_and_grads(False)
    assert y.abs().max() > 0.1
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    # Float32 rounding of sums taken in another order, relative to each gradient's scale.
    assert (grad_u - grad_u_ref).abs().max() <= 1e-5 * max(grad_u_ref.abs().max().item(), 1.0)
    assert grads.keys() == grads_ref.keys() and ("in_proj.bias" in grads) == bias
    for name, grad in grads.items():
        scale = max(grads_ref[name].abs().max().item(), 1.0)
        assert (grad - grads_ref[name]).abs().max() <= 1e-5 * scale, name


def test_the_fused_path_runs_in_float32_training_and_steps_aside_otherwise():
    module = build()
    xz = torch.randn(2, 5, 2 * module.d_inner)
    assert module._fusable(xz)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not module._fusable(xz)  # x_proj would run in bf16 on the op-by-op path
    assert not module._fusable(xz.bfloat16())

    class Wrapped(torch.nn.Linear):  # as a PEFT method's layer: it must be called, not read
        pass
    module.x_proj = Wrapped(module.d_inner, module.dt_rank + 2 * module.d_state, bias=False)
    assert not module._fusable(xz)
