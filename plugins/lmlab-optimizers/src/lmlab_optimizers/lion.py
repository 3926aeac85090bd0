"""Lion: the sign of an interpolated momentum (Chen et al. 2023, "Symbolic Discovery of Optimization
Algorithms", NeurIPS, https://arxiv.org/abs/2302.06675).

Found by a program search over update rules, Lion (EvoLved Sign Momentum) keeps one buffer, the
momentum ``m``, and steps every weight by the same magnitude, the learning rate, in the direction
of a sign (the paper's Algorithm 2):

    c = β1·m + (1 − β1)·g          the update's direction: momentum and gradient, interpolated
    θ ← θ − lr·(sign(c) + λ·θ)     a step of ±lr per weight, plus decoupled weight decay
    m ← β2·m + (1 − β2)·g          the momentum, tracked with a longer memory (β2 > β1)

Because every coordinate moves by exactly ``lr``, Lion's updates have a larger norm than Adam's:
the paper takes a learning rate 3–10× smaller than AdamW's and a weight decay 3–10× larger, so that
``lr·λ``, the strength of the decay, stays the same. The defaults (lr 1e-4, weight decay 1.0, betas
0.9/0.99 as in the paper) keep ``lr·λ`` = 1e-4, as the ``adamw`` plugin's defaults have it (1e-3 ·
0.1). Lion keeps half of Adam's state (one buffer, no step counter).

Only parameters the core marks ``decay`` get weight decay; the others (norms, biases, embeddings)
sit in a group with ``weight_decay`` 0. The step is written with ``torch._foreach_*`` operations:
one call per operation for all the tensors of a group.
"""

import torch
from pydantic import field_validator

from lmlab.api import Field, Optimizer, OptimizerOptions, ParamInfo

from lmlab_optimizers._common import check_betas, decay_groups, dense_grads, run_closure


class LionOptions(OptimizerOptions):
    lr: float = Field(1e-4, gt=0, help="peak learning rate (the [train] schedule scales it): every weight moves "
                                       "by lr per step, so 3-10x less than AdamW's")
    betas: tuple[float, float] = Field((0.9, 0.99), help="beta1 interpolates momentum and gradient for the "
                                                         "update's sign; beta2 is the momentum's decay")
    weight_decay: float = Field(1.0, ge=0, help="decoupled weight decay (lr * weight_decay) of the parameters "
                                                "marked decay: 3-10x AdamW's")

    @field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, betas: tuple[float, float]) -> tuple[float, float]:
        return check_betas(betas)


class LionOptimizer(torch.optim.Optimizer):
    """Lion over param groups with ``lr``, ``betas`` and ``weight_decay``; the momentum of each
    parameter is ``state[p]["exp_avg"]``."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group in self.param_groups:
            params, grads = dense_grads(group, "Lion")
            if not params:
                continue
            momenta = []
            for p in params:
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                momenta.append(state["exp_avg"])
            lr, weight_decay = group["lr"], group["weight_decay"]  # read afresh: the schedule rewrites lr
            beta1, beta2 = group["betas"]

            update = torch._foreach_mul(momenta, beta1)            # c = β1·m + (1 − β1)·g
            torch._foreach_add_(update, grads, alpha=1 - beta1)
            torch._foreach_sign_(update)
            if weight_decay != 0:
                torch._foreach_mul_(params, 1 - lr * weight_decay)  # θ ← θ − lr·λ·θ
            torch._foreach_add_(params, update, alpha=-lr)          # θ ← θ − lr·sign(c)
            torch._foreach_mul_(momenta, beta2)                     # m ← β2·m + (1 − β2)·g
            torch._foreach_add_(momenta, grads, alpha=1 - beta2)
        return loss


class Lion(Optimizer):
    Options = LionOptions

    def build(self, params: list[ParamInfo]) -> torch.optim.Optimizer:
        o = self.options
        return LionOptimizer(decay_groups(params, o.weight_decay), lr=o.lr, betas=o.betas)
