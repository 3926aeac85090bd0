"""The slots, in one table: what discovery looks up, what validation requires, which lmlab.api base
class a plugin of each derives from, and which plugin a manifest gets when it leaves a slot out.

A default is only a plugin name, never its options: a plugin's options default in its own Options
class, so changing ``use`` never carries another plugin's options over. Nothing here imports more
than the standard library (``lmlab plugins`` reads it without importing torch or any plugin).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    name: str  # the manifest table and the entry-point group lmlab.<name>
    base: str  # the lmlab.api class its plugins derive from
    many: bool = False  # use = ["a", "b"], options under [<slot>.<name>]
    default: str | None = None  # the plugin a manifest that leaves the slot out gets
    required: bool = False  # a manifest must name a plugin (there is no default)


#: In the order a run uses them: the data, how it becomes tokens, the model, how it trains, how it is
#: decoded and tracked, then what is watched and what is done with a trained run.
TABLE = (
    Slot("data", "DataSource", required=True),
    Slot("filter", "Filter", many=True),
    Slot("tokenizer", "Tokenizer", default="char"),
    Slot("architecture", "Architecture", default="decoder"),  # wires the model from the next three
    Slot("position", "Position", default="learned"),
    Slot("attention", "Attention", default="mha"),
    Slot("ffn", "FFN", default="mlp"),
    Slot("objective", "Objective", default="causal-lm"),
    Slot("order", "Order"),  # none named: uniform draws, as the first-party `uniform`
    Slot("optimizer", "Optimizer", default="adamw"),
    Slot("parallel", "Parallel", default="single"),
    Slot("peft", "Peft"),
    Slot("decoding", "Decoder", default="greedy"),
    Slot("tracker", "Tracker", default="wandb"),
    Slot("monitor", "Plugin", many=True),
    Slot("compress", "Compressor", many=True),
)

#: Slots a command line names (``--executor``), not a manifest: where a sweep runs changes nothing it
#: trains, so it is neither validated with the manifest nor recorded in a run's.
COMMAND_TABLE = (
    Slot("executor", "Executor"),  # none named: the core's own `local`
)

BY_NAME = {slot.name: slot for slot in (*TABLE, *COMMAND_TABLE)}
ALL_SLOTS = tuple(BY_NAME)
SLOTS = tuple(slot.name for slot in TABLE)
MANY_SLOTS = frozenset(slot.name for slot in TABLE if slot.many)
DEFAULT_PLUGINS = {slot.name: slot.default for slot in TABLE if slot.default}
