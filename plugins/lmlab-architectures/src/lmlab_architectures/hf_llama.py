"""Hugging Face Llama → lmlab: the checkpoints the ``decoder`` architecture reads (model_type "llama").

A Llama is a decoder-only lmlab model with RMSNorm, `rope` positions, `gqa` attention, a `swiglu` ffn
and an untied head. The names below are manifest values and the parameter names those first-party
plugins document (attention `q_proj`/`k_proj`/`v_proj`/`out_proj`, ffn `gate_proj`/`up_proj`/`down_proj`);
nothing here imports a plugin: the model is assembled from the tables like any manifest's.

    from transformers import LlamaForCausalLM
    from lmlab import pretrained
    hf = LlamaForCausalLM.from_pretrained(...)
    model = from_hf(hf, pretrained.build)    # an lmlab model with the same weights
    tables = manifest_tables(hf.config)      # the [model]/[architecture]/[position]/[attention]/[ffn] tables

A checkpoint folder on disk (``save_pretrained``: config.json and safetensors) is read without
transformers: ``folder_tables(folder)`` and ``read_state(folder)``, which is how ``[init] from`` starts
a run from one (``Decoder.hf_tables`` / ``hf_state``).
"""

from pathlib import Path
from types import SimpleNamespace

import torch

from lmlab_architectures import hf_files
from lmlab_architectures.hf_files import SAFETENSORS, SAFETENSORS_INDEX, weight_files  # noqa: F401 (the folder's files)

MODEL_TYPE = "llama"


def manifest_tables(config) -> dict:
    """The manifest tables of a Llama config (raises ValueError for features lmlab lacks)."""
    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default",
                                                          "rope_theta": getattr(config, "rope_theta", 10000.0)}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling {rope.get('rope_type')!r} is not supported")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        raise ValueError("head_dim × num_attention_heads must equal hidden_size")
    if getattr(config, "mlp_bias", False) != getattr(config, "attention_bias", False):
        raise ValueError("lmlab's `bias` covers attention and ffn together; this config mixes them")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not SwiGLU's silu")
    return {
        "model": {"n_layers": config.num_hidden_layers, "d_model": config.hidden_size,
                  "n_heads": config.num_attention_heads, "block_size": config.max_position_embeddings,
                  "vocab_size": config.vocab_size, "dropout": 0.0, "bias": bool(config.attention_bias),
                  "norm": "rmsnorm", "norm_eps": config.rms_norm_eps,
                  "tie_embeddings": bool(config.tie_word_embeddings)},
        "architecture": {"use": "decoder"},
        "position": {"use": "rope", "base": float(rope["rope_theta"])},
        "attention": {"use": "gqa", "n_kv_heads": config.num_key_value_heads},
        "ffn": {"use": "swiglu", "hidden": config.intermediate_size},
    }


def folder_tables(folder) -> dict:
    """The manifest tables of a Hugging Face Llama folder: its config's, and its ``tokenizer.json``
    read by the ``hf`` tokenizer plugin."""
    return {**manifest_tables(read_config(folder)), "tokenizer": {"use": "hf", "path": str(folder)}}


def state_dict_from_hf(hf_state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Rename a LlamaForCausalLM state dict into lmlab's names."""
    out = {"tok_emb.weight": hf_state["model.embed_tokens.weight"], "norm_f.weight": hf_state["model.norm.weight"],
           "head.weight": hf_state.get("lm_head.weight", hf_state["model.embed_tokens.weight"])}
    for i in range(n_layers):
        hf, lm = f"model.layers.{i}.", f"blocks.{i}."
        for suffix in ("weight", "bias"):
            for theirs, ours in (("self_attn.q_proj", "attn.q_proj"), ("self_attn.k_proj", "attn.k_proj"),
                                 ("self_attn.v_proj", "attn.v_proj"), ("self_attn.o_proj", "attn.out_proj"), ("mlp.gate_proj", "ffn.gate_proj"),
                                 ("mlp.up_proj", "ffn.up_proj"), ("mlp.down_proj", "ffn.down_proj")):
                if f"{hf}{theirs}.{suffix}" in hf_state:
                    out[f"{lm}{ours}.{suffix}"] = hf_state[f"{hf}{theirs}.{suffix}"]
        out[f"{lm}norm1.weight"] = hf_state[f"{hf}input_layernorm.weight"]
        out[f"{lm}norm2.weight"] = hf_state[f"{hf}post_attention_layernorm.weight"]
    return out


def from_hf(hf_model, build):
    """An lmlab model holding the weights of a transformers LlamaForCausalLM. ``build`` makes the
    model from manifest tables (``lmlab.pretrained.build``, the core's: a plugin assembles no other
    plugins itself)."""
    tables = manifest_tables(hf_model.config)
    model = build(tables)
    state = state_dict_from_hf(hf_model.state_dict(), tables["model"]["n_layers"])
    if tables["model"]["tie_embeddings"]:
        state.pop("head.weight")
    model.load_state_dict(state, strict=not tables["model"]["tie_embeddings"])
    return model


#: LlamaConfig's defaults, for keys a config.json leaves out (transformers writes them all; older or
#: hand-written files may not).
CONFIG_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu",
                   "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                   "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
                   "head_dim": None}


def read_config(folder: Path) -> SimpleNamespace:
    """A Llama config.json as the attributes `manifest_tables` reads (ValueError for another family)."""
    values = hf_files.read_config(folder, MODEL_TYPE, "Llama-family", CONFIG_DEFAULTS)
    values["num_key_value_heads"] = values["num_key_value_heads"] or values["num_attention_heads"]
    if not values.get("rope_parameters"):  # transformers < 5: rope_theta and rope_scaling apart
        scaling = values["rope_scaling"] or {}
        values["rope_parameters"] = {"rope_type": scaling.get("rope_type", scaling.get("type", "default")),
                                     "rope_theta": values["rope_theta"]}
    return SimpleNamespace(**values)


def read_state(folder: Path) -> dict[str, torch.Tensor]:
    """The state dict of a LlamaForCausalLM folder in lmlab's names (`state_dict_from_hf`)."""
    return state_dict_from_hf(hf_files.read_weights(folder), read_config(folder).num_hidden_layers)
