"""The core's own manifest tables: ``[model]`` (the shared shape), ``[train]`` (the loop) and ``[init]``
(the weights a fine-tune starts from)."""

from lmlab.api import Options
from lmlab.api.run import CHECKPOINTING, InitOptions, ModelOptions, ResolvedOptions, TrainOptions
from lmlab.tables import CORE_TABLE_NAMES

__all__ = ["CHECKPOINTING", "CORE_TABLES", "InitOptions", "ModelOptions", "OPTIONAL_TABLES", "ResolvedOptions",
           "TrainOptions"]

CORE_TABLES: dict[str, type[Options]] = dict(zip(CORE_TABLE_NAMES, (ModelOptions, TrainOptions, InitOptions,
                                                                    ResolvedOptions), strict=True))
#: Core tables resolved only when a manifest has them (the others are filled with their defaults);
#: [resolved] is derived, and only checked when given.
OPTIONAL_TABLES = frozenset({"init", "resolved"})
