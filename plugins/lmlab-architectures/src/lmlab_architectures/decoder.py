"""``[architecture] use = "decoder"``: the decoder-only transformer (GPT), or the encoder-only one
(BERT) under a bidirectional objective, with an optional layer pattern of mixers (a hybrid).

A layer pattern names, layer by layer, which mixer each block gets: ``layers = "MMMA"`` with
``[architecture.mixers.M] use = "mamba"`` and ``[architecture.mixers.A] use = "gqa"`` gives a
Jamba-style stack, three Mamba layers to each attention layer, repeated to ``model.n_layers``.
Without a pattern every layer's mixer is the ``[attention]`` slot's (today's model, unchanged).

Early exit is its option (``exit_layers``, ``exit_threshold``; :mod:`lmlab_architectures.early_exit`).
It reads Hugging Face checkpoints of the Llama family (Llama, Mistral, Qwen2, Qwen3:
:mod:`lmlab_architectures.hf_llama`) and GPT-2 (:mod:`lmlab_architectures.hf_gpt2`) for ``[init] from``.
"""

from typing import Any

from lmlab.api import Architecture, CheckContext, Field, ModelParts, Options, UserError
from lmlab.api.architecture import Block, Stack
from lmlab_architectures import early_exit, hf_gpt2, hf_llama
from lmlab_architectures.hf_files import ReadsHF


class PatternOptions(Options):
    layers: str | list[str] = Field(
        "", help="a layer pattern: one label of architecture.mixers per layer (a string of one-letter labels, "
                 "\"MMMA\", or a list of labels), repeated to model.n_layers; empty: every layer's mixer is "
                 "[attention]'s")
    mixers: dict[str, dict[str, Any]] = Field(
        {}, help="label → an attention-slot plugin's table for the layer pattern: use = \"<plugin>\" and its options, "
                 "[architecture.mixers.<label>]")


class DecoderOptions(early_exit.ExitOptions, PatternOptions):
    """The layer pattern, then early exit's options."""


class Decoder(ReadsHF, Architecture):
    """Decoder-only transformer (GPT; encoder-only under a bidirectional objective): pre-norm blocks, x +
    mixer(norm x), then x + ffn(norm x); a layer pattern of mixers makes hybrids."""

    api = ">=1.20,<2"  # hf_export; Stack.extra_heads, add_modules, init_missing; Plugin.free_options (1.19)
    Options = DecoderOptions
    free_options = early_exit.FREE_OPTIONS
    families = ("decoder", "encoder")
    components = {"mixers": "attention"}
    #: The block class every layer gets (a subclass of the API's Block wires it another way).
    block: type = Block
    hf_model_types = {**hf_llama.MODEL_TYPES, hf_gpt2.MODEL_TYPE: "GPT-2"}
    hf_readers = {**dict.fromkeys(hf_llama.MODEL_TYPES, hf_llama), hf_gpt2.MODEL_TYPE: hf_gpt2}

    @classmethod
    def hf_export(cls, tables: dict, state: dict) -> tuple[dict, dict]:
        own = tables["architecture"]
        if own.get("layers"):
            raise ValueError("architecture.layers: a layer pattern of mixers has no Hugging Face family")
        if own.get("exit_layers"):
            raise ValueError("architecture.exit_layers: exit heads have no place in a Hugging Face checkpoint")
        return super().hf_export(tables, state)

    def check(self, context: CheckContext) -> None:
        pattern(self.options, context.shape.n_layers)
        early_exit.check(self.options, context)

    def build(self, parts: ModelParts) -> Stack:
        labels = pattern(self.options, parts.shape.n_layers)
        attention = [parts.components["mixers"][label] for label in labels] if labels else parts.attention
        wiring = dict(position=parts.position, attention=attention, ffn=parts.ffn, norm=parts.norm,
                      norm_eps=parts.norm_eps, tie_embeddings=parts.tie_embeddings, causal=parts.family == "decoder",
                      heads=parts.heads, block=self.block)
        o = self.options
        early_exit.check_layers(o, parts.shape.n_layers)  # here too: lmlab generate builds without lmlab check
        if not o.exit_layers:  # today's model: no exit module, state dict or forward step of its own
            return Stack(parts.shape, **wiring)
        return early_exit.ExitStack(parts.shape, exit_layers=o.exit_layers, exit_loss_weight=o.exit_loss_weight,
                                    train_only_exits=o.train_only_exits, exit_threshold=o.exit_threshold, **wiring)


def pattern(options: DecoderOptions, n_layers: int) -> list[str]:
    """The label of each of ``n_layers`` layers ([] without a pattern); a UserError naming
    ``architecture.layers`` or ``architecture.mixers`` when the pattern cannot be laid out."""
    labels = list(options.layers)
    if not labels:
        if options.mixers:
            raise UserError(f"names mixers {sorted(options.mixers)} but architecture.layers gives no layer pattern "
                            "that uses them", key="architecture.mixers")
        return []
    unknown = sorted({label for label in labels if label not in options.mixers})
    if unknown:
        raise UserError(f"label {unknown[0]!r} has no [architecture.mixers.{unknown[0]}] table (labels: "
                        f"{sorted(options.mixers) or 'none'})", key="architecture.layers")
    unused = sorted(set(options.mixers) - set(labels))
    if unused:
        raise UserError(f"is not in the layer pattern {options.layers!r}", key=f"architecture.mixers.{unused[0]}")
    if n_layers % len(labels):
        raise UserError(f"a pattern of {len(labels)} layers does not divide model.n_layers = {n_layers}; repeat it a "
                        "whole number of times", key="architecture.layers")
    return labels * (n_layers // len(labels))
