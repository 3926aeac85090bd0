"""One resolved run of a manifest, frozen and typed: what resolution (:mod:`lmlab.manifest`) returns
and what everything else reads.

Every default is filled in: the core's tables are their Options classes (``train.min_lr``,
``decay_steps`` and ``eval_batch_size`` resolved to the values a run uses), each slot holds the
plugin class chosen for it with its validated options, and a fine-tune's ``[init]`` is located once.
Plugins receive it as what it implements, :class:`lmlab.api.run.RunSettings`; ``manifest`` is the
same as the nested dict that ``manifest.toml`` records.
"""

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any

from lmlab.api import Options, Plugin
from lmlab.api.run import EvalOptions, InitOptions, ModelOptions, ResolvedOptions, RunSettings, TrainOptions
from lmlab.slots import MANY_SLOTS, SLOTS

_SEED_PART = re.compile(r"(^|,)seed=-?\d+")


def seedless(variant_name: str) -> str:
    """``attention.use=gqa,seed=2`` → ``attention.use=gqa``: the name its seeds share."""
    return _SEED_PART.sub("", variant_name).strip(",") or "default"


@dataclass(frozen=True)
class InitSource:
    """Where a fine-tune's ``init.from`` was found (:func:`lmlab.pretrained.locate`)."""

    path: Path  # what init.from names
    kind: str  # lmlab.pretrained.RUN, or HUGGING_FACE with the family's name
    folder: Path  # the run folder or the Hugging Face folder
    weights: tuple[Path, ...]  # the checkpoint file, or the safetensors files
    tokenizer_dir: Path  # what the tokenizer plugin's load() reads
    reader: str | None = None  # the architecture plugin that reads a Hugging Face folder


@dataclass(frozen=True)
class Choice:
    """The plugin chosen for a slot, with its validated options."""

    plugin: type[Plugin]  # a subclass of the slot's lmlab.api base class, ``name`` set by discovery
    options: Options  # an instance of ``plugin.Options`` (frozen)
    # The plugins the options' nested tables name (``Architecture.components``): field → label → choice.
    components: Mapping[str, Mapping[str, "Choice"]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.plugin.name

    def build(self):
        """A new instance of the plugin with these options (and of the plugins it is composed of,
        which :func:`components_of` gives back)."""
        built = self.plugin(self.options)
        if self.components:
            built._lmlab_components = {f: {label: c.build() for label, c in chosen.items()}
                                       for f, chosen in self.components.items()}
        return built

    def table(self) -> dict:
        """The options as the manifest records them (JSON values, every default filled)."""
        return self.options.model_dump(mode="json")


@dataclass(frozen=True)
class Variant(RunSettings):
    """One run of a manifest."""

    name: str  # the variant's readable name: attention.use=gqa,seed=1 ("default" without a sweep)
    experiment: str  # the manifest's name: runs go to runs/<experiment>/<name>/
    seed: int
    description: str
    model: ModelOptions
    train: TrainOptions
    slots: Mapping[str, Choice | tuple[Choice, ...]]  # slot → its choice (many-valued slots: a tuple)
    resolved: ResolvedOptions | None = None  # what grad_clip = "auto" and lr_scaling give
    base_dir: Path = Path(".")  # the manifest's folder: relative paths resolved against it
    init: InitOptions | None = None  # a fine-tune's [init], or None
    init_source: InitSource | None = None  # where init.from was found (located once)
    eval: EvalOptions | None = None  # [eval]: the tasks scored at the end, or None
    sweep: Mapping[str, Any] = field(default_factory=dict)  # this point's [sweep] settings
    notes: tuple[str, ...] = ()  # what resolution changed that the user should know
    peer_keys: tuple[str, ...] = ()  # dotted keys of every variant of the same manifest (for trackers)

    def __post_init__(self):
        object.__setattr__(self, "slots", MappingProxyType(dict(self.slots)))
        object.__setattr__(self, "sweep", MappingProxyType(dict(self.sweep)))

    @property
    def group(self) -> str:
        """The variant's name without its seed: what its seeds have in common."""
        return seedless(self.name)

    @cached_property
    def manifest(self) -> dict[str, Any]:
        """The fully resolved manifest as nested JSON values, in the order manifest.toml records it.
        A copy each time it is asked for is not needed: treat it as read-only."""
        out: dict[str, Any] = {"name": self.experiment, "seed": self.seed, "description": self.description,
                               "model": self.model.model_dump(mode="json"), "train": self.train.model_dump(mode="json")}
        if self.init is not None:
            out["init"] = self.init.model_dump(mode="json")
        for slot in SLOTS:
            chosen = self.slots.get(slot)
            if chosen is None:
                continue
            if isinstance(chosen, tuple):
                out[slot] = {"use": [c.name for c in chosen], **{c.name: c.table() for c in chosen}}
            else:
                out[slot] = {"use": chosen.name, **chosen.table()}
        if self.resolved is not None:
            out["resolved"] = self.resolved.model_dump(mode="json", exclude_none=True)
        if self.eval is not None:
            out["eval"] = self.eval.model_dump(mode="json", exclude_none=True)
        return out

    @cached_property
    def plugins(self) -> dict[str, Any]:
        """slot → plugin class (many-valued slots: a list of classes)."""
        return {slot: [c.plugin for c in chosen] if isinstance(chosen, tuple) else chosen.plugin
                for slot, chosen in self.slots.items()}

    @property
    def grad_clip(self) -> float:
        """The gradient-norm clip trained with (``train.grad_clip = "auto"`` resolved; 0: off)."""
        return self.resolved.grad_clip if self.resolved is not None else float(self.train.grad_clip)

    @property
    def lr_factor(self) -> float:
        """What ``train.lr_scaling`` multiplies the optimizer's learning rates by."""
        return self.resolved.lr_factor if self.resolved is not None else 1.0

    def uses(self, slot: str) -> str | tuple[str, ...] | None:
        chosen = self.slots.get(slot)
        if chosen is None:
            return None
        return tuple(c.name for c in chosen) if isinstance(chosen, tuple) else chosen.name

    def options(self, slot: str, plugin: str | None = None) -> Options:
        chosen = self.slots[slot]
        if isinstance(chosen, tuple):
            return next(c for c in chosen if c.name == plugin).options
        return chosen.options

    def instantiate(self, slot: str):
        """A new plugin instance for a single-valued slot, or a list of them for a many-valued one."""
        chosen = self.slots.get(slot, ())
        return [c.build() for c in chosen] if isinstance(chosen, tuple) else chosen.build()

    def tracker_config(self, resolved: dict) -> dict:
        """The flat config a tracker groups by: every key of ``resolved`` (the manifest as the run
        records it), plus ``None`` for each key that another variant of the same sweep has and this one
        lacks (W&B cannot group runs of methods whose options differ unless each run carries every key —
        wandb issue 9046), plus ``variant`` (the name without its seed, so seeds of one variant group
        together)."""
        flat = {key: None for key in self.peer_keys}
        flat.update(flatten(resolved))
        flat["variant"] = self.group
        return flat

    def with_plugin(self, slot: str, plugin: type, options=None) -> "Variant":
        """The same variant with ``plugin`` (its ``options``, by default all defaults) as the slot's one
        choice: a test's or a notebook's stand-in for a plugin no manifest can name."""
        chosen = Choice(plugin, options if options is not None else plugin.Options())
        slots = {**self.slots, slot: (chosen,) if slot in MANY_SLOTS else chosen}
        return dataclasses.replace(self, slots=slots)

    def __getstate__(self):  # cached properties are derived: not part of what is pickled
        state = dict(self.__dict__)
        for derived in ("manifest", "plugins"):
            state.pop(derived, None)
        state["slots"], state["sweep"] = dict(self.slots), dict(self.sweep)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        object.__setattr__(self, "slots", MappingProxyType(state["slots"]))
        object.__setattr__(self, "sweep", MappingProxyType(state["sweep"]))


def components_of(plugin) -> dict[str, dict[str, Any]]:
    """field → label → the built plugins ``plugin``'s nested tables name (empty for most plugins)."""
    return getattr(plugin, "_lmlab_components", {})


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
