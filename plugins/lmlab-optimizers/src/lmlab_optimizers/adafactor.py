"""Adafactor: adaptive steps with sublinear memory (Shazeer & Stern 2018, "Adafactor: Adaptive
Learning Rates with Sublinear Memory Cost", ICML, https://arxiv.org/abs/1804.04235).

Adam keeps, for every weight, a running mean of the squared gradient. Adafactor keeps, for a matrix
of n × m weights, only the running means of its rows and of its columns (n + m numbers) and
estimates the full second moment as their outer product divided by the overall mean: the rank-1
factorisation that minimises a generalised KL divergence to it. Vectors keep a full second moment.
There is no first moment (the paper's β1 = 0), so a model's optimizer state is a small fraction of
a copy of its weights, against Adam's two copies.

This is ``torch.optim.Adafactor``, torch's implementation of the paper's Algorithms 4 and 5:

- the second-moment decay grows with the step, ``β2_t = 1 − t^beta2_decay`` (−0.8, the paper's);
- the update ``g / √v̂`` is clipped to an RMS of at most ``d`` (update clipping, section 6);
- the step size is *relative*: ``max(eps2, RMS(θ)) · min(lr, 1/√t)``, so that a weight moves by a
  fraction of its own scale (``eps2`` keeps zero-initialised weights moving);
- ``weight_decay`` is decoupled, ``θ ← θ·(1 − lr·λ)``, on the parameters the core marks ``decay``.

The schedule: the core's ``LambdaLR`` scales ``lr`` at every step and Adafactor reads it afresh, but
the paper's ``1/√t`` caps it: the step size is ``min(scheduled lr, 1/√t)``, which at the default lr
of 1e-2 is the scheduled lr for the first 10⁴ steps (while 1/√t ≥ 1e-2) and, later, whichever is
smaller. The paper's relative step without a schedule of one's own is this with a large lr (1/√t
then always wins). torch's ``maximize`` is not exposed: training minimises the loss.
"""

import torch

from lmlab.api import Field, Optimizer, OptimizerOptions, ParamInfo

from lmlab_optimizers._common import decay_groups


class AdafactorOptions(OptimizerOptions):
    lr: float = Field(1e-2, gt=0, help="peak relative step size (the [train] schedule scales it); capped by "
                                       "1/sqrt(step)")
    beta2_decay: float = Field(-0.8, le=0, help="the second-moment decay is 1 - step^beta2_decay")
    eps1: float | None = Field(None, gt=0, help="floor of the second-moment estimate, squared (None: the "
                                                "parameter dtype's machine epsilon)")
    eps2: float = Field(1e-3, ge=0, help="floor of a parameter's RMS in the relative step size")
    d: float = Field(1.0, ge=1, help="clipping threshold: the update's RMS is clipped to at most d")
    weight_decay: float = Field(0.0, ge=0, help="decoupled weight decay (lr * weight_decay) of the parameters "
                                                "marked decay")
    foreach: bool | None = Field(None, help="multi-tensor implementation (None: torch's default)")


class Adafactor(Optimizer):
    Options = AdafactorOptions

    def build(self, params: list[ParamInfo]) -> torch.optim.Optimizer:
        o = self.options
        return torch.optim.Adafactor(decay_groups(params, o.weight_decay), lr=o.lr, beta2_decay=o.beta2_decay,
                                     eps=(o.eps1, o.eps2), d=o.d, foreach=o.foreach)
