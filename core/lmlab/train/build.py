"""Assembling a variant's pieces: the model shape, the model, the plugins, the tracker's config."""

from lmlab.api import ModelShape, UserError
from lmlab.model import LanguageModel


def model_shape(variant, tokenizer_vocab: int) -> ModelShape:
    cfg = variant.manifest["model"]
    vocab = cfg["vocab_size"] or tokenizer_vocab
    if vocab < tokenizer_vocab:
        raise UserError(f"{vocab} is smaller than the tokenizer's vocabulary ({tokenizer_vocab})",
                        key="model.vocab_size")
    return ModelShape(n_layers=cfg["n_layers"], d_model=cfg["d_model"], n_heads=cfg["n_heads"],
                      block_size=cfg["block_size"], vocab_size=vocab, dropout=cfg["dropout"],
                      bias=cfg["bias"], init_std=cfg["init_std"])


def build_model(variant, shape: ModelShape, plugins: dict) -> LanguageModel:
    cfg = variant.manifest["model"]
    return LanguageModel(shape, position=plugins["position"], attention=plugins["attention"],
                         ffn=plugins["ffn"], norm=cfg["norm"], norm_eps=cfg["norm_eps"],
                         tie_embeddings=cfg["tie_embeddings"])


def instantiate_all(variant) -> dict:
    """slot → plugin instance (many-valued slots: a list), each built once for the whole run."""
    return {slot: variant.instantiate(slot) for slot in variant.plugins}


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"attention": {"use": "gqa"}} → {"attention.use": "gqa"}.

    Lists become comma-joined strings: W&B's UI can neither filter nor group by the elements of a
    list-valued config key (wandb issue 6222), and a string compares as a whole.
    """
    flat = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, dotted + "."))
        elif isinstance(value, (list, tuple)):
            flat[dotted] = ",".join(str(v) for v in value)
        else:
            flat[dotted] = value
    return flat


def tracker_config(variant, resolved: dict, peer_keys: tuple[str, ...] = ()) -> dict:
    """The flat config a tracker groups by: every resolved key, plus ``None`` for each key that another
    variant of the same sweep has and this one lacks (W&B cannot group runs of methods whose options
    differ unless each run carries every key — wandb issue 9046), plus ``variant`` (the name without
    its seed, so seeds of one variant group together)."""
    flat = {key: None for key in peer_keys}
    flat.update(flatten(resolved))
    flat["variant"] = variant.group
    return flat
