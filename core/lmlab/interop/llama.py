"""Hugging Face Llama ↔ lmlab.

A Llama is an lmlab model with RMSNorm, `rope` positions, `gqa` attention, a `swiglu` ffn and an
untied head. The names below are manifest values and the parameter names those first-party
plugins document (attention `q_proj`/`k_proj`/`v_proj`/`out_proj`, ffn `gate_proj`/`up_proj`/`down_proj`); nothing
here imports a plugin: the model is assembled through discovery like any manifest's.

    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(...)
    model = from_hf(hf)             # an lmlab LanguageModel with the same weights
    tables = manifest_tables(hf.config)   # the [model]/[architecture]/[position]/[attention]/[ffn] tables

A checkpoint folder on disk (``save_pretrained``: config.json and safetensors) is read without
transformers: ``read_config(folder)`` and ``read_state(folder)``, which is how ``[init] from`` starts
a run from one (``lmlab.pretrained``).
"""

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from lmlab import discovery
from lmlab.model import LanguageModel, build_model, shape_of


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


def build(tables: dict) -> LanguageModel:
    """An (untrained) lmlab model from the tables of `manifest_tables`, built as every run's model is
    (:func:`lmlab.model.build_model`)."""
    from lmlab.config import ModelOptions

    model = ModelOptions(**tables["model"])
    plugins = {}
    for slot in ("architecture", "position", "attention", "ffn"):
        if slot == "architecture" and slot not in tables:  # tables older than API 1.18: build_model's default
            continue
        cls = discovery.load(slot, tables[slot]["use"])
        plugins[slot] = cls(cls.Options(**{k: v for k, v in tables[slot].items() if k != "use"}))
    return build_model(model, shape_of(model, model.vocab_size), plugins)


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


def from_hf(hf_model) -> LanguageModel:
    """An lmlab model holding the weights of a transformers LlamaForCausalLM."""
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
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"


def read_config(folder: Path) -> SimpleNamespace:
    """A Llama config.json as the attributes `manifest_tables` reads (ValueError for another family)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    kind = config.get("model_type")
    if kind != "llama":
        raise ValueError(f"config.json has model_type {kind!r}; lmlab reads Llama-family checkpoints "
                         "(model_type \"llama\")")
    values = {**CONFIG_DEFAULTS, **config}
    values["num_key_value_heads"] = values["num_key_value_heads"] or values["num_attention_heads"]
    if not values.get("rope_parameters"):  # transformers < 5: rope_theta and rope_scaling apart
        scaling = values["rope_scaling"] or {}
        values["rope_parameters"] = {"rope_type": scaling.get("rope_type", scaling.get("type", "default")),
                                     "rope_theta": values["rope_theta"]}
    return SimpleNamespace(**values)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: one, or the shards its index names, in order."""
    folder = Path(folder)
    if (folder / SAFETENSORS_INDEX).is_file():
        weight_map = json.loads((folder / SAFETENSORS_INDEX).read_text())["weight_map"]
        return [folder / name for name in dict.fromkeys(sorted(weight_map.values()))]
    return [folder / SAFETENSORS]


def read_state(folder: Path) -> dict[str, torch.Tensor]:
    """The state dict of a LlamaForCausalLM folder in lmlab's names (`state_dict_from_hf`)."""
    from safetensors.torch import load_file

    hf_state = {}
    for path in weight_files(folder):
        hf_state.update(load_file(path, device="cpu"))
    return state_dict_from_hf(hf_state, read_config(folder).num_hidden_layers)
