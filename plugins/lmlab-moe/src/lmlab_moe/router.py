"""The MoE router: which experts each token goes to, with what weight, and the router's losses.

A linear map scores every expert for every token, a softmax turns the scores into probabilities, and
each token goes to its ``k`` most probable experts (Shazeer et al. 2017, "Outrageously Large Neural
Networks: The Sparsely-Gated Mixture-of-Experts Layer"). The expert outputs are mixed with those
probabilities as weights, which is how the router itself learns from the language-model loss.

Left alone, a router collapses onto a few experts. Two auxiliary losses keep it healthy:

* load balancing (Fedus et al. 2021, "Switch Transformers", eq. 4): ``E · Σ_e f_e · P_e``, with f_e
  the fraction of routing choices that picked expert e and P_e the mean probability the router gave
  e. Its minimum, 1, is reached by a uniform router; f_e carries no gradient, so the loss pushes
  probability away from experts that receive more than their share.
* router z-loss (Zoph et al. 2022, "ST-MoE: Designing Stable and Transferable Sparse Expert
  Models", eq. 5): the mean squared log-sum-exp of the router logits, which keeps them small so the
  softmax stays well conditioned in low precision.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Routing:
    """Routing decisions for N tokens with k choices each."""

    expert: torch.Tensor   # (N, k) int64: chosen experts, most probable first
    gate: torch.Tensor     # (N, k) float32: the weight of each choice in the token's output
    probs: torch.Tensor    # (N, E) float32: router probabilities
    logits: torch.Tensor   # (N, E) float32: router scores


class Router(nn.Module):
    """softmax(W x) over ``n_experts``, top-k choices per token."""

    def __init__(self, d_model: int, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))  # (E, C), nn.Linear's layout

    def forward(self, x: torch.Tensor, k: int, normalize: bool) -> Routing:
        """x (N, C) → the k experts of each token and their gates."""
        # Float32 even under autocast (Switch's "selective precision"): the softmax over expert
        # scores decides discrete routes, and bfloat16 rounding flips near-ties between experts.
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())                 # (N, E)
        probs = logits.softmax(dim=-1)                                         # (N, E)
        gate, expert = probs.topk(k, dim=-1)                                   # (N, k), (N, k)
        if normalize:
            # GShard / Mixtral: the k weights of a token sum to one, so its output has the scale of
            # a single expert's whatever the router's confidence.
            gate = gate / gate.sum(dim=-1, keepdim=True)
        return Routing(expert=expert, gate=gate, probs=probs, logits=logits)


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Switch's ``E · Σ_e f_e · P_e``; probs (N, E), counts (E,) routing choices per expert (all k)."""
    n_experts = probs.shape[-1]
    fraction = counts.float() / counts.sum()    # f_e: share of the N·k choices, no gradient
    mean_prob = probs.mean(dim=0)               # P_e, differentiable
    return n_experts * (fraction * mean_prob).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's ``mean_tokens(logsumexp(logits)²)``; logits (N, E)."""
    return torch.logsumexp(logits, dim=-1).square().mean()
