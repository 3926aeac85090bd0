"""An lmlab model configured as Llama (RMSNorm, RoPE, GQA, SwiGLU, untied head) and loaded with a tiny
Hugging Face LlamaForCausalLM's weights gives the same logits and the same loss."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmlab import pretrained  # noqa: E402
from lmlab_architectures import hf_llama as llama  # noqa: E402
from support import random_llama  # noqa: E402


def tiny_llama(**overrides):
    settings = dict(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                    num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                    tie_word_embeddings=False)
    return random_llama(**{**settings, **overrides})


ROPE_500K = {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}


@pytest.mark.parametrize("overrides", [{}, ROPE_500K, {"num_key_value_heads": 6}, {"num_key_value_heads": 1}],
                         ids=["gqa", "rope-theta-500k", "mha", "mqa"])
def test_llama_logits_and_loss_match_hugging_face(overrides):
    hf = tiny_llama(**overrides)
    ours = llama.from_hf(hf, pretrained.build).eval()
    idx = torch.randint(0, 61, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(idx, labels=idx)
        logits = ours(idx)
    assert (logits - theirs.logits).abs().max().item() <= 1e-5
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 61), idx[:, 1:].reshape(-1))
    assert abs(loss.item() - theirs.loss.item()) <= 1e-5


def test_llama_manifest_tables_name_the_plugins():
    tables = llama.manifest_tables(tiny_llama().config)
    assert tables["attention"] == {"use": "gqa", "n_kv_heads": 2}
    assert tables["ffn"] == {"use": "swiglu", "hidden": 80}
    assert tables["position"]["use"] == "rope" and tables["model"]["norm"] == "rmsnorm"
    assert tables["model"]["tie_embeddings"] is False


def test_unsupported_llama_features_are_refused():
    config = tiny_llama().config
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act"):
        llama.manifest_tables(config)
