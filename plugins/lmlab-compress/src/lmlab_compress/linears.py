"""What the quantisation methods share: which ``nn.Linear`` modules they take, how a module is swapped
for its quantised form, and the base class that records the swap and repeats it on a fresh model.

A method takes every plain ``nn.Linear`` of the model except those named in its ``skip`` option
(a name skips that module and everything under it). By default ``head`` is skipped: lmlab ties the
output head to the token embedding, and both stay float, as quantised language models usually keep
them. A module an earlier method of a chain already replaced (an AWQ layer, say) is no longer an
``nn.Linear`` and is left alone.
"""

from typing import ClassVar

import torch
from torch import nn

from lmlab.api import Compressor, Field, UserError


def skip_field():
    return Field(["head"], help="modules left in float, by name as model.named_modules() gives it (a name "
                                "covers everything under it); head: the output head tied to the embedding")


def is_skipped(name: str, skip) -> bool:
    return any(name == s or name.startswith(s + ".") for s in skip)


def targets(model: nn.Module, skip, key: str | None) -> dict[str, nn.Linear]:
    """The plain linear layers to quantise, by name, in model order. With ``key`` (the user set
    ``skip``), a name that names no module is refused: a typo would silently quantise everything; the
    default ``["head"]`` is simply ignored on a model without a head."""
    names = {name for name, _ in model.named_modules()}
    unknown = [s for s in skip if s not in names]
    if unknown and key is not None:
        raise UserError(f"names no module of this model: {', '.join(unknown)} (modules are named as "
                        "model.named_modules() gives them, e.g. blocks.0.attn.q_proj)", key=key)
    return {name: module for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not is_skipped(name, skip)}


def replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def linear_at(model: nn.Module, name: str) -> nn.Linear:
    """The fresh model's linear ``name`` that a record says was replaced."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        module = None
    if not isinstance(module, nn.Linear):
        raise ValueError(f"the compress record names {name!r}, which is not an nn.Linear of this model "
                         f"(found {type(module).__name__}): the checkpoint does not belong to this manifest")
    return module


def weight_bytes(modules) -> int:
    """Bytes of the state of ``modules`` as saved (each tensor counted once): the stored format, without
    what a layer rebuilds from it when loaded (an int4 kernel's copy of the weight)."""
    # by storage, not id(): state_dict() hands out fresh detached views of the same storage
    seen, total = set(), 0
    for module in modules:
        for t in module.state_dict().values():
            where = (t.untyped_storage().data_ptr(), t.storage_offset())
            if where not in seen:
                seen.add(where)
                total += t.numel() * t.element_size()
    return total


class LinearQuantizer(Compressor):
    """A method that swaps linear layers for quantised modules of its own type.

    Subclasses implement :meth:`check_layer` (refuse a layer the options cannot take), :meth:`quantize`
    (a float linear → its quantised module, given what :meth:`prepare` measured) and :meth:`empty`
    (the same module with placeholder values, for :meth:`restructure`). The record is
    ``{"modules": [names], **self.record_extra(state), "summary": {...}}`` (a ``summary`` that
    :meth:`record_extra` returns joins the common one).
    """

    api = ">=1.9,<2"  # Compressor
    method_name: ClassVar[str] = ""

    @property
    def key_prefix(self) -> str:
        return f"compress.{self.name or self.method_name}"

    def check_layer(self, name: str, linear: nn.Linear) -> None:
        """Raise UserError naming the option when this layer cannot take it. Default: nothing."""

    def prepare(self, model: nn.Module, layers: dict[str, nn.Linear], calibration) -> dict:
        """Measure what :meth:`quantize` needs (activations, for AWQ); returns per-layer state."""
        return {}

    def quantize(self, name: str, linear: nn.Linear, state) -> nn.Module:
        raise NotImplementedError

    def empty(self, linear: nn.Linear, record: dict) -> nn.Module:
        raise NotImplementedError

    def record_extra(self, state: dict) -> dict:
        return {}

    def layers(self, model: nn.Module) -> dict[str, nn.Linear]:
        """The linear layers this method takes, each checked (:meth:`check_layer`)."""
        skip_key = f"{self.key_prefix}.skip" if "skip" in self.options.model_fields_set else None
        layers = targets(model, self.options.skip, skip_key)
        for name, linear in layers.items():
            self.check_layer(name, linear)
        return layers

    def check_model(self, model: nn.Module) -> None:
        self.layers(model)

    @torch.no_grad()
    def compress(self, model: nn.Module, calibration) -> dict:
        layers = self.layers(model)
        state = self.prepare(model, layers, calibration)
        before = weight_bytes(layers.values())
        replaced = {}
        for name, linear in layers.items():
            replaced[name] = self.quantize(name, linear, state.get(name))
            replace(model, name, replaced[name])
        after = weight_bytes(replaced.values())
        weights = sum(m.in_features * m.out_features for m in replaced.values())
        summary = {"quantized_linears": len(replaced),
                   "bits_per_weight": 8 * after / weights if weights else 0.0,
                   "linear_bytes_ratio": after / before if before else 1.0}
        extra = self.record_extra(state)
        summary.update(extra.pop("summary", {}))
        return {"modules": list(replaced), **extra, "summary": summary}

    def restructure(self, model: nn.Module, record: dict) -> None:
        for name in record["modules"]:
            replace(model, name, self.empty(linear_at(model, name), record))
