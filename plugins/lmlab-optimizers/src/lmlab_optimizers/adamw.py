"""AdamW: Adam with decoupled weight decay (Loshchilov & Hutter 2019, https://arxiv.org/abs/1711.05101).

Adam (Kingma & Ba 2015) scales each step by running estimates of the gradient's first and second
moments; AdamW shrinks the weights directly (``p -= lr * weight_decay * p``) instead of adding an
L2 term to the gradient, so the decay is not distorted by Adam's per-parameter scaling.

As in nanoGPT and GPT-3, only matrices are decayed: the core marks norms, biases and embeddings
``decay=False`` and they go into a group with weight_decay 0. The defaults are GPT-3's
(betas 0.9/0.95, weight decay 0.1).

Unless told otherwise (``fused``/``foreach``), the update runs as torch's fused kernel wherever it has
one for every parameter (plain tensors on the CPU or a CUDA device): the same arithmetic in one call
instead of a dozen tensor operations per parameter. torch itself picks it only on CUDA, and its
per-tensor loop on the CPU cost 3.1-3.7 ms of a 50 ms quickstart step here against 0.56 ms fused
(bench/train_speed.py). A sharded parameter (a DTensor) keeps torch's default.
"""

import torch
from pydantic import field_validator

from lmlab.api import Field, Optimizer, OptimizerOptions, ParamInfo, UserError


class AdamWOptions(OptimizerOptions):
    betas: tuple[float, float] = Field((0.9, 0.95), help="decay rates of the first and second moment estimates")
    eps: float = Field(1e-8, gt=0, help="added to the denominator for numerical stability")
    weight_decay: float = Field(0.1, ge=0, help="decoupled weight decay of the parameters marked decay")
    fused: bool | None = Field(None, help="one fused kernel for all parameters (None: fused where torch has the "
                                          "kernel for every parameter, CPU or CUDA; else torch's default)")
    foreach: bool | None = Field(None, help="multi-tensor implementation (None: torch's default)")

    @field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"both betas must lie in [0, 1), got {betas}")
        return betas


class AdamW(Optimizer):
    Options = AdamWOptions

    def __init__(self, options: AdamWOptions | None = None):
        super().__init__(options)
        if self.options.fused and self.options.foreach:
            raise UserError("fused and foreach are two implementations; set at most one to true",
                            key="optimizer.fused")

    def build(self, params: list[ParamInfo]) -> torch.optim.Optimizer:
        o = self.options
        groups = [
            {"params": [p.param for p in params if p.decay], "weight_decay": o.weight_decay},
            {"params": [p.param for p in params if not p.decay], "weight_decay": 0.0},
        ]
        # torch refuses an empty group, and a model may have nothing (not) to decay.
        groups = [g for g in groups if g["params"]]
        fused = o.fused
        if fused is None and o.foreach is None:
            fused = _fusable([p.param for p in params]) or None
        return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=fused, foreach=o.foreach)

    def update_rule(self) -> str:
        # fused and foreach are implementations of the same update; every other option is per group.
        return "adamw"


def _fusable(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW takes every one of ``params``: plain floating-point tensors on one
    CPU or CUDA device type (not a tensor subclass such as a sharded DTensor)."""
    kinds = {p.device.type for p in params}
    return (bool(params) and len(kinds) == 1 and kinds <= {"cpu", "cuda"}
            and all(type(p) is torch.nn.Parameter and p.is_floating_point() for p in params))
