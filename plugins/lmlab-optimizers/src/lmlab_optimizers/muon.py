"""Muon: orthogonalised momentum for the hidden matrices, AdamW for the rest (Jordan et al. 2024,
"Muon: An optimizer for hidden layers in neural networks", https://kellerjordan.github.io/posts/muon/;
at scale: Liu et al. 2025, "Muon is Scalable for LLM Training", https://arxiv.org/abs/2502.16982).

For a weight matrix, Muon (MomentUm Orthogonalized by Newton-Schulz) replaces the momentum ``B``
(SGD's, Nesterov by default) by the nearest semi-orthogonal matrix ``U·Vᵀ`` of its SVD ``U·S·Vᵀ``,
computed approximately by a few Newton-Schulz iterations of a quintic polynomial in bfloat16. Every
direction of the update then has the same scale, so that rare directions, which the gradient
barely shows, are learnt as fast as the dominant ones. Per step:

    B ← μ·B + g;   O = NS(g + μ·B)  (nesterov)  or  NS(B)
    θ ← θ·(1 − lr·λ) − lr·s·O          s = √max(1, rows/cols)  ("original"),
                                       or 0.2·√max(rows, cols) ("match_rms_adamw", Liu et al.)

This is ``torch.optim.Muon``. Muon is defined for the matrices of hidden layers: here the
parameters that are 2-D, marked ``decay`` by the core and live inside the transformer blocks
(``blocks.*``: the attention and ffn projections, a router, a PEFT adapter's factors). Everything
else (the token embedding and a tied head, an untied head ``head.weight``, a learned position
table, norms, biases, 3-D expert weights, parameters marked ``_no_weight_decay``) is trained by
``torch.optim.AdamW``, with weight decay only on what the core marks ``decay``, as the ``adamw``
plugin does. Muon's learning rate (0.02, Jordan's) and AdamW's (``adamw_lr``) are separate; the
core's schedule scales both by the same factor.

The two optimizers are held by one ``torch.optim.Optimizer`` (``MuonWithAdamW``) whose
``param_groups`` are Muon's groups followed by AdamW's (the very dicts, so the schedule and the
gradient clipping see and set every group; group 0's ``lr`` is Muon's, the peak the core reads),
whose ``state`` routes each parameter to its optimizer's state, and whose ``step``, ``zero_grad``,
``state_dict`` and ``load_state_dict`` act on both; its state dict has torch's usual layout.
"""

from collections.abc import Iterator, MutableMapping
from typing import Literal

import torch
from pydantic import field_validator

from lmlab.api import Field, Optimizer, OptimizerOptions, ParamInfo

from lmlab_optimizers._common import check_betas, decay_groups, run_closure


class MuonOptions(OptimizerOptions):
    lr: float = Field(0.02, gt=0, help="peak learning rate of the Muon matrices (the [train] schedule scales it)")
    momentum: float = Field(0.95, ge=0, lt=1, help="decay of Muon's momentum buffer")
    nesterov: bool = Field(True, help="orthogonalise g + momentum·buffer (Nesterov) rather than the buffer")
    ns_steps: int = Field(5, ge=1, lt=100, help="Newton-Schulz iterations of the orthogonalisation")
    ns_coefficients: tuple[float, float, float] = Field(
        (3.4445, -4.775, 2.0315), help="coefficients (a, b, c) of the quintic Newton-Schulz polynomial")
    eps: float = Field(1e-7, gt=0, help="floor of the norm the momentum is divided by before the iterations")
    adjust_lr: Literal["original", "match_rms_adamw"] = Field(
        "original", help='scale of the update by shape: "original" sqrt(max(1, rows/cols)) (Jordan), '
                         '"match_rms_adamw" 0.2·sqrt(max(rows, cols)) (Liu et al.: reuse AdamW\'s lr and decay)')
    weight_decay: float = Field(0.0, ge=0, help="decoupled weight decay (lr * weight_decay) of the Muon matrices")
    adamw_lr: float = Field(1e-3, gt=0, help="peak learning rate of the parameters AdamW trains")
    adamw_betas: tuple[float, float] = Field((0.9, 0.95), help="AdamW's decay rates of the moment estimates")
    adamw_eps: float = Field(1e-8, gt=0, help="AdamW's term added to the denominator")
    adamw_weight_decay: float = Field(0.1, ge=0, help="AdamW's decoupled weight decay of the parameters marked "
                                                      "decay that Muon does not train (an untied head)")

    @field_validator("adamw_betas")
    @classmethod
    def _betas_in_unit_interval(cls, betas: tuple[float, float]) -> tuple[float, float]:
        return check_betas(betas)


def is_hidden_matrix(info: ParamInfo) -> bool:
    """Whether Muon trains the parameter: a matrix the core decays, inside the transformer blocks."""
    return info.decay and info.param.ndim == 2 and info.name.split(".", 1)[0] == "blocks"


class _JointState(MutableMapping):
    """``optimizer.state`` of several optimizers seen as one: each parameter's entry is read from and
    written to the state of the optimizer that holds the parameter."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        self.owner = {id(p): o for o in optimizers for g in o.param_groups for p in g["params"]}

    def __getitem__(self, param):
        if id(param) not in self.owner:
            raise KeyError(param)
        return self.owner[id(param)].state[param]

    def __setitem__(self, param, value) -> None:
        if id(param) not in self.owner:
            raise KeyError(param)
        self.owner[id(param)].state[param] = value

    def __delitem__(self, param) -> None:
        del self.owner[id(param)].state[param]

    def __contains__(self, param) -> bool:  # without creating an entry in a defaultdict
        return any(param in o.state for o in self.optimizers)

    def __iter__(self) -> Iterator:
        return (p for o in self.optimizers for p in o.state)

    def __len__(self) -> int:
        return sum(len(o.state) for o in self.optimizers)


class MuonWithAdamW(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters as one: ``param_groups`` is the concatenation of
    theirs, ``step`` steps each after calling the closure once. Made for Muon and AdamW."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = list(optimizers)
        # add_param_group appends the dict it is given: these are the inner optimizers' own groups.
        super().__init__([g for o in self.optimizers for g in o.param_groups], {})
        self.state = _JointState(self.optimizers)

    def _join_groups(self) -> None:
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:
        """Torch's layout, as ``state_dict`` writes it: each optimizer loads its groups' slice."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        groups = state_dict["param_groups"]
        sizes = [len(o.param_groups) for o in self.optimizers]
        if len(groups) != sum(sizes) or any(len(g["params"]) != len(h["params"])
                                            for g, h in zip(groups, self.param_groups)):
            raise ValueError("loaded state dict has param groups that do not match this optimizer's")
        start = 0
        for optimizer, size in zip(self.optimizers, sizes):
            mine = groups[start:start + size]
            ids = {i for g in mine for i in g["params"]}
            optimizer.load_state_dict({"state": {k: v for k, v in state_dict["state"].items() if k in ids},
                                       "param_groups": mine})
            start += size
        self._join_groups()  # load_state_dict gave the inner optimizers new group dicts
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)


class Muon(Optimizer):
    Options = MuonOptions

    def build(self, params: list[ParamInfo]) -> torch.optim.Optimizer:
        o = self.options
        matrices = [p.param for p in params if is_hidden_matrix(p)]
        rest = [p for p in params if not is_hidden_matrix(p)]
        optimizers = []
        if matrices:
            optimizers.append(torch.optim.Muon(matrices, lr=o.lr, weight_decay=o.weight_decay, momentum=o.momentum,
                                               nesterov=o.nesterov, ns_coefficients=o.ns_coefficients, eps=o.eps,
                                               ns_steps=o.ns_steps, adjust_lr_fn=o.adjust_lr))
        if rest:
            optimizers.append(torch.optim.AdamW(decay_groups(rest, o.adamw_weight_decay), lr=o.adamw_lr,
                                                betas=o.adamw_betas, eps=o.adamw_eps))
        if not optimizers:
            raise ValueError("optimizer got an empty parameter list")
        return MuonWithAdamW(*optimizers)
