"""What a plugin sees when it checks itself against the rest of a variant, before anything is built."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmlab.api.shape import ModelShape


@dataclass
class CheckContext:
    """The variant a plugin is part of, for :meth:`lmlab.api.Plugin.check` (API 1.6).

    ``shape`` is the model's shape; its ``vocab_size`` is a stand-in when ``vocabulary_known`` is False
    (a tokenizer that learns its vocabulary from the data, before the data is read). ``plugins`` maps
    each slot to the variant's plugin instance (a list for many-valued slots), ``manifest`` is the
    resolved manifest (every default filled in). ``model`` is the variant's model built on the meta
    device (every module and parameter shape, no memory), or None when some module cannot be built
    there. ``machine`` says whether to check against this machine's devices: ``lmlab check`` and
    ``lmlab run`` do, ``lmlab plan`` (which plans for other machines) does not.
    """

    shape: ModelShape
    plugins: Mapping[str, Any]
    manifest: Mapping[str, Any]
    model: Any = None
    vocabulary_known: bool = True
    machine: bool = True
