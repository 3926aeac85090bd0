"""SGD with momentum: the baseline every adaptive optimizer is measured against.

Stochastic gradient descent (Robbins & Monro 1951) with heavy-ball momentum (Polyak 1964),
``torch.optim.SGD``: a buffer ``b ← μ·b + (1 − dampening)·g`` accumulates the gradients and
``θ ← θ − lr·b``. With ``nesterov`` the step looks ahead, ``θ ← θ − lr·(g + μ·b)`` (Nesterov 1983, in
the form of Sutskever et al. 2013, "On the importance of initialization and momentum in deep
learning", ICML, https://proceedings.mlr.press/v28/sutskever13.html).

Weight decay here is an L2 penalty added to the gradient (``g + λ·θ``), which is what SGD's decay
has always meant (for plain SGD it equals decoupled decay of ``lr·λ``); only parameters the core
marks ``decay`` get it. SGD keeps one buffer per parameter (none when ``momentum`` is 0), half of
Adam's state, but transformers train markedly worse with it than with Adam: this is a baseline.
Its learning rate is on another scale than Adam's (a step is ``lr`` times the gradient, not a
normalised direction), hence the default of 0.1; the core's gradient clipping (``train.grad_clip``,
default 1) bounds each step's gradient norm.
"""

import torch

from lmlab.api import Field, Optimizer, OptimizerOptions, ParamInfo, UserError

from lmlab_optimizers._common import decay_groups


class SGDOptions(OptimizerOptions):
    lr: float = Field(0.1, gt=0, help="peak learning rate (the [train] schedule scales it); SGD's scale, not Adam's")
    momentum: float = Field(0.9, ge=0, lt=1, help="decay of the momentum buffer (0: plain SGD, no buffer)")
    dampening: float = Field(0.0, ge=0, le=1, help="fraction of each gradient left out of the momentum buffer")
    nesterov: bool = Field(False, help="Nesterov momentum: step along g + momentum·buffer (needs dampening 0)")
    weight_decay: float = Field(0.0, ge=0, help="L2 penalty added to the gradients of the parameters marked decay")
    foreach: bool | None = Field(None, help="multi-tensor implementation (None: torch's default)")
    fused: bool | None = Field(None, help="one fused kernel for all parameters (None: torch's default)")


class SGD(Optimizer):
    Options = SGDOptions

    def __init__(self, options: SGDOptions | None = None):
        super().__init__(options)
        o = self.options
        if o.nesterov and (o.momentum == 0 or o.dampening != 0):
            raise UserError(f"nesterov momentum needs momentum > 0 and dampening 0 (got momentum {o.momentum}, "
                            f"dampening {o.dampening})", key="optimizer.nesterov")
        if o.fused and o.foreach:
            raise UserError("fused and foreach are two implementations; set at most one to true",
                            key="optimizer.fused")

    def build(self, params: list[ParamInfo]) -> torch.optim.Optimizer:
        o = self.options
        return torch.optim.SGD(decay_groups(params, o.weight_decay), lr=o.lr, momentum=o.momentum,
                               dampening=o.dampening, nesterov=o.nesterov, foreach=o.foreach, fused=o.fused)
