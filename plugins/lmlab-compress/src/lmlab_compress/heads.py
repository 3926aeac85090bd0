"""``head-prune``: structured pruning of attention heads (Michel et al. 2019, "Are Sixteen Heads Really
Better than One?"), which makes the model physically smaller and faster, unlike weight sparsity.

Importance. Michel et al. put a gate ξ_h on each head's output (ξ = 1 leaves the model unchanged) and
score the head by the expected sensitivity of the loss to it, ``I_h = E_x |∂L(x)/∂ξ_h|``. With
``A`` the input of the output projection (head h's output at features ``[h·d, (h+1)·d)``), the derivative
at ξ = 1 is ``Σ_{t,d} A_{t,h,d} · ∂L/∂A_{t,h,d}``, so one backward pass per calibration batch gives every
head of every layer; the absolute value is taken per sequence, then summed. Each layer's scores are
divided by their L2 norm (Michel et al. found the normalised scores prune better when ranked across
layers), and the least important heads over the whole model go, in one shot. ``importance = "random"``
ranks by seeded random scores instead: the baseline any importance measure has to beat.

Grouped key/value heads. A key/value head shared by g query heads can only go with all of them, and the
heads that stay must leave every remaining key/value head the same number of query heads (the module's
grouping is ``n_heads / n_kv_heads``). So the unit of pruning is, per layer, a whole group (g query
heads and their key/value head) when a layer has several key/value heads (g = 1 for multi-head
attention: one head), and one query head when it has one (multi-query attention: the shared key/value
head stays). Every layer keeps at least one unit.

A position scheme with per-head biases (ALiBi) is refused: its bias is built for the unpruned model's
heads, and the slot's API promises no way for a pruned module to pick the rows of the heads it kept
(``gqa`` does, so the refusal could be lifted for it).
"""

from typing import Literal

import torch
from torch import nn

from lmlab.api import Calibration, Compressor, Field, Options, UserError


class HeadPruneOptions(Options):
    heads: int = Field(..., ge=1, help="query heads to remove over the whole model; a multiple of the pruning "
                                       "unit (a key/value group under grouped-query attention)")
    importance: Literal["gradient", "random"] = Field(
        "gradient", help="gradient: Michel et al.'s head-gate sensitivity on the calibration windows; random: the "
                         "baseline, seeded")
    seed: int = Field(0, help="seed of the random importance")


class HeadPrune(Compressor):
    """``head-prune``: remove the ``heads`` least important query heads (with the key/value heads left
    without one) by shrinking each attention module's projections; the record lists the heads each
    pruned layer keeps, which :meth:`restructure` applies to a freshly built model."""

    Options = HeadPruneOptions
    api = ">=1.9,<2"  # Compressor, AttentionModule.head_groups / prune_heads
    calibrated = True

    def check_model(self, model: nn.Module) -> None:
        groups = head_groups(model)
        self.check_count(groups, {layer: unit_size(*g) for layer, g in groups.items()})

    def compress(self, model: nn.Module, calibration: Calibration | None) -> dict:
        groups = head_groups(model)
        units = {layer: unit_size(*g) for layer, g in groups.items()}
        self.check_count(groups, units)
        if self.options.importance == "gradient":
            raw = gradient_importance(model, calibration, {layer: g[0] for layer, g in groups.items()})
        else:
            generator = torch.Generator().manual_seed(self.options.seed)
            raw = {layer: torch.rand(g[0], generator=generator, dtype=torch.float64) for layer, g in groups.items()}
        importance = {layer: normalised(scores) for layer, scores in raw.items()}
        keep = choose(importance, units, self.options.heads)
        if sum(groups[layer][0] - len(heads) for layer, heads in keep.items()) != self.options.heads:
            # only possible when layers' units differ in size and none of the remaining ones fits
            raise UserError(f"no choice of whole units removes exactly {self.options.heads} heads from layers whose "
                            f"units hold {sorted(set(units.values()))} heads", key=self.key)
        for layer, heads in keep.items():
            model.blocks[layer].attn.prune_heads(heads)
        removed = {layer: groups[layer][0] - len(heads) for layer, heads in keep.items()}
        return {
            "keep": {str(layer): heads for layer, heads in keep.items()},
            "importance": {str(layer): scores.tolist() for layer, scores in importance.items()},
            "summary": {"heads_removed": sum(removed.values()),
                        "heads_left": sum(g[0] for g in groups.values()) - sum(removed.values()),
                        "params": sum(p.numel() for p in model.parameters())},
        }

    def restructure(self, model: nn.Module, record: dict) -> None:
        for layer, heads in record.get("keep", {}).items():
            model.blocks[int(layer)].attn.prune_heads(list(heads))

    @property
    def key(self) -> str:
        return f"compress.{self.name or 'head-prune'}.heads"

    def check_count(self, groups: dict[int, tuple[int, int]], units: dict[int, int]) -> None:
        """Refuse, before anything changes, a number of heads that is not whole units or would leave a
        layer without one."""
        key = self.key
        heads = self.options.heads
        sizes = sorted(set(units.values()))
        if any(heads % u for u in sizes):
            raise UserError(f"must be a multiple of {' and '.join(map(str, sizes))}: a unit of pruning is "
                            f"{'a key/value group of query heads' if sizes != [1] else 'one head'}; got {heads}",
                            key=key)
        total = sum(g[0] for g in groups.values())
        most = sum(g[0] - units[layer] for layer, g in groups.items())
        if heads > most:
            raise UserError(f"the model has {total} heads in {len(groups)} layers; at most {most} can go (each "
                            f"layer keeps at least {'one head' if sizes == [1] else 'one unit'}); got {heads}",
                            key=key)


def head_groups(model: nn.Module) -> dict[int, tuple[int, int]]:
    """layer → (query heads, key/value heads) of every block's attention module; a UserError for a
    model whose position scheme or mixer cannot have heads removed."""
    if getattr(model.position, "biases", False):
        raise UserError("head-prune does not prune a model whose position scheme adds a bias per head (ALiBi): "
                        "the bias is built for every head of the unpruned model", key="position.use")
    groups = {}
    for layer, block in enumerate(model.blocks):
        g = block.attn.head_groups()
        if g is None:
            raise UserError(f"the {type(block.attn).__name__} mixer of block {layer} has no heads head-prune can "
                            "remove (it implements no head_groups)", key="attention.use")
        groups[layer] = g
    return groups


def unit_size(n_heads: int, n_kv_heads: int) -> int:
    """Query heads removed together: a whole key/value group when there are several key/value heads (one
    head under multi-head attention), one query head when a single key/value head is shared by all."""
    return n_heads // n_kv_heads if n_kv_heads > 1 else 1


def gradient_importance(model: nn.Module, calibration: Calibration, n_heads: dict[int, int]) -> dict[int, torch.Tensor]:
    """layer → (H,) Σ over calibration sequences of |∂L_seq/∂ξ_h|, the sensitivity of the sequence's
    summed next-token loss to a gate on head h's output (Michel et al. 2019, eq. 2).

    A forward pre-hook on each layer's output projection (the ``o`` role) multiplies its input by a
    (B, H) gate of ones, one gate per sequence, so the gate's gradient is each sequence's derivative.
    The parameters' own gradients are switched off meanwhile: only the gates need them."""
    gates: dict[int, torch.Tensor] = {}
    totals = {layer: torch.zeros(h, dtype=torch.float64) for layer, h in n_heads.items()}

    def gate(layer: int):
        def hook(module, args):
            a = args[0]                                                    # (B, T, H·d)
            g = torch.ones(a.shape[0], n_heads[layer], dtype=a.dtype, device=a.device, requires_grad=True)
            gates[layer] = g
            gated = a.unflatten(-1, (n_heads[layer], -1)) * g[:, None, :, None]  # (B, T, H, d)
            return (gated.flatten(-2), *args[1:])
        return hook

    trainable = [p for p in model.parameters() if p.requires_grad]
    handles = []
    try:
        for p in trainable:
            p.requires_grad_(False)
        for layer in n_heads:
            attn = model.blocks[layer].attn
            output = attn.get_submodule(attn.peft_roles()["o"])
            handles.append(output.register_forward_pre_hook(gate(layer)))
        for (_, targets), loss in zip(calibration.batches(), calibration.losses(model)):
            loss = loss * targets.numel()  # the batch's summed loss, so every sequence weighs alike
            loss.backward()
            for layer, g in gates.items():
                totals[layer] += g.grad.abs().sum(0).double().cpu()
            gates.clear()
    finally:
        for handle in handles:
            handle.remove()
        for p in trainable:
            p.requires_grad_(True)
    return totals


def normalised(scores: torch.Tensor) -> torch.Tensor:
    """A layer's scores divided by their L2 norm (Michel et al.), so layers compare on one scale."""
    norm = scores.norm()
    return scores / norm if norm > 0 else scores


def choose(importance: dict[int, torch.Tensor], units: dict[int, int], heads: int) -> dict[int, list[int]]:
    """layer → the query heads it keeps (only layers that lose some): the units of least total importance
    over the whole model go, ``heads`` query heads in all, each layer keeping at least one unit.

    A unit of layer l is ``units[l]`` consecutive query heads (a key/value group shares consecutive
    heads); its importance is the sum of its heads'."""
    candidates = []  # (importance, layer, first head)
    for layer, scores in importance.items():
        u = units[layer]
        for first, score in enumerate(scores.view(-1, u).sum(-1).tolist()):
            candidates.append((score, layer, first * u))
    candidates.sort()
    removed: dict[int, set[int]] = {layer: set() for layer in importance}
    left = heads
    for _, layer, first in candidates:
        u = units[layer]
        if left == 0:
            break
        if u > left or len(removed[layer]) + u > len(importance[layer]) - u:
            continue  # too large for what is left, or the layer's last unit
        removed[layer].update(range(first, first + u))
        left -= u
    return {layer: [h for h in range(len(importance[layer])) if h not in gone]
            for layer, gone in removed.items() if gone}
