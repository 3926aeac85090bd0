"""The optimizer slot."""

from dataclasses import dataclass

import torch

from lmlab.api.options import Field, Options
from lmlab.api.plugin import Plugin


@dataclass
class ParamInfo:
    """A trainable parameter. ``decay`` is False for norms, biases and embeddings, decided by the core,
    and for any parameter a plugin marked with the attribute ``_no_weight_decay = True``."""

    name: str
    param: torch.nn.Parameter
    decay: bool


class OptimizerOptions(Options):
    lr: float = Field(1e-3, gt=0, help="peak learning rate (the [train] schedule scales it)")


class Optimizer(Plugin):
    """How the parameters are updated: :meth:`build` makes the ``torch.optim.Optimizer`` once, from the
    model's parameters and what it says of each (``ParamInfo``: decayed or not)."""

    slot = "optimizer"
    Options = OptimizerOptions

    def build(self, params: list[ParamInfo]) -> torch.optim.Optimizer:
        """Called once per run with the trainable parameters."""
        raise NotImplementedError
