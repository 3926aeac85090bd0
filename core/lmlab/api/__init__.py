"""lmlab.api: the only module plugins import from the core.

One base class per slot, typed options, the shapes and caches architecture plugins share, and the
lifecycle hookspecs. Versioned by ``API_VERSION``; see [lmlab.api.version][lmlab.api.version] for the
policy. Each slot's base class says what the core calls, when, with what shapes and dtypes and in
which mode; ``SLOT_BASES`` maps each slot's name to that class (``SLOT_BASES["attention"]`` is
[Attention][lmlab.api.attention.Attention]; the ``monitor`` slot takes any
[Plugin][lmlab.api.plugin.Plugin], acting through hooks; [Monitor][lmlab.api.monitor.Monitor] is the
monitor slot's convenience base).

How to write, test and publish a plugin: the manual's page "Writing and publishing a plugin"
(``docs/guide/plugins.md``).
The reference of every name here is rendered from these docstrings by
``.venv/bin/python -m mkdocs build --strict`` (``mkdocs.yml`` at the repository root, pages in
``docs/``).

Names are imported from their submodules on first use (PEP 562), so a plugin that needs only what
does not touch torch (a data source, a filter, a tokenizer) loads without it: ``lmlab prepare``'s
worker processes start in a fraction of a second instead of the two that importing torch takes.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from lmlab.api.architecture import Architecture, ModelParts
    from lmlab.api.attention import Attention, AttentionModule, CrossAttentionModule, MixerContext
    from lmlab.api.batch import IGNORE_INDEX, Batch, Seq2SeqBatch, Windows
    from lmlab.api.check import CheckContext
    from lmlab.api.compress import Calibration, Compressor
    from lmlab.api.cache import InferenceCache, KVCache, LayerState
    from lmlab.api.data import (ChatTemplate, Conversation, DataOptions, DataSource, Document, Message, Record,
                                Segment, document_text)
    from lmlab.api.decoding import Decoder, DecodingOptions, Engine, Outputs, Stepper, TokenDecoder, TokenRows
    from lmlab.api.errors import UserError
    from lmlab.api.executor import Executor, JobOutcome, VariantJob, run_job, usable_cores
    from lmlab.api.ffn import FFN, FFNModule
    from lmlab.api.filter import Filter
    from lmlab.api.hooks import LifecycleSpec, hookimpl, hookspec
    from lmlab.api.layout import Collective, MemoryLayout
    from lmlab.api.model import LanguageModel
    from lmlab.api.monitor import FAILURE_KINDS, Diagnosis, Fix, Monitor, RunControl, RunFailed, StepTiming
    from lmlab.api.objective import Objective, TokenSplit, Vocabulary
    from lmlab.api.optimizer import Optimizer, OptimizerOptions, ParamInfo
    from lmlab.api.options import Field, Options
    from lmlab.api.order import Order, OrderOptions, TrainingDocuments
    from lmlab.api.parallel import LaunchOptions, Parallel, loss_scaling, resolve_devices
    from lmlab.api.peft import Peft, module_roles, resolve_roles
    from lmlab.api.plugin import Plugin
    from lmlab.api.position import Position, PositionModule
    from lmlab.api.run import InitOptions, ModelOptions, ResolvedOptions, RunSettings, TrainOptions
    from lmlab.api.runs import ObjectiveContext, TrainedRun
    from lmlab.api.shape import ModelShape
    from lmlab.api.table import Table
    from lmlab.api.tokenizer import Tokenizer
    from lmlab.api.tracker import RunInfo, Tracker
    from lmlab.api.version import API_VERSION

#: public name → the submodule that defines it
_EXPORTS = {
    "Architecture": "lmlab.api.architecture",
    "ModelParts": "lmlab.api.architecture",
    "Attention": "lmlab.api.attention",
    "AttentionModule": "lmlab.api.attention",
    "CrossAttentionModule": "lmlab.api.attention",
    "MixerContext": "lmlab.api.attention",
    "IGNORE_INDEX": "lmlab.api.batch",
    "Batch": "lmlab.api.batch",
    "Seq2SeqBatch": "lmlab.api.batch",
    "Windows": "lmlab.api.batch",
    "CheckContext": "lmlab.api.check",
    "Calibration": "lmlab.api.compress",
    "Compressor": "lmlab.api.compress",
    "InferenceCache": "lmlab.api.cache",
    "KVCache": "lmlab.api.cache",
    "LayerState": "lmlab.api.cache",
    "ChatTemplate": "lmlab.api.data",
    "Conversation": "lmlab.api.data",
    "Message": "lmlab.api.data",
    "DataOptions": "lmlab.api.data",
    "DataSource": "lmlab.api.data",
    "Document": "lmlab.api.data",
    "Record": "lmlab.api.data",
    "Segment": "lmlab.api.data",
    "document_text": "lmlab.api.data",
    "Decoder": "lmlab.api.decoding",
    "DecodingOptions": "lmlab.api.decoding",
    "Engine": "lmlab.api.decoding",
    "Outputs": "lmlab.api.decoding",
    "Stepper": "lmlab.api.decoding",
    "TokenDecoder": "lmlab.api.decoding",
    "TokenRows": "lmlab.api.decoding",
    "UserError": "lmlab.api.errors",
    "Executor": "lmlab.api.executor",
    "JobOutcome": "lmlab.api.executor",
    "VariantJob": "lmlab.api.executor",
    "run_job": "lmlab.api.executor",
    "usable_cores": "lmlab.api.executor",
    "FFN": "lmlab.api.ffn",
    "FFNModule": "lmlab.api.ffn",
    "Filter": "lmlab.api.filter",
    "LifecycleSpec": "lmlab.api.hooks",
    "hookimpl": "lmlab.api.hooks",
    "hookspec": "lmlab.api.hooks",
    "Collective": "lmlab.api.layout",
    "MemoryLayout": "lmlab.api.layout",
    "LanguageModel": "lmlab.api.model",
    "FAILURE_KINDS": "lmlab.api.monitor",
    "Diagnosis": "lmlab.api.monitor",
    "Fix": "lmlab.api.monitor",
    "Monitor": "lmlab.api.monitor",
    "RunControl": "lmlab.api.monitor",
    "RunFailed": "lmlab.api.monitor",
    "StepTiming": "lmlab.api.monitor",
    "Objective": "lmlab.api.objective",
    "TokenSplit": "lmlab.api.objective",
    "Vocabulary": "lmlab.api.objective",
    "Optimizer": "lmlab.api.optimizer",
    "OptimizerOptions": "lmlab.api.optimizer",
    "ParamInfo": "lmlab.api.optimizer",
    "Field": "lmlab.api.options",
    "Options": "lmlab.api.options",
    "Order": "lmlab.api.order",
    "OrderOptions": "lmlab.api.order",
    "TrainingDocuments": "lmlab.api.order",
    "LaunchOptions": "lmlab.api.parallel",
    "Parallel": "lmlab.api.parallel",
    "loss_scaling": "lmlab.api.parallel",
    "resolve_devices": "lmlab.api.parallel",
    "Peft": "lmlab.api.peft",
    "module_roles": "lmlab.api.peft",
    "resolve_roles": "lmlab.api.peft",
    "Plugin": "lmlab.api.plugin",
    "Position": "lmlab.api.position",
    "PositionModule": "lmlab.api.position",
    "InitOptions": "lmlab.api.run",
    "ModelOptions": "lmlab.api.run",
    "ResolvedOptions": "lmlab.api.run",
    "RunSettings": "lmlab.api.run",
    "TrainOptions": "lmlab.api.run",
    "ObjectiveContext": "lmlab.api.runs",
    "TrainedRun": "lmlab.api.runs",
    "ModelShape": "lmlab.api.shape",
    "Table": "lmlab.api.table",
    "Tokenizer": "lmlab.api.tokenizer",
    "RunInfo": "lmlab.api.tracker",
    "Tracker": "lmlab.api.tracker",
    "API_VERSION": "lmlab.api.version",
}


__all__ = ["SLOT_BASES", *_EXPORTS]


def __getattr__(name: str):
    if name == "SLOT_BASES":  # slot name → the base class its plugins derive from (lmlab.slots)
        from lmlab.slots import COMMAND_TABLE, TABLE

        value = {slot.name: __getattr__(slot.base) for slot in (*TABLE, *COMMAND_TABLE)}
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'lmlab.api' has no attribute {name!r}")
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
