"""qlora: the base's linear layers are stored as packed 4-bit NF4 (with double-quantised scales), the
adapted model starts as that quantised base, and merging folds the adapters into the dequantised
weights exactly."""

import pytest
import torch
from torch import nn

from lmlab.api import UserError
from lmlab.testing.peft import adapted, check_peft, perturb, probe
from lmlab_peft.qlora import QLoRA

bnb = pytest.importorskip("bitsandbytes")


def test_qlora_meets_the_peft_contract():
    # It does not start as the full-precision base on purpose: the base is quantised (checked below).
    check_peft(QLoRA, {"r": 4, "blocksize": 32}, skip=("starts_as_the_base",))


def test_qlora_base_weights_are_stored_in_4_bits():
    _, base, model = adapted(QLoRA, {"blocksize": 32}, "gqa", "swiglu")
    plain = [n for n, m in model.named_modules() if type(m) is nn.Linear and n.startswith("blocks.")]
    assert plain and all(".lora_" in n for n in plain)  # only the adapters' own layers are full precision
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 2 * (4 + 3)  # every projection of attention and ffn, both blocks
    weights = stored = 0
    for layer in layers:
        w, state = layer.weight, layer.weight.quant_state
        assert w.dtype == torch.uint8 and not w.requires_grad
        assert w.numel() * 2 == layer.in_features * layer.out_features  # two 4-bit codes per byte
        assert state.quant_type == "nf4" and state.nested and state.blocksize == 32
        weights += layer.in_features * layer.out_features
        stored += w.numel() * w.element_size() + state.absmax.numel() * state.absmax.element_size()
    assert stored / weights < 0.54  # bytes per weight: 0.5 for the codes + 8-bit scales; fp32 would be 4
    # 4-bit layers count as the weights they stand for, not as their packed bytes
    assert model.num_params() == base.num_params() + model.num_params(trainable_only=True)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if p.requires_grad)


def nf4_reference(weight: torch.Tensor, blocksize: int) -> torch.Tensor:
    """NF4 by its definition: each block of ``blocksize`` consecutive weights scaled by its absmax and
    rounded to the nearest of the 16 NormalFloat levels (Dettmers et al. 2023, appendix E)."""
    levels = bnb.functional.get_4bit_type("nf4", device="cpu")                           # (16,)
    blocks = weight.reshape(-1, blocksize)
    absmax = blocks.abs().amax(1, keepdim=True)
    nearest = ((blocks / absmax)[..., None] - levels).abs().argmin(-1)
    return (levels[nearest] * absmax).reshape(weight.shape)


def test_qlora_starts_as_the_nf4_quantised_base():
    _, base, model = adapted(QLoRA, {"targets": ["q", "v"], "double_quant": False, "blocksize": 32})
    reference = base
    with torch.no_grad():
        for name, module in list(reference.named_modules()):
            if type(module) is nn.Linear and name.startswith("blocks."):
                restored = nf4_reference(module.weight, 32)
                quantised = model.get_submodule(name)
                quantised = getattr(quantised, "base_layer", quantised)
                ours = bnb.functional.dequantize_4bit(quantised.weight.data, quantised.weight.quant_state)
                assert torch.equal(ours, restored)  # bitsandbytes' storage and kernel give exactly NF4
                # 16 levels over each block's absmax (the widest gap, between NF4's top two levels, is
                # 0.28 of it): an error that is small on average and never zero
                error = (restored - module.weight).abs()
                assert 0 < error.max() <= 0.15 * module.weight.abs().max()
                assert error.mean() <= 0.12 * module.weight.abs().mean()
                module.weight.copy_(restored)
        x = probe()
        assert (model(x) - reference(x)).abs().max().item() <= 1e-5


def test_qlora_refuses_a_blocksize_that_does_not_divide_the_rows_on_the_cpu():
    with pytest.raises(UserError, match="not a multiple of the blocksize 64") as error:
        adapted(QLoRA, {"blocksize": 64})  # the kit's d_model is 32
    assert error.value.key == "peft.blocksize"


def test_qlora_merges_into_full_precision_weights_equal_to_the_4_bit_model():
    plugin, base, model = adapted(QLoRA, {"r": 4, "blocksize": 32}, "gqa", "swiglu")
    perturb(plugin, model)
    x = probe()
    with torch.no_grad():
        unmerged = model(x)
        plugin.merge(model)
        merged = model(x)
    assert not [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert set(model.state_dict()) == set(base.state_dict())
    assert (merged - unmerged).abs().max().item() <= 1e-5
