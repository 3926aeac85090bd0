"""Parity with Hugging Face transformers' Mamba, weights copied one to one by parameter name.

Hugging Face runs its slow pure-PyTorch path here: ``mamba_ssm`` and ``causal_conv1d`` are not
installed (on a CPU they could not run anyway), ``use_mambapy=False`` and ``use_associative_scan=False``
leave the plain loop over time steps, and in eval mode the fused ``mamba_inner_fn`` is never tried.

What is compared:

* the mixer alone (``MambaMixer``: in_proj … out_proj): outputs, and the gradient of every parameter,
  which also checks this plugin's hand-written backward pass against autograd through HF's loop;
* the whole language model, HF's ``MambaForCausalLM`` against the core's ``LanguageModel``. An HF
  Mamba block is ``x + mixer(RMSNorm(x))`` with no feed-forward; the core's block always adds
  ``ffn(norm2(x))`` too, and cannot leave it out. The kit's reference feed-forward with its output
  projection set to zero adds exactly 0, so with ``norm = "rmsnorm"``, position ``none`` and tied
  embeddings the two models compute the same function: logits, and the decoding state after a prefill.
  (Tests may not import the core's model module, so the model comes from ``lmlab.testing`` and gets
  the mamba mixers put in its blocks.)
"""

import pytest
import torch

from lmlab.api import MixerContext, ModelShape, Position, PositionModule
from lmlab_mamba.mamba import Mamba

transformers = pytest.importorskip("transformers")
from transformers import MambaConfig, MambaForCausalLM  # noqa: E402
from transformers.models.mamba.modeling_mamba import MambaMixer as HFMambaMixer  # noqa: E402

testing = pytest.importorskip("lmlab.testing")

D_MODEL, D_STATE, DT_RANK, N_LAYERS, VOCAB = 32, 8, 3, 2, 37


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never look for kernels on the Hub


def hf_config() -> MambaConfig:
    return MambaConfig(hidden_size=D_MODEL, state_size=D_STATE, expand=2, conv_kernel=4, time_step_rank=DT_RANK,
                       use_conv_bias=True, use_bias=False, num_hidden_layers=N_LAYERS, vocab_size=VOCAB,
                       layer_norm_epsilon=1e-5, tie_word_embeddings=True, use_mambapy=False,
                       use_associative_scan=False)


def lmlab_mixer(shape: ModelShape, layer: int = 0):
    return Mamba(Mamba.Options(d_state=D_STATE, d_conv=4, expand=2, dt_rank=DT_RANK)).build(shape, layer)


def scramble(module: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Weights away from their init (A_log no longer the same in every channel, D not 1, ...), so that
    every path shows in the output, which stays of order 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)


SHAPE = ModelShape(n_layers=N_LAYERS, d_model=D_MODEL, n_heads=4, block_size=64, vocab_size=VOCAB)


def test_mixer_parameters_have_hugging_faces_names_and_shapes():
    ours = lmlab_mixer(SHAPE)
    theirs = HFMambaMixer(hf_config(), layer_idx=0)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}


def test_mixer_matches_hugging_face_outputs_and_gradients():
    ours = lmlab_mixer(SHAPE)
    scramble(ours, seed=0)
    theirs = HFMambaMixer(hf_config(), layer_idx=0)
    theirs.load_state_dict(ours.state_dict())  # strict: every name matches
    ours.eval(), theirs.eval()
    x = torch.randn(2, 19, D_MODEL)
    y_ours = ours(x, MixerContext(position=PositionModule(), positions=torch.arange(19)))
    y_theirs = theirs(x)
    assert 0.1 < y_theirs.abs().max() < 10
    assert (y_ours - y_theirs).abs().max() <= 1e-5
    weights = torch.randn_like(y_ours)
    (y_ours * weights).sum().backward()
    (y_theirs * weights).sum().backward()
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        reference = theirs_params[name].grad
        assert (p.grad - reference).abs().max() <= 1e-5 * max(reference.abs().max().item(), 1.0), name


class NoPosition(Position):
    """Position ``none``, as the lmlab-position plugin of that name: the base module's no-op hooks."""

    def build(self, shape: ModelShape) -> PositionModule:
        return PositionModule()


def lmlab_model_from(hf: MambaForCausalLM):
    """The core's LanguageModel holding hf's weights, each block's feed-forward adding zero."""
    model = testing.reference_model(SHAPE, NoPosition(), norm="rmsnorm").eval()
    backbone = hf.backbone
    with torch.no_grad():
        model.tok_emb.weight.copy_(backbone.embeddings.weight)
        model.norm_f.weight.copy_(backbone.norm_f.weight)
        for i, block in enumerate(model.blocks):
            block.attn = lmlab_mixer(SHAPE, i)
            block.attn.load_state_dict(backbone.layers[i].mixer.state_dict())
            block.norm1.weight.copy_(backbone.layers[i].norm.weight)
            torch.nn.init.zeros_(block.ffn.down.weight)  # HF's blocks have no feed-forward
    assert model.head.weight is model.tok_emb.weight  # tied, as HF's lm_head
    return model


def hf_model() -> MambaForCausalLM:
    torch.manual_seed(0)
    hf = MambaForCausalLM(hf_config())
    scramble(hf, seed=1)
    return hf.eval()


def test_language_model_matches_hugging_face_mamba_for_causal_lm():
    hf = hf_model()
    model = lmlab_model_from(hf)
    ids = torch.randint(0, VOCAB, (2, 21))
    with torch.no_grad():
        theirs = hf(ids).logits
        ours = model(ids)
    assert 0.1 < theirs.abs().max() < 10
    assert (ours - theirs).abs().max() <= 1e-5


def test_decoding_state_after_a_prefill_equals_hugging_faces_cache():
    hf = hf_model()
    model = lmlab_model_from(hf)
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        out = hf(ids, use_cache=True)
        cache = model.new_cache(2, 16)
        logits = model(ids, cache)
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=1e-5)
    for i, state in enumerate(cache.states):
        torch.testing.assert_close(state.conv_state, out.cache.get_conv_state(i), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state.ssm_state, out.cache.get_recurrent_state(i), atol=1e-5, rtol=1e-5)
