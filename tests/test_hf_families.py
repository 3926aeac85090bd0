"""Each Hugging Face family the architecture plugins read gives transformers' logits: a tiny randomly
initialised model of that family, written by ``save_pretrained``, read back by lmlab from the folder
(``Architecture.hf_tables`` / ``hf_state``, what ``[init] from`` uses), computes the same logits to
1e-5 in float32."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmlab import pretrained  # noqa: E402
from lmlab_architectures.decoder import Decoder  # noqa: E402
from lmlab_architectures.parallel_block import ParallelDecoder  # noqa: E402

VOCAB = 67
LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**LLAMA_LIKE),
    "llama3-rope": lambda: transformers.LlamaConfig(**LLAMA_LIKE, rope_parameters=LLAMA3_ROPE),
    "llama-linear-rope": lambda: transformers.LlamaConfig(
        **LLAMA_LIKE, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "smollm-tied": lambda: transformers.LlamaConfig(**{**LLAMA_LIKE, "tie_word_embeddings": True}),
    "mistral": lambda: transformers.MistralConfig(**LLAMA_LIKE, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**LLAMA_LIKE),
    "qwen3": lambda: transformers.Qwen3Config(**LLAMA_LIKE, head_dim=16),  # 6 heads of 16 ≠ 48 / 6
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=48, n_layer=2, n_head=6),
    # Pythia's layout: parallel residual, a quarter of each head rotated, untied head.
    "gpt-neox": lambda: transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2,
                                                   num_attention_heads=6, intermediate_size=96,
                                                   max_position_embeddings=64, rotary_pct=0.25),
    "gpt-neox-full-rotary": lambda: transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2,
                                                               num_attention_heads=6, intermediate_size=96,
                                                               max_position_embeddings=64, rotary_pct=1.0,
                                                               hidden_act="gelu_new"),
}
#: The architecture plugin that reads each family's folders.
READERS = {"gpt-neox": ParallelDecoder, "gpt-neox-full-rotary": ParallelDecoder}


def random_model(config):
    """A seeded random model of ``config``'s family, its norms and biases drawn away from their
    initial ones and zero (where a mistake in applying them would not show)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_saved_checkpoint_of_each_family_reads_back_with_transformers_logits(family, tmp_path):
    hf = random_model(FAMILIES[family]())
    hf.save_pretrained(tmp_path)
    reader = READERS.get(family, Decoder)
    tables = reader.hf_tables(tmp_path)
    model = pretrained.build(tables)
    state = reader.hf_state(tmp_path)
    if tables["model"]["tie_embeddings"]:
        state.pop("head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"head.weight"}
    idx = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(idx).logits
        ours = model.eval()(idx)
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_each_familys_switches_are_plugin_options():
    from lmlab_architectures import hf_gpt2, hf_llama

    assert hf_llama.manifest_tables(FAMILIES["qwen2"]())["attention"] == {"use": "gqa", "n_kv_heads": 2,
                                                                           "qkv_bias": True}
    qwen3 = hf_llama.manifest_tables(FAMILIES["qwen3"]())
    assert qwen3["attention"]["qk_norm"] is True and qwen3["model"]["head_dim"] == 16
    assert hf_llama.manifest_tables(FAMILIES["llama3-rope"]())["position"] == {
        "use": "rope", "base": 500000.0, "scaling": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_positions": 16}
    gpt2 = hf_gpt2.manifest_tables(FAMILIES["gpt2"]())
    assert gpt2["ffn"] == {"use": "mlp", "hidden": 192, "activation": "gelu-tanh"} and gpt2["model"]["bias"] is True


@pytest.mark.parametrize("config, key", [
    (lambda: transformers.MistralConfig(**{**LLAMA_LIKE, "sliding_window": 8}), "sliding_window"),
    (lambda: transformers.LlamaConfig(**LLAMA_LIKE, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                                      "factor": 2.0}), "rope_scaling"),
    (lambda: transformers.LlamaConfig(**{**LLAMA_LIKE, "hidden_act": "gelu"}), "hidden_act"),
    (lambda: transformers.GPT2Config(n_embd=48, n_head=6, scale_attn_by_inverse_layer_idx=True),
     "scale_attn_by_inverse_layer_idx"),
    (lambda: transformers.GPTNeoXConfig(hidden_size=48, num_attention_heads=6, use_parallel_residual=False),
     "use_parallel_residual"),
])
def test_a_config_lmlab_cannot_express_is_refused_naming_its_key(config, key, tmp_path):
    config().save_pretrained(tmp_path)
    reader = ParallelDecoder if config().model_type == "gpt_neox" else Decoder
    with pytest.raises(ValueError, match=key):
        reader.hf_tables(tmp_path)


EXPORTED = ["llama", "llama3-rope", "llama-linear-rope", "smollm-tied", "qwen2", "qwen3", "gpt2", "gpt-neox"]


@pytest.mark.parametrize("family", EXPORTED)
def test_an_lmlab_model_of_each_family_exports_to_a_checkpoint_transformers_computes_alike(family, tmp_path):
    """hf_export is hf_tables/hf_state's inverse: the exported config and weights, loaded by transformers'
    own class, give the lmlab model's logits (the same as the original's: read in, written out)."""
    from lmlab_architectures import hf_gpt2, hf_llama, hf_neox

    hf = random_model(FAMILIES[family]())
    reader = {"gpt2": hf_gpt2, "gpt-neox": hf_neox}.get(family, hf_llama)
    tables = {**reader.manifest_tables(hf.config)}
    ours = pretrained.build(tables).eval()
    state = reader.state_dict_from_hf(hf.state_dict(), *((2, 6) if family == "gpt-neox" else (2,)))
    if tables["model"]["tie_embeddings"]:
        state.pop("head.weight", None)
    ours.load_state_dict(state, strict=False)
    tables["architecture"] = {**tables["architecture"], "layers": "", "exit_layers": []}
    config, state = READERS.get(family, Decoder).hf_export(tables, ours.state_dict())
    from safetensors.torch import save_file

    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    idx = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (again(idx).logits - ours(idx)).abs().max().item() <= 1e-5
    assert type(again).__name__ == config["architectures"][0]


@pytest.mark.parametrize("change, key", [({"attention": {"use": "mamba"}}, "attention.use"),
                                         ({"position": {"use": "alibi"}}, "position.use"),
                                         ({"architecture": {"use": "decoder", "layers": "MA"}}, "architecture.layers")])
def test_a_model_no_family_can_hold_is_refused_naming_the_key(change, key):
    from lmlab_architectures import hf_llama

    tables = {**hf_llama.manifest_tables(FAMILIES["llama"]()), "architecture": {"use": "decoder"}, **change}
    with pytest.raises(ValueError, match=key):
        Decoder.hf_export(tables, {})
