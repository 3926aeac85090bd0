"""lmlab.api — the only module plugins import from the core.

One base class per slot, typed options, the shapes and caches architecture plugins share, and the
lifecycle hookspecs. Versioned by ``API_VERSION``; see ``lmlab.api.version`` for the policy.
"""

from lmlab.api.attention import Attention, AttentionModule, MixerContext
from lmlab.api.batch import IGNORE_INDEX, Batch
from lmlab.api.cache import InferenceCache, KVCache, LayerState
from lmlab.api.data import DataOptions, DataSource, Document, Record, Segment, document_text
from lmlab.api.decoding import Decoder, Stepper
from lmlab.api.errors import UserError
from lmlab.api.ffn import FFN, FFNModule
from lmlab.api.filter import Filter
from lmlab.api.hooks import LifecycleSpec, hookimpl, hookspec
from lmlab.api.layout import Collective, MemoryLayout
from lmlab.api.model import LanguageModel
from lmlab.api.objective import Objective
from lmlab.api.optimizer import Optimizer, OptimizerOptions, ParamInfo
from lmlab.api.options import Field, Options
from lmlab.api.parallel import Parallel, resolve_devices
from lmlab.api.plugin import Plugin
from lmlab.api.position import Position, PositionModule
from lmlab.api.shape import ModelShape
from lmlab.api.tokenizer import Tokenizer
from lmlab.api.tracker import RunInfo, Tracker
from lmlab.api.version import API_VERSION

#: slot name → the base class its plugins derive from. Slots of DESIGN.md without a base class yet
#: (peft, monitor, compress) take any Plugin subclass.
SLOT_BASES: dict[str, type[Plugin]] = {
    "data": DataSource, "tokenizer": Tokenizer, "position": Position, "attention": Attention,
    "ffn": FFN, "objective": Objective, "optimizer": Optimizer, "parallel": Parallel,
    "decoding": Decoder, "tracker": Tracker,
    "filter": Filter, "peft": Plugin, "monitor": Plugin, "compress": Plugin,
}

__all__ = [
    "API_VERSION", "SLOT_BASES", "Attention", "AttentionModule", "Batch", "Collective", "DataOptions", "DataSource",
    "Decoder", "Document", "FFN", "FFNModule", "Field", "Filter", "IGNORE_INDEX", "InferenceCache", "KVCache",
    "LanguageModel", "LayerState", "LifecycleSpec", "MemoryLayout", "MixerContext", "ModelShape", "Objective",
    "Optimizer",
    "OptimizerOptions", "Options", "Parallel", "ParamInfo", "Plugin", "Position", "PositionModule",
    "Record", "RunInfo", "Segment", "Stepper", "Tokenizer", "Tracker", "UserError", "document_text",
    "hookimpl", "hookspec", "resolve_devices",
]
