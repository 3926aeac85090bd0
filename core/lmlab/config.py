"""The core's own manifest tables: ``[model]`` (the shared shape), ``[train]`` (the loop), ``[init]``
(the weights a fine-tune starts from) and ``[eval]`` (the tasks scored at the end)."""

from lmlab.api import Options
from lmlab.api.run import CHECKPOINTING, EvalOptions, InitOptions, ModelOptions, ResolvedOptions, TrainOptions
from lmlab.tables import CORE_TABLE_NAMES

__all__ = ["CHECKPOINTING", "CORE_TABLES", "EvalOptions", "InitOptions", "ModelOptions", "OPTIONAL_TABLES",
           "ResolvedOptions", "TrainOptions"]

CORE_TABLES: dict[str, type[Options]] = dict(zip(CORE_TABLE_NAMES, (ModelOptions, TrainOptions, InitOptions,
                                                                    ResolvedOptions, EvalOptions), strict=True))
#: Core tables resolved only when a manifest has them (the others are filled with their defaults);
#: [resolved] is derived, and only checked when given.
OPTIONAL_TABLES = frozenset({"init", "resolved", "eval"})
