"""Hugging Face Llama-family checkpoints → lmlab: what the ``decoder`` architecture reads for the
model types ``llama`` (SmolLM, Llama 2 and 3 with their rope scaling), ``mistral``, ``qwen2`` (Qwen2,
Qwen2.5) and ``qwen3``.

All four are decoder-only lmlab models with RMSNorm, `rope` positions, `gqa` attention and a
`swiglu` ffn; they differ in a few switches, each an option of those plugins: Qwen2 puts biases on
the query, key and value projections alone (``attention.qkv_bias``), Qwen3 RMS-normalises each query
and key head (``attention.qk_norm``) and sizes its heads apart from the width (``model.head_dim``),
Llama 3 stretches its rope frequencies (``position.scaling = "llama3"``). The names below are manifest
values and the parameter names those first-party plugins document (attention
`q_proj`/`k_proj`/`v_proj`/`out_proj`/`q_norm`/`k_norm`, ffn `gate_proj`/`up_proj`/`down_proj`); nothing
here imports a plugin: the model is assembled from the tables like any manifest's.

    from transformers import AutoModelForCausalLM
    from lmlab import pretrained
    hf = AutoModelForCausalLM.from_pretrained(...)
    model = from_hf(hf, pretrained.build)    # an lmlab model with the same weights
    tables = manifest_tables(hf.config)      # the [model]/[architecture]/[position]/[attention]/[ffn] tables

A checkpoint folder on disk (``save_pretrained``: config.json and safetensors) is read without
transformers: ``folder_tables(folder)`` and ``read_state(folder)``, which is how ``[init] from`` starts
a run from one (``Decoder.hf_tables`` / ``hf_state``). A config lmlab cannot express is refused with a
ValueError naming its key.
"""

from pathlib import Path
from types import SimpleNamespace

import torch

from lmlab_architectures import hf_files
from lmlab_architectures.hf_files import SAFETENSORS, SAFETENSORS_INDEX, weight_files  # noqa: F401 (the folder's files)

#: config.json's model_type → the family's name.
MODEL_TYPES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
MODEL_TYPE = "llama"

#: The transformers config classes' defaults, for keys a config.json leaves out (transformers writes
#: them all; older or hand-written files may not): LlamaConfig's, and what the others change.
CONFIG_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu",
                   "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                   "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
                   "head_dim": None, "sliding_window": None, "use_sliding_window": False}
FAMILY_DEFAULTS = {"mistral": {"sliding_window": 4096, "max_position_embeddings": 4096 * 32},
                   "qwen2": {"vocab_size": 151936, "max_position_embeddings": 32768, "sliding_window": 4096},
                   "qwen3": {"vocab_size": 151936, "max_position_embeddings": 32768, "head_dim": 128,
                             "sliding_window": 4096}}

#: (Hugging Face name, lmlab name) of each per-layer tensor, below ``model.layers.{i}.`` / ``blocks.{i}.``.
LAYER_NAMES = (("self_attn.q_proj", "attn.q_proj"), ("self_attn.k_proj", "attn.k_proj"),
               ("self_attn.v_proj", "attn.v_proj"), ("self_attn.o_proj", "attn.out_proj"),
               ("self_attn.q_norm", "attn.q_norm"), ("self_attn.k_norm", "attn.k_norm"),
               ("mlp.gate_proj", "ffn.gate_proj"), ("mlp.up_proj", "ffn.up_proj"), ("mlp.down_proj", "ffn.down_proj"),
               ("input_layernorm", "norm1"), ("post_attention_layernorm", "norm2"))


def _get(config, key: str):
    kind = getattr(config, "model_type", MODEL_TYPE)
    default = FAMILY_DEFAULTS.get(kind, {}).get(key, CONFIG_DEFAULTS.get(key))
    return getattr(config, key, default)


def rope_table(config) -> dict:
    """The ``[position]`` table of the config's rope settings (transformers ≥ 5 ``rope_parameters``,
    older ``rope_theta`` with ``rope_scaling``)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if not rope:
        rope = dict(_get(config, "rope_scaling") or {})
        rope.setdefault("rope_theta", _get(config, "rope_theta"))
    kind = rope.get("rope_type", rope.get("type", "default"))
    table = {"use": "rope", "base": float(rope["rope_theta"])}
    if kind == "default":
        return table
    if kind == "linear":
        return {**table, "scaling": "linear", "factor": float(rope["factor"])}
    if kind == "llama3":
        return {**table, "scaling": "llama3", "factor": float(rope["factor"]),
                "low_freq_factor": float(rope["low_freq_factor"]), "high_freq_factor": float(rope["high_freq_factor"]),
                "original_max_positions": int(rope["original_max_position_embeddings"])}
    raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported (default, linear, llama3)")


def manifest_tables(config) -> dict:
    """The manifest tables of a Llama-family config (a ValueError naming the config key for a
    feature lmlab lacks)."""
    kind = getattr(config, "model_type", MODEL_TYPE)
    if kind not in MODEL_TYPES:
        raise ValueError(f"model_type {kind!r} is not a Llama-family type ({', '.join(MODEL_TYPES)})")
    heads, hidden = config.num_attention_heads, config.hidden_size
    head_dim = _get(config, "head_dim") or hidden // heads
    if _get(config, "hidden_act") != "silu":
        raise ValueError(f"hidden_act: {config.hidden_act!r} is not SwiGLU's silu")
    window = _get(config, "sliding_window")
    uses_window = _get(config, "use_sliding_window") if kind in ("qwen2", "qwen3") else window is not None
    if uses_window and window is not None and window < config.max_position_embeddings:
        raise ValueError(f"sliding_window: attention limited to {window} tokens is not supported (gqa attends to "
                         "the whole context)")
    qkv_bias = kind == "qwen2"
    bias = bool(_get(config, "attention_bias"))
    if kind != "qwen2" and bool(_get(config, "mlp_bias")) != bias:
        raise ValueError("attention_bias / mlp_bias: lmlab's model.bias covers attention and ffn together; this "
                         "config mixes them")
    attention = {"use": "gqa", "n_kv_heads": _get(config, "num_key_value_heads") or heads}
    if qkv_bias:
        attention["qkv_bias"] = True
    if kind == "qwen3":
        attention.update(qk_norm=True, qk_norm_eps=float(config.rms_norm_eps))
    model = {"n_layers": config.num_hidden_layers, "d_model": hidden, "n_heads": heads,
             "block_size": config.max_position_embeddings, "vocab_size": config.vocab_size, "dropout": 0.0,
             "bias": bias, "norm": "rmsnorm", "norm_eps": float(config.rms_norm_eps),
             "tie_embeddings": bool(_get(config, "tie_word_embeddings"))}
    if head_dim * heads != hidden:
        model["head_dim"] = head_dim
    return {"model": model, "architecture": {"use": "decoder"}, "position": rope_table(config),
            "attention": attention, "ffn": {"use": "swiglu", "hidden": config.intermediate_size}}


def folder_tables(folder) -> dict:
    """The manifest tables of a Hugging Face Llama-family folder: its config's, and its
    ``tokenizer.json`` read by the ``hf`` tokenizer plugin."""
    return {**manifest_tables(read_config(folder)), "tokenizer": {"use": "hf", "path": str(folder)}}


def state_dict_from_hf(hf_state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Rename a Llama-family ``*ForCausalLM`` state dict into lmlab's names."""
    out = {"tok_emb.weight": hf_state["model.embed_tokens.weight"], "norm_f.weight": hf_state["model.norm.weight"],
           "head.weight": hf_state.get("lm_head.weight", hf_state["model.embed_tokens.weight"])}
    for i in range(n_layers):
        hf, lm = f"model.layers.{i}.", f"blocks.{i}."
        for theirs, ours in LAYER_NAMES:
            for suffix in ("weight", "bias"):
                if f"{hf}{theirs}.{suffix}" in hf_state:
                    out[f"{lm}{ours}.{suffix}"] = hf_state[f"{hf}{theirs}.{suffix}"]
    return out


def from_hf(hf_model, build):
    """An lmlab model holding the weights of a transformers Llama-family model. ``build`` makes the
    model from manifest tables (``lmlab.pretrained.build``, the core's: a plugin assembles no other
    plugins itself)."""
    tables = manifest_tables(hf_model.config)
    model = build(tables)
    state = state_dict_from_hf(hf_model.state_dict(), tables["model"]["n_layers"])
    if tables["model"]["tie_embeddings"]:
        state.pop("head.weight")
    model.load_state_dict(state, strict=not tables["model"]["tie_embeddings"])
    return model


def read_config(folder: Path) -> SimpleNamespace:
    """A Llama-family config.json as the attributes `manifest_tables` reads (ValueError for another family)."""
    kind = hf_files.model_type(folder)
    if kind not in MODEL_TYPES:
        raise ValueError(f"config.json has model_type {kind!r}; this reader takes Llama-family checkpoints "
                         f"(model_type {', '.join(MODEL_TYPES)})")
    values = hf_files.read_config(folder, kind, MODEL_TYPES[kind], {**CONFIG_DEFAULTS, **FAMILY_DEFAULTS.get(kind, {})})
    values["num_key_value_heads"] = values["num_key_value_heads"] or values["num_attention_heads"]
    return SimpleNamespace(**values)


def read_state(folder: Path) -> dict[str, torch.Tensor]:
    """The state dict of a Llama-family folder in lmlab's names (`state_dict_from_hf`)."""
    return state_dict_from_hf(hf_files.read_weights(folder), read_config(folder).num_hidden_layers)


# -- lmlab → Hugging Face ------------------------------------------------------------------------------

#: model_type → the transformers class that loads it (config.json's ``architectures``).
CAUSAL_LM = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def writable(tables: dict) -> str | None:
    """Why the model of ``tables`` is no Llama-family checkpoint (naming the key), or None."""
    m, p, a, f = tables["model"], tables["position"], tables["attention"], tables["ffn"]
    for key, value, wanted in (("position.use", p["use"], ("rope",)), ("attention.use", a["use"], ("gqa", "mha", "mqa")),
                               ("ffn.use", f["use"], ("swiglu",)), ("model.norm", m["norm"], ("rmsnorm",))):
        if value not in wanted:
            return f"{key}: {value!r} (the Llama family has {' or '.join(wanted)})"
    if p.get("fraction", 1.0) != 1.0:
        return f"position.fraction: {p['fraction']} (the Llama family rotates whole heads)"
    if tables["architecture"].get("shared_norm") is not None:
        return "architecture.use: parallel blocks (the Llama family's are sequential)"
    if a.get("qkv_bias") is not None and a["qkv_bias"] != m["bias"] and (m["bias"] or a.get("qk_norm")):
        return "attention.qkv_bias: biases on q, k and v alone, with others elsewhere, is no Llama-family layout"
    if a.get("qk_norm") and m["bias"]:
        return "model.bias: Qwen3 (the family with qk_norm) has no feed-forward biases"
    return None


def to_hf(tables: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and the state dict of the Llama-family checkpoint (llama, qwen2 or qwen3) that
    computes what the lmlab model of ``tables`` with ``state`` computes (the inverse of
    `manifest_tables` and `state_dict_from_hf`)."""
    m, p, a = tables["model"], tables["position"], tables["attention"]
    heads = m["n_heads"]
    kind = "qwen3" if a.get("qk_norm") else "qwen2" if a.get("qkv_bias") and not m["bias"] else "llama"
    kv_heads = {"mha": heads, "mqa": 1}.get(a["use"]) or a.get("n_kv_heads") or heads
    config = {"model_type": kind, "architectures": [CAUSAL_LM[kind]], "vocab_size": m["vocab_size"],
              "hidden_size": m["d_model"], "intermediate_size": tables["ffn"]["hidden"],
              "num_hidden_layers": m["n_layers"], "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": m.get("head_dim") or m["d_model"] // heads, "hidden_act": "silu",
              "max_position_embeddings": m["block_size"], "rms_norm_eps": m["norm_eps"],
              "tie_word_embeddings": m["tie_embeddings"], "attention_bias": m["bias"], "mlp_bias": m["bias"],
              "rope_theta": p["base"], "rope_scaling": _rope_scaling(p), "use_sliding_window": False,
              "sliding_window": None}
    out = {"model.embed_tokens.weight": state["tok_emb.weight"], "model.norm.weight": state["norm_f.weight"]}
    if not m["tie_embeddings"]:
        out["lm_head.weight"] = state["head.weight"]
    for i in range(m["n_layers"]):
        for theirs, ours in LAYER_NAMES:
            for suffix in ("weight", "bias"):
                if f"blocks.{i}.{ours}.{suffix}" in state:
                    out[f"model.layers.{i}.{theirs}.{suffix}"] = state[f"blocks.{i}.{ours}.{suffix}"]
    return config, out


def _rope_scaling(p: dict) -> dict | None:
    if p.get("scaling", "none") == "none":
        return None
    if p["scaling"] == "linear":
        return {"rope_type": "linear", "factor": p["factor"]}
    return {"rope_type": "llama3", "factor": p["factor"], "low_freq_factor": p["low_freq_factor"],
            "high_freq_factor": p["high_freq_factor"], "original_max_position_embeddings": p["original_max_positions"]}
