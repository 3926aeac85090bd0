"""Hugging Face GPT-NeoX checkpoints (Pythia, GPT-NeoX-20B) → lmlab and back: what the
``parallel-block`` architecture reads for model_type ``gpt_neox`` (Black et al. 2022; Biderman et al.
2023).

A GPT-NeoX layer is a parallel block with two norms, x + attn(ln1 x) + mlp(ln2 x)
(``shared_norm = false``), LayerNorm with biases, ``mha`` attention whose query, key and value
projections are stored fused per head (``query_key_value``: for each head its q, k and v rows, undone
here), `rope` on the first ``partial_rotary_factor`` of each head (``position.fraction``, a quarter in
Pythia), an `mlp` ffn and an untied head. Checkpoints with sequential blocks
(``use_parallel_residual = false``) are refused. Nothing here imports a plugin.
"""

from pathlib import Path
from types import SimpleNamespace

import torch

from lmlab_architectures import hf_files
from lmlab_architectures.hf_files import weight_files  # noqa: F401 (the folder's files)

MODEL_TYPE = "gpt_neox"

#: GPTNeoXConfig's defaults, for keys a config.json leaves out (before transformers 5: rotary_pct and
#: rotary_emb_base; from 5: rope_parameters).
CONFIG_DEFAULTS = {"vocab_size": 50432, "hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
                   "intermediate_size": 24576, "hidden_act": "gelu", "rotary_pct": 0.25, "rotary_emb_base": 10000,
                   "max_position_embeddings": 2048, "layer_norm_eps": 1e-5, "tie_word_embeddings": False,
                   "use_parallel_residual": True, "rope_scaling": None, "attention_bias": True, "rope_parameters": None}
#: GPT-NeoX's activation names → the mlp plugin's.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh", "relu": "relu"}
#: (Hugging Face name, lmlab name) of each per-layer tensor kept as it is, below ``gpt_neox.layers.{i}.`` / ``blocks.{i}.``.
LAYER_NAMES = (("attention.dense", "attn.out_proj"), ("mlp.dense_h_to_4h", "ffn.c_fc"),
               ("mlp.dense_4h_to_h", "ffn.c_proj"), ("input_layernorm", "norm1"),
               ("post_attention_layernorm", "norm2"))


def manifest_tables(config) -> dict:
    """The manifest tables of a GPT-NeoX config (a ValueError naming the config key for a feature lmlab lacks)."""
    get = lambda key: getattr(config, key, CONFIG_DEFAULTS[key])  # noqa: E731
    if not get("use_parallel_residual"):
        raise ValueError("use_parallel_residual: only GPT-NeoX's parallel residual (true, every Pythia) is read")
    if get("hidden_act") not in ACTIVATIONS:
        raise ValueError(f"hidden_act: {get('hidden_act')!r} is not one of {', '.join(ACTIVATIONS)}")
    if not get("attention_bias"):
        raise ValueError("attention_bias: GPT-NeoX without attention biases is not read")
    rope = dict(get("rope_parameters") or get("rope_scaling") or {})  # transformers 5, else older files
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError("rope_scaling: scaled rotary frequencies are not read for GPT-NeoX")
    fraction = float(rope.get("partial_rotary_factor", get("rotary_pct")))
    return {
        "model": {"n_layers": get("num_hidden_layers"), "d_model": get("hidden_size"),
                  "n_heads": get("num_attention_heads"), "block_size": get("max_position_embeddings"),
                  "vocab_size": get("vocab_size"), "dropout": 0.0, "bias": True, "norm": "layernorm",
                  "norm_eps": float(get("layer_norm_eps")), "tie_embeddings": bool(get("tie_word_embeddings"))},
        "architecture": {"use": "parallel-block", "shared_norm": False},
        "position": {"use": "rope", "base": float(rope.get("rope_theta", get("rotary_emb_base"))),
                     "fraction": fraction},
        "attention": {"use": "mha"},
        "ffn": {"use": "mlp", "hidden": get("intermediate_size"), "activation": ACTIVATIONS[get("hidden_act")]},
    }


def folder_tables(folder) -> dict:
    """The manifest tables of a Hugging Face GPT-NeoX folder, with its ``tokenizer.json`` (the ``hf`` tokenizer)."""
    return {**manifest_tables(read_config(folder)), "tokenizer": {"use": "hf", "path": str(folder)}}


def state_dict_from_hf(hf_state: dict[str, torch.Tensor], n_layers: int, n_heads: int) -> dict[str, torch.Tensor]:
    """Rename (and un-fuse) a GPTNeoXForCausalLM state dict into lmlab's names."""
    # The head is embed_out in checkpoint files, lm_head in transformers 5's modules.
    head = hf_state.get("embed_out.weight", hf_state.get("lm_head.weight", hf_state["gpt_neox.embed_in.weight"]))
    out = {"tok_emb.weight": hf_state["gpt_neox.embed_in.weight"], "head.weight": head,
           "norm_f.weight": hf_state["gpt_neox.final_layer_norm.weight"],
           "norm_f.bias": hf_state["gpt_neox.final_layer_norm.bias"]}
    for i in range(n_layers):
        hf, lm = f"gpt_neox.layers.{i}.", f"blocks.{i}."
        for suffix in ("weight", "bias"):
            fused = hf_state[f"{hf}attention.query_key_value.{suffix}"]
            per_head = fused.reshape(n_heads, 3, -1, *fused.shape[1:])  # each head's q, k, v rows in turn
            for j, x in enumerate("qkv"):
                out[f"{lm}attn.{x}_proj.{suffix}"] = per_head[:, j].reshape(-1, *fused.shape[1:])
            for theirs, ours in LAYER_NAMES:
                out[f"{lm}{ours}.{suffix}"] = hf_state[f"{hf}{theirs}.{suffix}"]
    return {k: v.contiguous() for k, v in out.items()}


def read_config(folder: Path) -> SimpleNamespace:
    """A GPT-NeoX config.json as the attributes `manifest_tables` reads (ValueError for another family)."""
    return SimpleNamespace(**hf_files.read_config(folder, MODEL_TYPE, "GPT-NeoX", CONFIG_DEFAULTS))


def read_state(folder: Path) -> dict[str, torch.Tensor]:
    """The state dict of a GPT-NeoX folder in lmlab's names (`state_dict_from_hf`)."""
    config = read_config(folder)
    return state_dict_from_hf(hf_files.read_weights(folder), config.num_hidden_layers, config.num_attention_heads)


# -- lmlab → Hugging Face ------------------------------------------------------------------------------

def writable(tables: dict) -> str | None:
    """Why the model of ``tables`` is no GPT-NeoX checkpoint (naming the key), or None."""
    m, f, p = tables["model"], tables["ffn"], tables["position"]
    for key, value, wanted in (("architecture.shared_norm", tables["architecture"].get("shared_norm"), False),
                               ("position.use", p["use"], "rope"), ("attention.use", tables["attention"]["use"], "mha"),
                               ("ffn.use", f["use"], "mlp"), ("model.norm", m["norm"], "layernorm"),
                               ("model.bias", m["bias"], True), ("position.scaling", p.get("scaling", "none"), "none")):
        if value != wanted:
            return f"{key}: {value!r} (GPT-NeoX has {wanted!r})"
    if f.get("activation") not in ("gelu", "gelu-tanh", "relu"):
        return f"ffn.activation: {f.get('activation')!r}"
    attention = tables["attention"]
    if attention.get("qk_norm") or attention.get("qkv_bias") is False:
        return "attention.qk_norm / qkv_bias: GPT-NeoX's attention has neither switch"
    return None


def to_hf(tables: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and the state dict of the GPT-NeoX checkpoint that computes what the lmlab model of
    ``tables`` with ``state`` computes (q, k and v fused per head)."""
    m, f, p = tables["model"], tables["ffn"], tables["position"]
    heads = m["n_heads"]
    activation = {"gelu": "gelu", "gelu-tanh": "gelu_new", "relu": "relu"}[f["activation"]]
    config = {"model_type": MODEL_TYPE, "architectures": ["GPTNeoXForCausalLM"], "vocab_size": m["vocab_size"],
              "hidden_size": m["d_model"], "num_hidden_layers": m["n_layers"], "num_attention_heads": heads,
              "intermediate_size": f["hidden"], "hidden_act": activation, "max_position_embeddings": m["block_size"],
              "layer_norm_eps": m["norm_eps"], "tie_word_embeddings": m["tie_embeddings"],
              "use_parallel_residual": True, "attention_bias": True, "attention_dropout": 0.0, "hidden_dropout": 0.0,
              "rotary_pct": p.get("fraction", 1.0), "rotary_emb_base": p["base"],
              "rope_parameters": {"rope_type": "default", "rope_theta": p["base"],
                                  "partial_rotary_factor": p.get("fraction", 1.0)}}
    out = {"gpt_neox.embed_in.weight": state["tok_emb.weight"],
           "embed_out.weight": state["tok_emb.weight" if m["tie_embeddings"] else "head.weight"],
           "gpt_neox.final_layer_norm.weight": state["norm_f.weight"],
           "gpt_neox.final_layer_norm.bias": state["norm_f.bias"]}
    for i in range(m["n_layers"]):
        hf, lm = f"gpt_neox.layers.{i}.", f"blocks.{i}."
        for suffix in ("weight", "bias"):
            q, k, v = (state[f"{lm}attn.{x}_proj.{suffix}"] for x in "qkv")
            out[f"{hf}attention.query_key_value.{suffix}"] = torch.stack(
                [t.reshape(heads, -1, *q.shape[1:]) for t in (q, k, v)], dim=1).reshape(-1, *q.shape[1:])
            for theirs, ours in LAYER_NAMES:
                out[f"{hf}{theirs}.{suffix}"] = state[f"{lm}{ours}.{suffix}"]
    return config, {k: v.contiguous() for k, v in out.items()}
