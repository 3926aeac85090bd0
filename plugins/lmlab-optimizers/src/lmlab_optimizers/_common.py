"""What the optimizers of this package share: the core's weight-decay grouping, a check of betas, and
the start of a hand-written ``step`` (the closure, then each group's dense gradients)."""

import torch

from lmlab.api import ParamInfo


def decay_groups(params: list[ParamInfo], weight_decay: float, **extra) -> list[dict]:
    """The two param groups the core asks for: the parameters marked ``decay`` with ``weight_decay``,
    the others (norms, biases, embeddings) with 0; ``extra`` keys go into both. An empty group is
    left out, as torch refuses one."""
    groups = [
        {"params": [p.param for p in params if p.decay], "weight_decay": weight_decay, **extra},
        {"params": [p.param for p in params if not p.decay], "weight_decay": 0.0, **extra},
    ]
    return [g for g in groups if g["params"]]


def check_betas(betas: tuple[float, ...]) -> tuple[float, ...]:
    """For a pydantic field validator: every beta in [0, 1)."""
    if not all(0 <= b < 1 for b in betas):
        raise ValueError(f"every beta must lie in [0, 1), got {list(betas)}")
    return betas


def run_closure(closure):
    """The loss of Lightning's closure, called once with gradients enabled (None without one)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def dense_grads(group: dict, name: str) -> tuple[list, list]:
    """A param group's parameters that have gradients, and those gradients; sparse ones refused."""
    params = [p for p in group["params"] if p.grad is not None]
    grads = [p.grad for p in params]
    if any(g.is_sparse for g in grads):
        raise RuntimeError(f"{name} does not support sparse gradients")
    return params, grads
