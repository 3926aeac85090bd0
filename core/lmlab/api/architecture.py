"""The architecture slot: how the other slots' modules are wired into a network (API 1.18).

An architecture plugin receives the variant's parts (the shape, the position, attention and ffn
plugins, the ``[model]`` settings every architecture shares, and the plugins its own option tables
name) and returns the model. It is asked once, when the model is built; the forward pass only calls
modules. The core offers the pieces today's models are made of, so a new wiring is a block class and
a few lines:

- ``Stack``: token embedding → position → blocks → final norm → head,
  with everything the rest of lmlab relies on (a decoding cache, pipeline stages, extra heads, the
  objective's heads, activation checkpointing, auxiliary losses). ``block=`` takes any block class.
- ``Block``: the pre-norm residual block; subclass it and override
  ``forward`` (and ``mix`` / ``feed_forward``) for another wiring.
- ``build_norm``: the ``[model] norm`` the variant asked for.
- ``CHECKPOINTING`` (the activation-checkpointing policies), ``param_infos(model)`` and
  ``num_params(model)`` (what a model's ``param_infos``/``num_params`` return: weight decay for
  matrices that are not embeddings), for a model class of the author's own.

The block contract (what lmlab reads of a block, so tensor parallelism, FSDP, PEFT roles, head
pruning and decoding caches work on every wiring): its mixer is ``block.attn`` (an
[AttentionModule][lmlab.api.attention.AttentionModule]) and its ffn ``block.ffn`` (an
[FFNModule][lmlab.api.ffn.FFNModule]); ``block.checkpointing`` is one of ``"none"``, ``"full"``,
``"attention"``, ``"ffn"`` and the block's ``forward`` honours it; ``reset_parameters(shape)``
initialises the block. Auxiliary losses are collected from every module of the model that sets a
tensor ``aux_loss`` in its forward, wherever it sits.

A technique that adds to the model subclasses ``Stack`` (API 1.19; early exit in ``lmlab-architectures``
is the worked example): ``add_modules`` adds its modules before the weights are initialised;
``extra_heads`` names prediction heads and ``extra_logits(layer, x)`` gives their logits after block
``layer``, which the core scores with the objective beside the output head (``extra_loss_weight``
times their mean joins the loss; each one's validation loss goes in ``summary.json`` under
``val_<extra_losses_name>``); ``init_missing`` starts weights an ``[init]`` lacks; ``make_engine``
supplies its own decoding engine (or None for the core's). The architecture lists in
``free_options`` (``Plugin.free_options``) the options a run may set otherwise than its ``[init]``.

Composition: an option field named in ``Architecture.components`` holds tables of other plugins
(``[architecture.mixers.M] use = "mamba"``, its options beside ``use``). The core validates each
table with that plugin's own Options (a wrong type names the dotted key), lists them in
``lmlab schema``, records each plugin's distribution in ``provenance.json``, runs its ``check`` and
hands the built instances to ``build`` in ``ModelParts.components``.

Checkpoint readers: an architecture that builds the model of a published family converts that
family's checkpoints. ``[init] from = "<Hugging Face folder>"`` is read by the installed architecture
whose ``hf_model_types`` lists the folder's config.json ``model_type`` (``hf_tables``,
``hf_weight_files``, ``hf_state``); the core names no family.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from lmlab.api.errors import UserError
from lmlab.api.plugin import Plugin
from lmlab.api.shape import ModelShape

if TYPE_CHECKING:
    import torch

FAMILIES = ("decoder", "encoder", "encoder-decoder")
"""Model families: decoder-only (GPT), encoder-only (BERT, bidirectional), encoder–decoder (T5)."""
DECODER, ENCODER, ENCODER_DECODER = FAMILIES


#: What ``lmlab export --format`` writes: ``hf`` (API 1.20), a Hugging Face folder, through
#: :meth:`Architecture.hf_export` and ``Tokenizer.save_hf``; ``peft`` (1.21), a PEFT run's adapter as
#: Hugging Face's peft library saves it, through ``Peft.adapter_export``; ``gguf`` (1.21), one file
#: for llama.cpp, written from the Hugging Face form.
EXPORT_FORMATS = ("hf", "peft", "gguf")


#: Early exit's keys, which moved from the core's tables to the architecture's options (API 1.19):
#: (table, key) → the architecture option it became. ``train.train_only = "exit_heads"`` became
#: ``train_only_exits = true``.
MOVED_EARLY_EXIT = {("model", "exit_layers"): "exit_layers", ("train", "exit_loss_weight"): "exit_loss_weight",
                    ("train", "train_only"): "train_only_exits", ("decoding", "exit_threshold"): "exit_threshold"}


def refuse_moved_early_exit(table: str, values) -> None:
    """One line naming where an early-exit key of ``table`` went, if ``values`` gives one."""
    from lmlab.api.options import refuse_moved

    refuse_moved(table, values, "the architecture's options (early exit)", {
        key: f"architecture.{option} = " + ("true" if option == "train_only_exits" else "{value}")
        for (where, key), option in MOVED_EARLY_EXIT.items() if where == table})


@dataclass(frozen=True)
class ModelParts:
    """What an architecture builds a model from (API 1.18)."""

    shape: ModelShape
    """The model's shape (``shape.causal`` False for an encoder family)."""
    family: str
    """The family the variant trains, one of [FAMILIES][lmlab.api.architecture.FAMILIES]: the
    architecture's, as the objective asks for it."""
    position: Any
    """The position plugin (``position.build(shape)`` makes its module)."""
    attention: Any
    """The attention plugin (``attention.build(shape, layer)`` makes one mixer)."""
    ffn: Any
    """The ffn plugin (``ffn.build(shape, layer)``)."""
    norm: str = "layernorm"
    """``model.norm``, for ``build_norm``."""
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    heads: Mapping[str, Any] | None = None
    """The objective's own modules ([Objective.heads][lmlab.api.objective.Objective.heads]), for the
    model's ``heads``."""
    decoder_start_id: int | None = None
    """The id an encoder–decoder's decoder starts from (None for the other families)."""
    components: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Option field → label → the plugin instance its nested table names (see ``components``)."""


class Architecture(Plugin):
    """Base class of the architecture slot (entry-point group ``lmlab.architecture``, API 1.18):
    builds the model from the other slots' plugins. ``[architecture] use = "decoder"`` by default."""

    slot = "architecture"

    families: ClassVar[tuple[str, ...]] = ("decoder", "encoder")
    """The families this architecture builds, of [FAMILIES][lmlab.api.architecture.FAMILIES]. The
    variant's family is the first the objective trains (``Objective.trains``) that is listed here."""
    components: ClassVar[Mapping[str, str]] = {}
    """Option field → slot: the field holds a table of plugin tables of that slot, keyed by a label
    (``{"mixers": "attention"}``: ``[architecture.mixers.M] use = "mamba"``). Declare the field as
    ``dict[str, dict[str, Any]]``; the core validates the nested tables."""

    hf_model_types: ClassVar[Mapping[str, str]] = {}
    """The Hugging Face checkpoints this architecture reads: config.json's ``model_type`` → the
    family's name, as messages and the init's record (``"Hugging Face <name>"``) write it
    (``{"llama": "Llama"}``). Empty: none; the ``hf_*`` methods are then never called."""

    @classmethod
    def hf_tables(cls, folder: Path) -> dict[str, dict]:
        """The manifest tables of the Hugging Face folder ``folder`` (its config.json has one of
        ``hf_model_types``): ``model``, ``architecture``, ``position``, ``attention``, ``ffn`` and
        ``tokenizer``, each as a manifest writes it (``use`` and the plugin's options; ``model``: the
        ``[model]`` keys). The model these tables build must hold exactly the weights of ``hf_state``.
        Read config files only, never weights: ``lmlab check`` calls it. Raise ValueError (or
        KeyError, TypeError) for a checkpoint lmlab cannot express; the core reports it naming
        ``init.from``."""
        raise NotImplementedError

    @classmethod
    def hf_weight_files(cls, folder: Path) -> list[Path]:
        """The files the folder's weights are in, in the order they are read (``model.safetensors``,
        or the shards its index names), whether or not they exist: the core refuses a folder that
        lacks one, naming it, and records each file's SHA-256 as the init's."""
        raise NotImplementedError

    @classmethod
    def hf_state(cls, folder: Path) -> dict[str, "torch.Tensor"]:
        """The folder's weights in lmlab's names: a state dict of the model ``hf_tables(folder)``
        builds (each tensor on the CPU, shaped as that model's parameter), converted so that the
        model computes what the checkpoint's does. Raise ImportError when a package it reads with
        (safetensors) is missing."""
        raise NotImplementedError

    @classmethod
    def hf_export(cls, tables: dict[str, dict], state: dict[str, "torch.Tensor"]) -> tuple[dict, dict]:
        """The Hugging Face checkpoint of a model this architecture built (API 1.20, ``lmlab export
        --format hf``): config.json's values (``model_type`` and ``architectures`` included) and the
        state dict in the family's names, such that transformers computes what the model computes.
        ``tables``: the run's ``model`` (its ``vocab_size`` the model's), ``architecture``,
        ``position``, ``attention`` and ``ffn`` tables as recorded; ``state``: the model's weights.
        Raise ValueError naming the table key no family this architecture writes can express
        (``attention.use: 'mamba'``). Default: NotImplementedError, no export."""
        raise NotImplementedError

    def family(self, trains: tuple[str, ...], objective: str) -> str:
        """The family of the model for an objective that trains ``trains`` (its default first);
        a UserError naming ``architecture.use`` when this architecture builds none of them."""
        for wanted in trains:
            if wanted in self.families:
                return wanted
        raise UserError(f"objective {objective!r} trains {' or '.join(trains)} models; architecture {self.name!r} "
                        f"builds {' or '.join(self.families)} models (see `lmlab plugins architecture`)",
                        key="architecture.use")

    def decoder_start_id(self, eos_id: int | None) -> int | None:
        """The id an encoder–decoder's decoder input starts with, given the tokenizer's end-of-document
        id (None when unknown); None for an architecture without a decoder fed that way."""
        return None

    def build(self, parts: ModelParts):
        """The model (an ``nn.Module`` with the [LanguageModel][lmlab.api.model.LanguageModel]
        interface; a ``Stack`` has it), with fresh weights on the current
        default device. Called once per model built (a run, each check on the meta device, each
        planner measurement): build nothing else and read no data."""
        raise NotImplementedError


_BUILDING = {"Stack": ("lmlab.model", "LanguageModel"), "Block": ("lmlab.block", "Block"),
             "build_norm": ("lmlab.norms", "build_norm"), "CHECKPOINTING": ("lmlab.api.run", "CHECKPOINTING"),
             "num_params": ("lmlab.block", "num_params"), "param_infos": ("lmlab.block", "param_infos")}


def __getattr__(name: str):
    # The building blocks are the core's own classes, imported on first use: importing the slot's
    # base class (``lmlab check``, discovery) does not import the model code.
    if name in _BUILDING:
        import importlib

        module, attr = _BUILDING[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'lmlab.api.architecture' has no attribute {name!r}")
