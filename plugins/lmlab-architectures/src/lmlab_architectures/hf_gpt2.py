"""Hugging Face GPT-2 checkpoints → lmlab: what the ``decoder`` architecture reads for model_type
``gpt2`` (Radford et al. 2019).

GPT-2 is lmlab's default model with biases: pre-norm blocks with LayerNorm, `learned` positions,
`mha` attention, an `mlp` ffn with the tanh approximation of GELU, and a head tied to the embedding.
Its checkpoints store linear layers as ``Conv1D`` (weights transposed, (in, out)) and the query, key
and value projections as one fused ``c_attn``: both are undone here. Nothing here imports a plugin.
"""

from pathlib import Path
from types import SimpleNamespace

import torch

from lmlab_architectures import hf_files
from lmlab_architectures.hf_files import weight_files  # noqa: F401 (the folder's files)

MODEL_TYPE = "gpt2"

#: GPT2Config's defaults, for keys a config.json leaves out.
CONFIG_DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
                   "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                   "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "tie_word_embeddings": True}
#: GPT-2's activation names → the mlp plugin's.
ACTIVATIONS = {"gelu_new": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh", "gelu": "gelu", "relu": "relu"}


def manifest_tables(config) -> dict:
    """The manifest tables of a GPT-2 config (a ValueError naming the config key for a feature lmlab lacks)."""
    get = lambda key: getattr(config, key, CONFIG_DEFAULTS[key])  # noqa: E731
    if get("activation_function") not in ACTIVATIONS:
        raise ValueError(f"activation_function: {get('activation_function')!r} is not one of {', '.join(ACTIVATIONS)}")
    if not get("scale_attn_weights") or get("scale_attn_by_inverse_layer_idx"):
        raise ValueError("scale_attn_weights / scale_attn_by_inverse_layer_idx: only GPT-2's 1/sqrt(head_dim) "
                         "attention scale is supported")
    if not get("tie_word_embeddings"):
        raise ValueError("tie_word_embeddings: GPT-2's head is its embedding")
    d_model = get("n_embd")
    return {
        "model": {"n_layers": get("n_layer"), "d_model": d_model, "n_heads": get("n_head"),
                  "block_size": get("n_positions"), "vocab_size": get("vocab_size"), "dropout": 0.0, "bias": True,
                  "norm": "layernorm", "norm_eps": float(get("layer_norm_epsilon")), "tie_embeddings": True},
        "architecture": {"use": "decoder"},
        "position": {"use": "learned"},
        "attention": {"use": "mha"},
        "ffn": {"use": "mlp", "hidden": get("n_inner") or 4 * d_model,
                "activation": ACTIVATIONS[get("activation_function")]},
    }


def folder_tables(folder) -> dict:
    """The manifest tables of a Hugging Face GPT-2 folder, with its ``tokenizer.json`` (the ``hf`` tokenizer)."""
    return {**manifest_tables(read_config(folder)), "tokenizer": {"use": "hf", "path": str(folder)}}


def state_dict_from_hf(hf_state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Rename (and un-transpose, un-fuse) a GPT2LMHeadModel or GPT2Model state dict into lmlab's names."""
    prefix = "transformer." if "transformer.wte.weight" in hf_state else ""
    get = lambda name: hf_state[prefix + name]  # noqa: E731
    out = {"tok_emb.weight": get("wte.weight"), "position.wpe.weight": get("wpe.weight"),
           "norm_f.weight": get("ln_f.weight"), "norm_f.bias": get("ln_f.bias")}
    for i in range(n_layers):
        hf, lm = f"h.{i}.", f"blocks.{i}."
        q, k, v = get(f"{hf}attn.c_attn.weight").t().chunk(3, dim=0)  # Conv1D: (in, 3·out)
        qb, kb, vb = get(f"{hf}attn.c_attn.bias").chunk(3)
        out.update({f"{lm}attn.q_proj.weight": q, f"{lm}attn.k_proj.weight": k, f"{lm}attn.v_proj.weight": v,
                    f"{lm}attn.q_proj.bias": qb, f"{lm}attn.k_proj.bias": kb, f"{lm}attn.v_proj.bias": vb})
        for theirs, ours in (("attn.c_proj", "attn.out_proj"), ("mlp.c_fc", "ffn.c_fc"), ("mlp.c_proj", "ffn.c_proj")):
            out[f"{lm}{ours}.weight"] = get(f"{hf}{theirs}.weight").t()
            out[f"{lm}{ours}.bias"] = get(f"{hf}{theirs}.bias")
        for theirs, ours in (("ln_1", "norm1"), ("ln_2", "norm2")):
            out[f"{lm}{ours}.weight"], out[f"{lm}{ours}.bias"] = get(f"{hf}{theirs}.weight"), get(f"{hf}{theirs}.bias")
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(hf_model, build):
    """An lmlab model holding the weights of a transformers GPT2LMHeadModel (``build``: the core's
    ``lmlab.pretrained.build``)."""
    tables = manifest_tables(hf_model.config)
    model = build(tables)
    model.load_state_dict(state_dict_from_hf(hf_model.state_dict(), tables["model"]["n_layers"]), strict=False)
    return model


def read_config(folder: Path) -> SimpleNamespace:
    """A GPT-2 config.json as the attributes `manifest_tables` reads (ValueError for another family)."""
    return SimpleNamespace(**hf_files.read_config(folder, MODEL_TYPE, "GPT-2", CONFIG_DEFAULTS))


def read_state(folder: Path) -> dict[str, torch.Tensor]:
    """The state dict of a GPT-2 folder in lmlab's names (`state_dict_from_hf`)."""
    return state_dict_from_hf(hf_files.read_weights(folder), read_config(folder).n_layer)


# -- lmlab → Hugging Face ------------------------------------------------------------------------------

def writable(tables: dict) -> str | None:
    """Why the model of ``tables`` is no GPT-2 checkpoint (naming the key), or None."""
    m, f = tables["model"], tables["ffn"]
    for key, value, wanted in (("position.use", tables["position"]["use"], "learned"),
                               ("attention.use", tables["attention"]["use"], "mha"), ("ffn.use", f["use"], "mlp"),
                               ("model.norm", m["norm"], "layernorm"), ("model.bias", m["bias"], True),
                               ("model.tie_embeddings", m["tie_embeddings"], True)):
        if value != wanted:
            return f"{key}: {value!r} (GPT-2 has {wanted!r})"
    if f.get("activation") not in ("gelu-tanh", "gelu", "relu"):
        return f"ffn.activation: {f.get('activation')!r}"
    attention = tables["attention"]
    if attention.get("qk_norm") or attention.get("qkv_bias") is False:
        return "attention.qk_norm / qkv_bias: GPT-2's attention has neither switch"
    return None


def to_hf(tables: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and the state dict of the GPT-2 checkpoint that computes what the lmlab model of
    ``tables`` with ``state`` computes (Conv1D weights transposed back, q, k and v fused)."""
    m, f = tables["model"], tables["ffn"]
    activation = {"gelu-tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}[f["activation"]]
    config = {"model_type": MODEL_TYPE, "architectures": ["GPT2LMHeadModel"], "vocab_size": m["vocab_size"],
              "n_positions": m["block_size"], "n_embd": m["d_model"], "n_layer": m["n_layers"], "n_head": m["n_heads"],
              "n_inner": f["hidden"], "activation_function": activation, "layer_norm_epsilon": m["norm_eps"],
              "tie_word_embeddings": True, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    out = {"transformer.wte.weight": state["tok_emb.weight"], "transformer.wpe.weight": state["position.wpe.weight"],
           "transformer.ln_f.weight": state["norm_f.weight"], "transformer.ln_f.bias": state["norm_f.bias"]}
    for i in range(m["n_layers"]):
        hf, lm = f"transformer.h.{i}.", f"blocks.{i}."
        out[f"{hf}attn.c_attn.weight"] = torch.cat([state[f"{lm}attn.{x}_proj.weight"] for x in "qkv"]).t()
        out[f"{hf}attn.c_attn.bias"] = torch.cat([state[f"{lm}attn.{x}_proj.bias"] for x in "qkv"])
        for theirs, ours in (("attn.c_proj", "attn.out_proj"), ("mlp.c_fc", "ffn.c_fc"), ("mlp.c_proj", "ffn.c_proj")):
            out[f"{hf}{theirs}.weight"] = state[f"{lm}{ours}.weight"].t()
            out[f"{hf}{theirs}.bias"] = state[f"{lm}{ours}.bias"]
        for theirs, ours in (("ln_1", "norm1"), ("ln_2", "norm2")):
            out[f"{hf}{theirs}.weight"], out[f"{hf}{theirs}.bias"] = state[f"{lm}{ours}.weight"], state[f"{lm}{ours}.bias"]
    return config, {k: v.contiguous() for k, v in out.items()}
