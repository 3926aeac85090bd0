"""What the methods built on Hugging Face's peft library (Mangrulkar et al. 2022) share.

peft adapts any ``nn.Module``: a tuner (``LoraModel``, ``IA3Model``, ...) replaces each target layer
in place by a wrapper that keeps the original as ``base_layer`` and adds the adapter's weights, named
after the adapter (``...q_proj.lora_A.default.weight``), and freezes everything else. Here the targets
come from roles (``q``, ``v``, ``down``, ...), which every attention and ffn plugin maps to its own
submodules (``peft_roles``), turned into a regular expression over the model's full module names;
the tuner object stays with the plugin (for merging and AdaLoRA's budget), outside the model, so
parameter names are those of the model alone.
"""

import json
import logging
import re
from typing import Any, ClassVar, Literal

from torch import nn

from lmlab.api import Field, Peft, RunSettings, resolve_roles

#: peft's name for the one adapter: a component of every adapter entry's name.
ADAPTER = "default"

#: The ``targets`` option of every method, with its own default.
Targets = list[str] | Literal["all"]
TARGETS_HELP = ('roles of the layers to adapt: attention "q", "k", "v", "o" (mamba: "in", "x", "o"), ffn "up", '
                '"down", "gate" (swiglu); "all" for every role the model has')


def targets_field(default) -> Any:
    return Field(default, help=TARGETS_HELP)


def import_peft():
    """peft, imported when a method is applied (never by `lmlab check` or `lmlab plugins`)."""
    # bitsandbytes, which peft imports when it is installed, warns at import that an optional CPU kernel
    # package is missing; it then uses its own kernels, which is what runs here anyway.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import peft

    return peft


def pattern(names: list[str]) -> str:
    """A regular expression that peft matches (``re.fullmatch``) against exactly these module names."""
    return "|".join(re.escape(name) for name in names)


class LibraryMethod(Peft):
    """A peft tuner applied to the model, targeting layers by role."""

    api = ">=1.21,<2"  # adapter_export; apply receives RunSettings (1.20); check (1.6); Peft, resolve_roles (1.4)
    #: Data parallelism only: under fsdp, deepspeed, tensor or pipeline parallelism the wrapped layers
    #: would be sharded or split under names the layouts do not know.
    parallel = ("single", "ddp")
    #: the tuner class in peft (``"LoraModel"``)
    tuner_class: ClassVar[str] = ""

    def __init__(self, options=None):
        super().__init__(options)
        self.tuner = None

    def config(self, peft, targets: str, model: nn.Module, run: RunSettings):
        """The tuner's config for target modules matching ``targets`` (a regular expression)."""
        raise NotImplementedError

    def target_names(self, model: nn.Module) -> list[str]:
        return resolve_roles(model, self.options.targets, key="peft.targets")

    def check(self, context) -> None:
        """Before anything is built (API 1.6): every target role names layers of this model (its modules'
        ``peft_roles``, read on the meta-device model)."""
        if context.model is not None:
            self.target_names(context.model)

    def apply(self, model: nn.Module, run: RunSettings) -> None:
        peft = import_peft()
        config = self.config(peft, pattern(self.target_names(model)), model, run)
        self.tuner = getattr(peft, self.tuner_class)(model, config, ADAPTER)

    def is_adapter_key(self, key: str) -> bool:
        return ADAPTER in key.split(".")

    def merge(self, model: nn.Module) -> None:
        self.tuner.merge_and_unload()

    def adapter_export(self, model: nn.Module):
        config = self.tuner.peft_config[ADAPTER].to_dict()
        config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
        # peft saves an adapter's entries without the adapter's name (``lora_A.default.weight`` → ``lora_A.weight``).
        state = {".".join(p for p in key.split(".") if p != ADAPTER): value
                 for key, value in model.state_dict().items() if self.is_adapter_key(key)}
        return json.loads(json.dumps(config, default=str)), state
