"""Hugging Face T5 → lmlab: the checkpoints the ``encoder-decoder`` architecture reads (model_type "t5").

The original T5 (Raffel et al. 2020; ``feed_forward_proj = "relu"``) is an lmlab encoder–decoder
model (``[architecture] use = "encoder-decoder"``, the plugin of lmlab-architectures) with RMSNorm
(T5LayerNorm: no mean, no bias), the `t5` position plugin (one relative-bias table per stack, held by
T5's first block and shared by every layer), `mha` attention in both stacks and for cross-attention,
and the `mlp` ffn with ReLU; no biases anywhere, one embedding shared by the encoder and the decoder.
Nothing here imports a plugin: the model is assembled from the tables like any manifest's.

    from transformers import T5ForConditionalGeneration
    from lmlab import pretrained
    hf = T5ForConditionalGeneration.from_pretrained(...)
    model = from_hf(hf, pretrained.build)   # an lmlab EncoderDecoderModel with the same function
    tables = manifest_tables(hf.config)   # the [model]/[architecture]/[position]/[attention]/[ffn] tables

Two differences of computation are folded into the weights when converting, so the converted model
computes what T5 does with lmlab's unchanged modules:

- T5 does not scale its attention scores by 1/sqrt(d_kv) (Mesh TensorFlow folds it into the query
  projection's initialisation); lmlab's attention does, as SDPA does. Every ``q_proj`` (self- and
  cross-attention, both stacks) is T5's ``q`` times sqrt(d_kv).
- Original T5 multiplies the decoder's output by d_model ** -0.5 before its output layer
  (transformers: ``scale_decoder_outputs``, which older configs express as ``tie_word_embeddings``
  true). lmlab's head is therefore untied (``tie_embeddings = false``) and holds the output matrix
  times d_model ** -0.5; that matrix is ``lm_head.weight`` where the checkpoint has one, else the
  shared embedding (transformers 5 always ties them). Fine-tuning then trains the head apart from the
  embedding.

T5 has no learned positions, so no weight depends on the context length: the tables set
``model.block_size`` to :data:`BLOCK_SIZE` (T5's pre-training input length), which a manifest may
change freely.

A checkpoint folder on disk (``save_pretrained``: config.json and safetensors) is read without
transformers: ``folder_tables(folder)`` and ``read_state(folder)``, which is how ``[init] from`` starts
a run from one (``EncoderDecoder.hf_tables`` / ``hf_state``).
"""

import math
from pathlib import Path
from types import SimpleNamespace

import torch

from lmlab_architectures import hf_files
from lmlab_architectures.hf_files import SAFETENSORS, SAFETENSORS_INDEX, weight_files  # noqa: F401 (the folder's files)

MODEL_TYPE = "t5"

#: ``model.block_size`` of a T5's tables: 512 tokens, T5's pre-training input length. Relative
#: position buckets cover every distance, so any other value loads the same weights.
BLOCK_SIZE = 512


def scales_decoder_output(config) -> bool:
    """Whether the decoder's output is multiplied by d_model ** -0.5 before the output layer:
    transformers 5's ``scale_decoder_outputs``, or (transformers 4, older configs) ``tie_word_embeddings``
    not false."""
    scale = getattr(config, "scale_decoder_outputs", None)
    if scale is None:
        scale = getattr(config, "tie_word_embeddings", True) is not False
    return bool(scale)


def decoder_start_id(config) -> int:
    """``decoder_start_token_id``, else the pad id (what T5's decoder starts from), else 0."""
    for key in ("decoder_start_token_id", "pad_token_id"):
        value = getattr(config, key, None)
        if value is not None:
            return int(value)
    return 0


def manifest_tables(config) -> dict:
    """The manifest tables of a T5 config (raises ValueError for features lmlab lacks)."""
    projection = getattr(config, "feed_forward_proj", "relu")
    if projection != "relu":
        raise ValueError(f"feed_forward_proj {projection!r} is not supported: lmlab reads original T5's ReLU "
                         "feed-forward (\"relu\", the mlp ffn); the gated ones of T5 v1.1, Flan-T5 and mT5 "
                         "(\"gated-gelu\") have no lmlab ffn")
    if config.d_kv * config.num_heads != config.d_model:
        raise ValueError(f"d_kv × num_heads ({config.d_kv} × {config.num_heads}) must equal d_model "
                         f"({config.d_model}): lmlab's attention heads are d_model / n_heads wide")
    if getattr(config, "is_encoder_decoder", True) is False:
        raise ValueError("is_encoder_decoder is false: lmlab reads T5's encoder–decoder checkpoints")
    decoder_layers = getattr(config, "num_decoder_layers", None) or config.num_layers
    return {
        "model": {"n_layers": decoder_layers, "d_model": config.d_model, "n_heads": config.num_heads,
                  "block_size": BLOCK_SIZE, "vocab_size": config.vocab_size, "dropout": 0.0, "bias": False,
                  "norm": "rmsnorm", "norm_eps": config.layer_norm_epsilon, "tie_embeddings": False},
        "architecture": {"use": "encoder-decoder", "encoder_layers": config.num_layers, "share_embeddings": True,
                         "decoder_start_id": decoder_start_id(config)},
        "position": {"use": "t5", "num_buckets": config.relative_attention_num_buckets,
                     "max_distance": config.relative_attention_max_distance},
        "attention": {"use": "mha"},
        "ffn": {"use": "mlp", "hidden": config.d_ff, "activation": "relu"},
    }


def folder_tables(folder) -> dict:
    """The manifest tables of a Hugging Face T5 folder: its config's, and its ``tokenizer.json`` read by
    the ``hf`` tokenizer plugin."""
    return {**manifest_tables(read_config(folder)), "tokenizer": {"use": "hf", "path": str(folder)}}


def weight_map(config, untied_head: bool = False) -> list[tuple[str, str, float]]:
    """``(lmlab name, Hugging Face name, factor)`` for every lmlab weight: lmlab's = factor × T5's.
    ``untied_head``: the checkpoint has its own ``lm_head.weight`` (else the head is the embedding)."""
    q_scale = math.sqrt(config.d_kv)
    head_scale = config.d_model ** -0.5 if scales_decoder_output(config) else 1.0
    out = [("tok_emb.weight", "shared.weight", 1.0), ("enc_emb.weight", "shared.weight", 1.0),
           ("head.weight", "lm_head.weight" if untied_head else "shared.weight", head_scale),
           ("enc_position.relative_attention_bias.weight",
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", 1.0),
           ("position.relative_attention_bias.weight",
            "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", 1.0),
           ("enc_norm.weight", "encoder.final_layer_norm.weight", 1.0),
           ("norm_f.weight", "decoder.final_layer_norm.weight", 1.0)]

    def attention(lm: str, hf: str) -> list[tuple[str, str, float]]:
        return [(f"{lm}.q_proj.weight", f"{hf}.q.weight", q_scale), (f"{lm}.k_proj.weight", f"{hf}.k.weight", 1.0),
                (f"{lm}.v_proj.weight", f"{hf}.v.weight", 1.0), (f"{lm}.out_proj.weight", f"{hf}.o.weight", 1.0)]

    def ffn(lm: str, hf: str) -> list[tuple[str, str, float]]:  # a block's norm2 and ffn; T5's T5LayerFF
        return [(f"{lm}.norm2.weight", f"{hf}.layer_norm.weight", 1.0),
                (f"{lm}.ffn.c_fc.weight", f"{hf}.DenseReluDense.wi.weight", 1.0),
                (f"{lm}.ffn.c_proj.weight", f"{hf}.DenseReluDense.wo.weight", 1.0)]

    for i in range(config.num_layers):  # T5Block: layer 0 self-attention, layer 1 feed-forward
        lm, hf = f"enc_blocks.{i}", f"encoder.block.{i}.layer"
        out += [(f"{lm}.norm1.weight", f"{hf}.0.layer_norm.weight", 1.0),
                *attention(f"{lm}.attn", f"{hf}.0.SelfAttention"), *ffn(lm, f"{hf}.1")]
    for i in range(getattr(config, "num_decoder_layers", None) or config.num_layers):  # ... 1 cross, 2 feed-forward
        lm, hf = f"blocks.{i}", f"decoder.block.{i}.layer"
        out += [(f"{lm}.norm1.weight", f"{hf}.0.layer_norm.weight", 1.0),
                *attention(f"{lm}.attn", f"{hf}.0.SelfAttention"),
                (f"{lm}.norm_cross.weight", f"{hf}.1.layer_norm.weight", 1.0),
                *attention(f"{lm}.cross", f"{hf}.1.EncDecAttention"), *ffn(lm, f"{hf}.2")]
    return out


#: Names the shared embedding may be stored under (``shared.weight`` in what save_pretrained writes).
EMBEDDING_NAMES = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def state_dict_from_hf(hf_state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """A T5ForConditionalGeneration state dict in lmlab's names, with the query projections times
    sqrt(d_kv) and the head times d_model ** -0.5 where T5 scales the decoder's output."""
    hf_state = dict(hf_state)
    if "shared.weight" not in hf_state:
        found = next((name for name in EMBEDDING_NAMES if name in hf_state), None)
        if found is None:
            raise KeyError("shared.weight (the token embedding)")
        hf_state["shared.weight"] = hf_state[found]
    out = {}
    for ours, theirs, factor in weight_map(config, untied_head="lm_head.weight" in hf_state):
        value = hf_state[theirs]
        out[ours] = value * factor if factor != 1.0 else value
    return out


def from_hf(hf_model, build):
    """An lmlab encoder–decoder model computing what a transformers T5ForConditionalGeneration does.
    ``build`` makes the model from manifest tables (``lmlab.pretrained.build``, the core's: a plugin
    assembles no other plugins itself)."""
    tables = manifest_tables(hf_model.config)
    model = build(tables)
    model.load_state_dict(state_dict_from_hf(hf_model.state_dict(), hf_model.config))  # copies the values
    return model


#: T5Config's defaults, for keys a config.json leaves out (transformers writes them all; older or
#: hand-written files may not).
CONFIG_DEFAULTS = {"vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6,
                   "num_decoder_layers": None, "num_heads": 8, "relative_attention_num_buckets": 32,
                   "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6, "feed_forward_proj": "relu",
                   "tie_word_embeddings": True, "scale_decoder_outputs": None, "is_encoder_decoder": True,
                   "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": None}


def read_config(folder: Path) -> SimpleNamespace:
    """A T5 config.json as the attributes `manifest_tables` reads (ValueError for another family)."""
    values = hf_files.read_config(folder, MODEL_TYPE, "T5", CONFIG_DEFAULTS)
    values["num_decoder_layers"] = values["num_decoder_layers"] or values["num_layers"]
    values["scale_decoder_outputs"] = scales_decoder_output(SimpleNamespace(**values))
    return SimpleNamespace(**values)


def read_state(folder: Path) -> dict[str, torch.Tensor]:
    """The state dict of a T5ForConditionalGeneration folder in lmlab's names (`state_dict_from_hf`)."""
    return state_dict_from_hf(hf_files.read_weights(folder), read_config(folder))


def writable(tables: dict) -> str | None:
    """Why the model of ``tables`` is no T5 checkpoint (naming the key), or None."""
    m, a, arch = tables["model"], tables["attention"], tables["architecture"]
    for key, value, wanted in (("position.use", tables["position"]["use"], "t5"), ("attention.use", a["use"], "mha"),
                               ("ffn.use", tables["ffn"]["use"], "mlp"), ("ffn.activation",
                                                                          tables["ffn"].get("activation"), "relu"),
                               ("model.norm", m["norm"], "rmsnorm"), ("model.bias", m["bias"], False),
                               ("architecture.share_embeddings", arch.get("share_embeddings", True), True)):
        if value != wanted:
            return f"{key}: {value!r} (T5 has {wanted!r})"
    if a.get("qk_norm") or a.get("qkv_bias"):
        return "attention.qk_norm / qkv_bias: T5's attention has neither"
    return None


def to_hf(tables: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and the state dict of the T5ForConditionalGeneration that computes what the lmlab
    encoder–decoder model of ``tables`` with ``state`` computes: the inverse of ``weight_map``.
    transformers ties T5's output layer to the shared embedding whatever the config says, scaling the
    decoder's output (original T5) or not (``tie_word_embeddings = false``, T5 v1.1's spelling), so the
    lmlab head must still be the embedding, scaled or not: a ValueError naming ``model.tie_embeddings``
    when training moved it away (fold a PEFT run's adapter in first: its head never moves)."""
    m, arch, pos = tables["model"], tables["architecture"], tables["position"]
    start = arch.get("decoder_start_id")
    config = {"model_type": MODEL_TYPE, "architectures": ["T5ForConditionalGeneration"], "vocab_size": m["vocab_size"],
              "d_model": m["d_model"], "d_kv": m["d_model"] // m["n_heads"], "d_ff": tables["ffn"]["hidden"],
              "num_layers": arch.get("encoder_layers") or m["n_layers"], "num_decoder_layers": m["n_layers"],
              "num_heads": m["n_heads"], "relative_attention_num_buckets": pos["num_buckets"],
              "relative_attention_max_distance": pos["max_distance"], "layer_norm_epsilon": m["norm_eps"],
              "feed_forward_proj": "relu", "dropout_rate": 0.0, "is_encoder_decoder": True,
              "decoder_start_token_id": 0 if start is None else start}
    head, embedding = state["head.weight"], state["tok_emb.weight"]
    scaled = torch.allclose(head, embedding * m["d_model"] ** -0.5, rtol=1e-5, atol=0)
    if not scaled and not torch.equal(head, embedding):
        raise ValueError("model.tie_embeddings: the run trained its output layer apart from the shared embedding, "
                         "and a T5 checkpoint ties them (transformers ties them always)")
    config.update(tie_word_embeddings=scaled, scale_decoder_outputs=scaled)
    layout = SimpleNamespace(**config)
    out = {}
    for ours, theirs, factor in weight_map(layout):
        if theirs not in out:  # the shared embedding is the encoder's and the decoder's
            out[theirs] = state[ours] / factor if factor != 1.0 else state[ours]
    return config, out
