"""adam8bit: the steps of bitsandbytes' 8-bit AdamW against torch's AdamW (equal up to the 8-bit
quantisation of the moments), its state against AdamW's on a model the size of the quickstart's, and
bitsandbytes imported only when the optimizer is built."""

import os
import subprocess
import sys

import pytest
import torch

from lmlab.api import ModelShape, ParamInfo, UserError
from lmlab.testing.reference import ReferencePosition, reference_model
from lmlab_optimizers import adam8bit
from lmlab_optimizers.adam8bit import Adam8bit

pytest.importorskip("bitsandbytes")

#: experiments/shakespeare-char.toml's model (the kit's reference attention and ffn in place of mha and mlp)
QUICKSTART = ModelShape(n_layers=4, d_model=128, n_heads=4, block_size=64, vocab_size=65)
LR, STEPS = 1e-3, 5


def model(shape=QUICKSTART):
    torch.manual_seed(0)
    return reference_model(shape, ReferencePosition())


def set_grads(m, step):
    g = torch.Generator().manual_seed(step)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def state_bytes(optimizer):
    """What the run's summary counts as optimizer memory: every tensor of optimizer.state."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


@pytest.fixture(scope="module")
def runs():
    """The quickstart-sized model stepped STEPS times by adam8bit and by torch's AdamW on the same gradients."""
    ours, theirs = model(), model()
    start = {n: p.detach().clone() for n, p in ours.named_parameters()}
    opt = Adam8bit(Adam8bit.Options(lr=LR, min_8bit_size=4096)).build(ours.param_infos())
    ref = torch.optim.AdamW([{"params": [i.param for i in theirs.param_infos() if i.decay], "weight_decay": 0.1},
                             {"params": [i.param for i in theirs.param_infos() if not i.decay], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    ratio = None
    for k in range(STEPS):
        set_grads(ours, k)
        set_grads(theirs, k)
        opt.step()
        ref.step()
        if k == 0:
            ratio = state_bytes(opt) / state_bytes(ref)
    return ours, theirs, start, opt, ratio


def test_the_matrices_are_quantised_and_the_vectors_are_not(runs):
    ours, _, _, opt, _ = runs
    for name, p in ours.named_parameters():
        expected = torch.uint8 if p.numel() >= 4096 else torch.float32
        assert opt.state[p]["state1"].dtype == opt.state[p]["state2"].dtype == expected, name


def test_steps_equal_adamw_up_to_the_8_bit_quantisation(runs):
    ours, theirs, start, opt, _ = runs
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        ours_moved, adamw_moved = a.detach() - start[name], b.detach() - start[name]
        error = ours_moved - adamw_moved
        if a.numel() < 4096:  # 32-bit moments: AdamW's steps, up to float32 rounding of weights near 1
            assert error.abs().max() <= 1e-6, name
            continue
        # Measured with bitsandbytes 0.50.2 on the CPU: about 1 % of the update's norm, at most 0.17·lr·STEPS
        # for one weight; a step without bias correction, say, would be off by half of it.
        assert 0 < error.norm() <= 0.03 * adamw_moved.norm(), name
        assert error.abs().max() <= 0.3 * LR * STEPS, name


def test_the_state_takes_at_most_30_percent_of_adamws(runs):
    ratio = runs[4]
    print(f"adam8bit state / AdamW state on the quickstart-sized model: {ratio:.3f}")
    assert 0.2 < ratio <= 0.30


def test_min_8bit_size_keeps_larger_tensors_in_32_bits():
    m = model(ModelShape(n_layers=1, d_model=64, n_heads=2, block_size=8, vocab_size=11))
    opt = Adam8bit(Adam8bit.Options(min_8bit_size=10**6)).build(m.param_infos())
    set_grads(m, 0)
    opt.step()
    assert {s["state1"].dtype for s in opt.state.values()} == {torch.float32}


def test_listing_constructing_and_checking_never_import_bitsandbytes():
    code = ("import sys; from lmlab_optimizers.adam8bit import Adam8bit; Adam8bit(Adam8bit.Options(lr=1e-4))"
            ".check(None); assert 'bitsandbytes' not in sys.modules, 'imported'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_without_bitsandbytes_check_and_build_are_user_errors(monkeypatch):
    monkeypatch.setattr(adam8bit.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="bitsandbytes") as info:
        Adam8bit().check(None)
    assert info.value.key == "optimizer.use"
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    with pytest.raises(UserError, match="bitsandbytes"):
        Adam8bit().build([ParamInfo("w", torch.nn.Parameter(torch.zeros(2, 2)), decay=True)])
