"""LAMB: Adam with a layer-wise trust ratio (You et al. 2020, "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes", ICLR, https://arxiv.org/abs/1904.00962).

With very large batches, one global learning rate is either too large for some layers or too small
for others. LAMB (the paper's Algorithm 2) takes Adam's direction and rescales it per parameter
tensor so that its norm is proportional to the tensor's own norm:

    m ← β1·m + (1 − β1)·g,   v ← β2·v + (1 − β2)·g²                 Adam's moments
    m̂ = m / (1 − β1^t),      v̂ = v / (1 − β2^t)                     bias correction
    r = m̂ / (√v̂ + ε) + λ·θ                                          direction, with weight decay
    θ ← θ − lr · φ(‖θ‖) / ‖r‖ · r                                   the trust ratio φ(‖θ‖)/‖r‖

``φ`` is the identity, or clamps the weight norm into ``weight_norm_clamp`` = [γl, γu] (the paper's
scaling function). The ratio is 1 when ``‖θ‖`` or ``‖r‖`` is 0 (a zero-initialised weight would
otherwise never move, and a zero update divides by zero), as TensorFlow Addons' ``LAMB`` does.

Parameters the core marks ``decay`` False (norms, biases, embeddings) get neither weight decay nor
the trust ratio: a plain bias-corrected Adam step. The paper's algorithm does not single them out;
TensorFlow Addons' ``LAMB`` excludes from layer adaptation what it excludes from weight decay (its
``exclude_from_layer_adaptation`` defaults to ``exclude_from_weight_decay``, LayerNorm and biases),
and this follows it; ``adapt_no_decay`` applies the trust ratio to them too, as the algorithm as
written does. The exclusion is a property of the group (its ``"trust_ratio"`` key), not of its
``weight_decay``: with ``weight_decay`` 0, matrices still get the trust ratio.

Each step is ``torch._foreach_*`` operations over a group's tensors; the norms come from
``torch._foreach_norm`` and stay tensors (no synchronisation with an accelerator; the step
counters, like torch's Adam's, live on the CPU).
"""

import math

import torch
from pydantic import field_validator

from lmlab.api import Field, Optimizer, OptimizerOptions, ParamInfo

from lmlab_optimizers._common import check_betas, dense_grads, run_closure


class LAMBOptions(OptimizerOptions):
    betas: tuple[float, float] = Field((0.9, 0.999), help="decay rates of the first and second moment estimates")
    eps: float = Field(1e-6, gt=0, help="added to the denominator sqrt(v) for numerical stability")
    weight_decay: float = Field(0.01, ge=0, help="weight decay added to the update of the parameters marked decay")
    weight_norm_clamp: tuple[float, float] | None = Field(
        None, help="[low, high]: the trust ratio's weight norm clamped into this range (the paper's phi); "
                   "unset: the norm itself")
    adapt_no_decay: bool = Field(False, help="also apply the trust ratio to the parameters not marked decay "
                                             "(norms, biases, embeddings)")

    @field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, betas: tuple[float, float]) -> tuple[float, float]:
        return check_betas(betas)

    @field_validator("weight_norm_clamp")
    @classmethod
    def _clamp_is_a_range(cls, clamp: tuple[float, float] | None) -> tuple[float, float] | None:
        if clamp is not None and not 0 <= clamp[0] <= clamp[1]:
            raise ValueError(f"weight_norm_clamp must be [low, high] with 0 <= low <= high, got {list(clamp)}")
        return clamp


class LAMBOptimizer(torch.optim.Optimizer):
    """LAMB over param groups with ``lr``, ``betas``, ``eps``, ``weight_decay``, ``weight_norm_clamp``
    (None or (low, high)) and ``trust_ratio`` (False: a plain bias-corrected Adam step plus weight decay).
    State per parameter: ``step`` (a float32 scalar tensor, as torch's Adam keeps it), ``exp_avg``,
    ``exp_avg_sq``."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, weight_norm_clamp: tuple[float, float] | None = None,
                 trust_ratio: bool = True):
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "weight_norm_clamp": None if weight_norm_clamp is None else tuple(weight_norm_clamp),
                    "trust_ratio": trust_ratio}
        super().__init__(params, defaults)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group in self.param_groups:
            params, grads = dense_grads(group, "LAMB")
            if not params:
                continue
            states = [self._state(p) for p in params]
            exp_avgs = [s["exp_avg"] for s in states]
            exp_avg_sqs = [s["exp_avg_sq"] for s in states]
            steps = [s["step"] for s in states]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]  # afresh: the schedule sets lr
            beta1, beta2 = group["betas"]

            torch._foreach_add_(steps, 1.0)
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)                # m ← β1·m + (1 − β1)·g
            torch._foreach_mul_(exp_avg_sqs, beta2)                          # v ← β2·v + (1 − β2)·g²
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)

            counts = [s.item() for s in steps]  # CPU scalars, as torch's Adam reads them
            denom = torch._foreach_sqrt(exp_avg_sqs)                         # √v̂ + ε
            torch._foreach_div_(denom, [math.sqrt(1 - beta2 ** t) for t in counts])
            torch._foreach_add_(denom, eps)
            update = torch._foreach_div(exp_avgs, denom)                     # m̂ / (√v̂ + ε)
            torch._foreach_div_(update, [1 - beta1 ** t for t in counts])
            if weight_decay != 0:
                torch._foreach_add_(update, params, alpha=weight_decay)      # r = … + λ·θ
            if group["trust_ratio"]:
                torch._foreach_mul_(update, self._trust_ratios(params, update, group["weight_norm_clamp"]))
            torch._foreach_add_(params, update, alpha=-lr)                   # θ ← θ − lr·ratio·r
        return loss

    @staticmethod
    def _trust_ratios(params: list[torch.Tensor], update: list[torch.Tensor],
                      clamp: tuple[float, float] | None) -> list[torch.Tensor]:
        """φ(‖θ‖) / ‖r‖ per tensor (a scalar tensor each); 1 where either norm is 0."""
        weight_norms = torch._foreach_norm(params)
        update_norms = torch._foreach_norm(update)
        ratios = []
        for w, u in zip(weight_norms, update_norms):
            phi = w if clamp is None else w.clamp(clamp[0], clamp[1])
            ratios.append(torch.where((w > 0) & (u > 0), phi / u, torch.ones_like(w)))
        return ratios


class LAMB(Optimizer):
    Options = LAMBOptions

    def build(self, params: list[ParamInfo]) -> torch.optim.Optimizer:
        o = self.options
        groups = [
            {"params": [p.param for p in params if p.decay], "weight_decay": o.weight_decay, "trust_ratio": True},
            {"params": [p.param for p in params if not p.decay], "weight_decay": 0.0,
             "trust_ratio": o.adapt_no_decay},
        ]
        return LAMBOptimizer([g for g in groups if g["params"]], lr=o.lr, betas=o.betas, eps=o.eps,
                             weight_norm_clamp=o.weight_norm_clamp)
