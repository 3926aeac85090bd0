"""Mixture-of-experts feed-forward layer: ``moe``.

The dense MLP of each block is replaced by ``n_experts`` MLPs ("experts") and a router that sends
each token to ``top_k`` of them (Shazeer et al. 2017, "Outrageously Large Neural Networks: The
Sparsely-Gated Mixture-of-Experts Layer"). The layer's parameters grow with the number of experts
while the compute per token grows only with ``top_k``. ``top_k = 1`` is the Switch Transformer
(Fedus et al. 2021, "Switch Transformers: Scaling to Trillion Parameter Models with Simple and
Efficient Sparsity"); ``top_k = 2`` is GShard (Lepikhin et al. 2021, "GShard: Scaling Giant Models
with Conditional Computation and Automatic Sharding") and Mixtral (Jiang et al. 2024, "Mixtral of
Experts"). See ``router.py`` for routing and the auxiliary losses.

By default nothing is dropped ("dropless", as in MegaBlocks: Gale et al. 2023, "MegaBlocks:
Efficient Sparse Training with Mixture-of-Experts"): every token reaches its top-k experts in training
as in evaluation, and a token's output depends on that token alone, not on what else is in the batch,
so decoding with a KV cache reproduces the full forward.

Capacity (GShard, Switch), when ``capacity_factor`` is set: in training each expert processes at most
``ceil(capacity_factor · tokens · top_k / n_experts)`` routing choices of a batch, so every expert's work
has a bounded, fixed size. Choices beyond an expert's capacity are dropped: they contribute nothing and
the residual connection carries the token past the layer. Priority is causal: earlier positions first,
each token's k choices together (its first, then its second), batch rows in order within a position.
Whether a choice is dropped then depends only on tokens at positions up to its own. GShard's order
(every token's first choice, then every second choice) would let a token at position t lose its second
expert because of tokens after t: in a causal language model, training outputs would see the future.
Evaluation and generation never drop.

Experts' weights are stacked into (E, C, H) and (E, H, C) tensors. Dropless, the routing choices are
sorted by expert, so each expert's rows are one contiguous slice and two matmuls per expert compute
exactly N·k rows however unbalanced the router (a batched matmul would pad every expert to the
busiest one's load and compute the padding for nothing). With a capacity, the tokens are gathered into
one fixed-size (E, capacity, C) buffer (empty slots hold zeros) and one ``torch.bmm`` per matrix runs
all experts; queue positions come from a cumulative sum over a one-hot of the choices. Nothing
loops over tokens.
"""

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.api import FFN, FFNModule, Field, ModelShape, Options, UserError, hookimpl
from lmlab_moe.router import Router, load_balancing_loss, router_z_loss


class MixtureOfExperts(FFNModule):
    """Top-k routed experts. After a training forward, ``aux_loss`` holds the weighted router losses
    and ``stats`` (detached) the unweighted balance and z losses, the dropped fraction and each
    expert's share of the routing choices."""

    def __init__(self, shape: ModelShape, *, n_experts: int, top_k: int, hidden: int, activation: str,
                 capacity_factor: float | None, aux_loss_coef: float, router_z_loss_coef: float,
                 inference_top_k: int | None, normalize_weights: bool):
        super().__init__()
        C, E, H = shape.d_model, n_experts, hidden
        self.n_experts, self.top_k, self.inference_top_k = n_experts, top_k, inference_top_k
        self.capacity_factor = capacity_factor or None  # 0 means no limit
        self.aux_loss_coef, self.router_z_loss_coef = aux_loss_coef, router_z_loss_coef
        self.normalize_weights, self.activation = normalize_weights, activation
        self.router = Router(C, E)
        # SwiGLU's gate and up projections share one (E, C, 2H) tensor: one bmm instead of two.
        width_in = 2 * H if activation == "swiglu" else H
        self.w_in = nn.Parameter(torch.empty(E, C, width_in))                  # (E, C, H or 2H)
        self.w_out = nn.Parameter(torch.empty(E, H, C))                        # (E, H, C)
        self.b_in = nn.Parameter(torch.empty(E, 1, width_in)) if shape.bias else None
        self.b_out = nn.Parameter(torch.empty(E, 1, C)) if shape.bias else None
        self.stats: dict[str, torch.Tensor] = {}
        self.reset_parameters(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        tokens = x.reshape(B * T, C)                                           # (N, C)
        k = self.top_k if self.training or self.inference_top_k is None else self.inference_top_k
        route = self.router(tokens, k, self.normalize_weights)
        counts = torch.bincount(route.expert.reshape(-1), minlength=self.n_experts)  # (E,) choices per expert
        if self.training and self.capacity_factor is not None:
            out, keep = self._with_capacity(tokens, route, B, T, k, counts)
        else:
            out, keep = self._dropless(tokens, route, counts), None
        y = (out * route.gate.unsqueeze(-1).to(out.dtype)).sum(dim=1)          # (N, C): each token's k outputs, gated
        self._record_losses(route, counts, keep)
        return y.view(B, T, C)

    def _dropless(self, tokens: torch.Tensor, route, counts: torch.Tensor) -> torch.Tensor:
        """(N, k, C): every choice's expert output. The choices are sorted by expert, so each expert's
        rows are one contiguous slice and exactly N·k rows are computed, however unbalanced the router."""
        N, k = route.expert.shape
        expert = route.expert.reshape(-1)                                      # (kN,) token-major
        order = expert.argsort(stable=True)                                    # (kN,) grouped by expert
        rows = tokens[order // k]                                              # (kN, C) each choice's token
        sizes = counts.tolist()  # one device sync per layer
        grouped = torch.cat([self._expert(e, chunk) for e, chunk in enumerate(rows.split(sizes))])  # (kN, C)
        out = torch.empty_like(grouped)
        out[order] = grouped                                                   # back to token-major order
        return out.view(N, k, -1)

    def _with_capacity(self, tokens: torch.Tensor, route, B: int, T: int, k: int, counts: torch.Tensor):
        """(N, k, C) expert outputs, zero for dropped choices, and (kN,) which choices were kept. Every
        expert's rows fill one fixed-size buffer, (E, capacity, C), run as one batched matmul."""
        N, C, E = tokens.shape[0], tokens.shape[1], self.n_experts
        # Choices in capacity priority order (t, b, choice): a choice's place in its expert's queue
        # counts only choices at positions up to its own, so a drop never depends on later tokens.
        expert = route.expert.view(B, T, k).transpose(0, 1).reshape(-1)       # (kN,) in (t, b, choice) order
        token = torch.arange(N, device=tokens.device).view(B, T, 1).expand(B, T, k)  # (B, T, k) token of each choice
        token = token.transpose(0, 1).reshape(-1)                              # (kN,) in (t, b, choice) order
        one_hot = F.one_hot(expert, E)                                         # (kN, E)
        position = one_hot.cumsum(dim=0).gather(1, expert[:, None]).squeeze(1) - 1  # (kN,) place in its queue
        capacity = self._capacity(N, k, counts)
        keep = position < capacity                                             # (kN,) within capacity
        # Dropped choices point at one extra slot past the end, which reads back zeros.
        slot = torch.where(keep, expert * capacity + position, E * capacity)   # (kN,)

        # Dispatch: slot → token it holds (empty slots → row N, a row of zeros).
        slot_token = torch.full((E * capacity + 1,), N, dtype=torch.long, device=tokens.device)
        slot_token[slot] = token  # kept choices own distinct slots; dropped ones collide in the spare
        padded = torch.cat((tokens, tokens.new_zeros(1, C)))                   # (N + 1, C)
        buffer = padded[slot_token[:-1]].view(E, capacity, C)                  # (E, cap, C)

        out = self._experts(buffer).reshape(E * capacity, C)                   # (E·cap, C)
        out = torch.cat((out, out.new_zeros(1, C)))                            # (E·cap + 1, C)
        slot = slot.view(T, B, k).transpose(0, 1).reshape(N, k)                # (N, k) in token order
        return out[slot], keep

    def _capacity(self, n_tokens: int, k: int, counts: torch.Tensor) -> int:
        """Rows per expert in the buffer: the capacity limit, or the busiest expert's load if smaller."""
        limit = math.ceil(self.capacity_factor * n_tokens * k / self.n_experts)
        if counts.device.type != "cpu":
            return limit  # a fixed size: no device sync, one shape for torch.compile
        # On the CPU reading the busiest load is free, and the slack a balanced router leaves (25% of the
        # buffer at capacity_factor 1.25) would be computed for nothing. Same output.
        return min(limit, int(counts.max()))

    def _experts(self, h: torch.Tensor) -> torch.Tensor:
        """(E, cap, C) → (E, cap, C): every expert's MLP on its own rows, as two batched matmuls."""
        h = torch.bmm(h, self.w_in) if self.b_in is None else torch.baddbmm(self.b_in, h, self.w_in)
        h = self._activation(h)                                                # (E, cap, H)
        return torch.bmm(h, self.w_out) if self.b_out is None else torch.baddbmm(self.b_out, h, self.w_out)

    def _expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """(n, C) → (n, C): expert ``e``'s MLP."""
        h = h @ self.w_in[e] if self.b_in is None else torch.addmm(self.b_in[e], h, self.w_in[e])
        h = self._activation(h)                                                # (n, H)
        return h @ self.w_out[e] if self.b_out is None else torch.addmm(self.b_out[e], h, self.w_out[e])

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            g, u = h.chunk(2, dim=-1)
            return F.silu(g) * u
        return F.gelu(h)

    def _record_losses(self, route, counts: torch.Tensor, keep: torch.Tensor | None) -> None:
        if not self.training:
            self.aux_loss = None  # the model would otherwise add a stale training loss to eval
            return
        balance = load_balancing_loss(route.probs, counts)
        z = router_z_loss(route.logits) if self.router_z_loss_coef else None
        aux = self.aux_loss_coef * balance
        self.aux_loss = aux if z is None else aux + self.router_z_loss_coef * z
        self.stats = {
            "balance_loss": balance.detach(),
            "z_loss": (z if z is not None else router_z_loss(route.logits)).detach(),
            "dropped_fraction": counts.new_zeros((), dtype=torch.float32) if keep is None else 1.0 - keep.float().mean(),
            "expert_fraction": counts.float() / counts.sum(),
        }

    def reset_parameters(self, shape: ModelShape) -> None:
        # A small random router rather than zeros: with all scores equal, top-k ties break by index
        # and every token would start on experts 0..k-1, overflowing their capacity for many steps.
        nn.init.normal_(self.router.weight, 0.0, shape.init_std)
        nn.init.normal_(self.w_in, 0.0, shape.init_std)
        nn.init.normal_(self.w_out, 0.0, shape.residual_init_std)  # writes into the residual
        for bias in (self.b_in, self.b_out):
            if bias is not None:
                nn.init.zeros_(bias)


class MixtureOfExpertsOptions(Options):
    n_experts: int = Field(4, ge=1, help="experts per layer")
    top_k: int = Field(2, ge=1, help="experts per token in training: 1 = Switch, 2 = GShard / Mixtral")
    hidden: int | None = Field(
        None, gt=0, help="hidden width of each expert; default (unset) = 4 x model.d_model, each expert as big as "
                         "the dense mlp (the mlp's hidden / top_k matches its active parameters)")
    activation: Literal["gelu", "swiglu"] = Field("gelu", help="expert MLP: GELU (GPT-2) or SwiGLU (Mixtral)")
    capacity_factor: float | None = Field(
        None, ge=0, help="in training each expert takes at most ceil(factor · tokens · top_k / n_experts) routing "
                         "choices, earliest positions first, the rest are dropped; default (unset) or 0: no limit "
                         "(dropless)")
    aux_loss_coef: float = Field(0.01, ge=0, help="weight of Switch's load-balancing loss")
    router_z_loss_coef: float = Field(0.0, ge=0, help="weight of ST-MoE's router z-loss (1e-3 in the paper)")
    inference_top_k: int | None = Field(None, ge=1, help="experts per token in evaluation and generation; "
                                                         "default (unset) = top_k")
    normalize_weights: bool | None = Field(
        None, help="rescale each token's top-k gate weights to sum to 1; default (unset) = true for top_k > 1 "
                   "(GShard, Mixtral), false for top_k = 1 (Switch: the gate is the router probability, "
                   "which is how the router learns)")


class MixtureOfExpertsFeedForward(FFN):
    """``moe``: top-k routed expert MLPs, dropless or with a causal capacity, load balancing and router z-loss."""

    Options = MixtureOfExpertsOptions
    api = ">=1.1,<2"  # the train-batch-end hook's `log` argument

    @hookimpl
    def lmlab_train_batch_end(self, model, log: bool) -> dict | None:
        """Router health on logging steps, averaged over layers: balance loss (1.0 is perfectly
        balanced), z-loss, the fraction of routing choices dropped by capacity."""
        if not log:
            return None
        layers = [m.stats for m in model.modules() if isinstance(m, MixtureOfExperts) and m.stats]
        if not layers:
            return None
        return {f"moe/{key}": torch.stack([stats[key] for stats in layers]).float().mean().item()
                for key in ("balance_loss", "z_loss", "dropped_fraction")}

    def build(self, shape: ModelShape, layer: int) -> MixtureOfExperts:
        o = self.options
        for key, k in (("top_k", o.top_k), ("inference_top_k", o.inference_top_k)):
            if k is not None and k > o.n_experts:
                raise UserError(f"must not exceed n_experts = {o.n_experts}; got {k}", key=f"ffn.{key}")
        normalize = o.normalize_weights if o.normalize_weights is not None else o.top_k > 1
        return MixtureOfExperts(shape, n_experts=o.n_experts, top_k=o.top_k, hidden=o.hidden or 4 * shape.d_model,
                                activation=o.activation, capacity_factor=o.capacity_factor,
                                aux_loss_coef=o.aux_loss_coef, router_z_loss_coef=o.router_z_loss_coef,
                                inference_top_k=o.inference_top_k, normalize_weights=normalize)
