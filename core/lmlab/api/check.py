"""What a plugin sees when it checks itself against the rest of a variant, before anything is built."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmlab.api.run import RunSettings
from lmlab.api.shape import ModelShape


@dataclass
class CheckContext:
    """The variant a plugin is part of, for [Plugin.check][lmlab.api.plugin.Plugin.check] (API 1.6).

    Built by ``lmlab check`` and ``lmlab run`` (before it prepares the data) once per variant,
    after every plugin is instantiated and the objective is set up, and handed to every plugin's
    ``check`` in turn.
    """

    shape: ModelShape
    """The model's shape; its ``vocab_size`` is a stand-in when ``vocabulary_known`` is False."""
    plugins: Mapping[str, Any]
    """Slot → the variant's plugin instance (a list for many-valued slots)."""
    manifest: Mapping[str, Any]
    """The resolved manifest as nested JSON values (``manifest["train"]["precision"]``): kept for
    plugins written before API 1.20, until 2.0; read ``run`` instead."""
    model: Any = None
    """The variant's model built on the meta device (every module and parameter shape, no memory),
    or None when some module cannot be built there."""
    vocabulary_known: bool = True
    """False when the tokenizer learns its vocabulary from the data, which is not read before the
    checks: the shape's ``vocab_size`` is then a stand-in."""
    machine: bool = True
    """Whether to check against this machine's devices: True from ``lmlab check`` and ``lmlab run``;
    False when the variant is checked for other machines (a plan), where device counts and
    accelerators must not be judged by this one's."""
    run: RunSettings | None = None
    """The variant, typed (API 1.20): ``run.train.precision``, ``run.uses("parallel")``. Always set by
    the core and by ``lmlab.testing``; None only in a context a plugin's own test builds without it."""
