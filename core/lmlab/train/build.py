"""Assembling a variant's pieces: the model shape, the model, the plugins, the tracker's config."""

from lmlab.api import ModelShape, UserError, Vocabulary
from lmlab.model import LanguageModel


def model_shape(variant, tokenizer_vocab: int, reserved: int = 0) -> ModelShape:
    """The shape of the variant's model; ``reserved``: ids past the tokenizer's vocabulary that the
    objective's special tokens take (see :func:`vocabulary`)."""
    cfg = variant.manifest["model"]
    vocab = cfg["vocab_size"] or tokenizer_vocab + reserved
    if vocab < tokenizer_vocab + reserved:
        needs = f" plus the objective's {reserved} special token(s)" if reserved else ""
        raise UserError(f"{vocab} is smaller than the tokenizer's vocabulary ({tokenizer_vocab}){needs}",
                        key="model.vocab_size")
    return ModelShape(n_layers=cfg["n_layers"], d_model=cfg["d_model"], n_heads=cfg["n_heads"],
                      block_size=cfg["block_size"], vocab_size=vocab, dropout=cfg["dropout"],
                      bias=cfg["bias"], init_std=cfg["init_std"])


def special_ids(objective, tokenizer) -> dict[str, int]:
    """name → id of each of the objective's special tokens: the tokenizer's own when it has one, else
    the next id past its vocabulary (in the order the objective names them), so that the ids of a
    run are a function of its tokenizer and objective alone and a checkpoint reloads with them."""
    special, next_id = {}, tokenizer.vocab_size
    for name in getattr(objective, "special_tokens", ()):
        own = tokenizer.special_id(name) if hasattr(tokenizer, "special_id") else None
        if own is None:
            own, next_id = next_id, next_id + 1
        special[name] = own
    return special


def vocabulary(variant, objective, tokenizer) -> tuple[ModelShape, Vocabulary]:
    """The model shape, with room for the objective's special tokens, and the Vocabulary the
    objective is set up with."""
    special = special_ids(objective, tokenizer)
    reserved = sum(1 for i in special.values() if i >= tokenizer.vocab_size)
    shape = model_shape(variant, tokenizer.vocab_size, reserved)
    return shape, Vocabulary(size=shape.vocab_size, tokenizer_size=tokenizer.vocab_size, special=special,
                             eos_id=tokenizer.eos_id)


def build_model(variant, shape: ModelShape, plugins: dict) -> LanguageModel:
    """The variant's model; bidirectional when its objective is not causal, which needs an attention
    plugin that supports it (``Attention.bidirectional``)."""
    cfg = variant.manifest["model"]
    objective = plugins.get("objective")
    causal = getattr(objective, "causal", True)
    if not causal and not getattr(plugins["attention"], "bidirectional", False):
        raise UserError(f"attention plugin {plugins['attention'].name!r} is causal only, and objective "
                        f"{objective.name!r} needs bidirectional attention; use one that supports it "
                        "(mha, gqa, mqa)", key="attention.use")
    return LanguageModel(shape, position=plugins["position"], attention=plugins["attention"],
                         ffn=plugins["ffn"], norm=cfg["norm"], norm_eps=cfg["norm_eps"],
                         tie_embeddings=cfg["tie_embeddings"], causal=causal)


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
