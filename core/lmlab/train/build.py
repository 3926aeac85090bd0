"""Assembling a variant's pieces: the model shape, the model, the hook manager, provenance."""

import importlib.metadata as md

from lmlab import __version__, discovery
from lmlab.api import ModelShape, UserError
from lmlab.discovery import MANY_SLOTS
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


def provenance(variant) -> dict:
    """slot → {name, distribution, version} of each plugin the variant uses."""
    out = {}
    for slot, cls in variant.plugins.items():
        names = [c.name for c in cls] if slot in MANY_SLOTS else [cls.name]
        entries = []
        for name in names:
            info = discovery.find(slot, name, key=f"{slot}.use")
            entries.append({"name": name, "distribution": info.distribution, "version": info.version})
        out[slot] = entries if slot in MANY_SLOTS else entries[0]
    return out


def environment() -> dict:
    import torch

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    return {"lmlab": __version__, "torch": torch.__version__, "lightning": version("lightning")}


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"attention": {"use": "gqa"}} → {"attention.use": "gqa"} (W&B groups by flat keys)."""
    flat = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat
