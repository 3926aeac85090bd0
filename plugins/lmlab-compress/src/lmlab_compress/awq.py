"""``awq``: activation-aware weight quantisation (Lin et al. 2023, "AWQ: Activation-aware Weight
Quantization for LLM Compression and Acceleration"), and ``int4``, the design's name for 4-bit grouped
quantisation by AWQ (default) or plain round-to-nearest.

A few input channels of a linear layer carry much larger activations than the rest, and the
weights they multiply matter most. AWQ protects them by scaling: y = W x = (W · diag(s)) (x / s), with
s > 1 on the salient channels, so that their weights take more of their group's range and lose
relatively less to rounding. Linear layers that read the same input (the query, key and value
projections of a block; the gate and up projections of a gated FFN) share one s. The candidates
are AutoAWQ's ("duo scaling", its default): s = mean|x|^α / mean|ŵ|^(1−α) for α = 0, 1/grid, …,
with mean|x| per input channel over the calibration data and mean|ŵ| the weights' magnitude per
input channel relative to their group's max, normalised so that max(s) · min(s) = 1; plus s = 1,
plain round-to-nearest, so the search never picks worse than RTN. Then AWQ clips: each output row's
groups may shrink their range to a fraction of max|w| (1, 0.95, …, 0.55), trading error on the few
largest weights for finer steps on the rest, chosen per row-group by that group's output error.

How a candidate s is judged (option ``search``):

- ``output``, the paper's criterion: the output error ‖X Q(W·diag(s))ᵀ/s − X Wᵀ‖² of the layers
  on the calibration inputs; every clip found is kept.
- ``loss`` (default): the model's mean next-token loss on the calibration windows, with the groups
  searched in the order the model runs them and each keeping its choice before the next is searched
  (clipping is kept for a layer only when it lowers that loss too). It costs a forward pass over the
  calibration data per candidate (grid + 1 per group of layers), and needs a model that returns
  next-token logits, as lmlab's do. On the trained character model of the README the output error
  was a poor guide at 4 bits (AWQ by output error lost to RTN at group size 128); the loss won at
  every bit width and group size measured.

The output error and the clipping error are quadratic forms of the input's second moment C = Xᵀ X,
accumulated over every calibration token (K² numbers per group of layers sharing an input of width
K): they cost what the layer's weights cost, whatever the amount of calibration data, and see all of it.

The paper folds 1/s into the operation before the layer (a LayerNorm's weight, the previous linear).
A method of a generic plugin cannot know what that operation is, so the layer keeps 1/s as a float32
vector (``input_scale``, one number per input) and multiplies its input by it: 4 bytes per input
channel, nothing per weight.
"""

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.api import Compressor, Field, Options, UserError
from lmlab_compress.grouped import GroupOptions, GroupQuantizer, GroupQuantLinear, RoundToNearest, fake_quantize
from lmlab_compress.linears import skip_field

#: AWQ's clipping search shrinks the range by at most half (ratios 1 − i/grid for i < grid / 2).
MAX_SHRINK = 0.5


@dataclass
class InputStats:
    """What one group of layers sharing an input saw over the calibration data."""

    members: list[str]
    abs_sum: torch.Tensor  # (K,) Σ |x| per input channel
    gram: torch.Tensor  # (K, K) Σ x xᵀ
    tokens: int = 0

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.tokens, 1)


@dataclass
class Collector:
    """Forward hooks that accumulate :class:`InputStats` per group of linears sharing an input.

    Two layers share an input when, within one forward of the model, they receive the very same
    tensor object: the hooks keep a reference to each input until the next forward starts, so an
    object's id cannot be reused meanwhile.
    """

    layers: dict[str, nn.Linear]
    stats: dict[str, InputStats] = field(default_factory=dict)  # by the group's first layer
    group_of: dict[str, str] = field(default_factory=dict)  # layer → its group's first layer
    _seen: dict[int, tuple[torch.Tensor, str]] = field(default_factory=dict)

    def run(self, model: nn.Module, calibration) -> None:
        handles = [model.register_forward_pre_hook(lambda *_: self._seen.clear())]
        handles += [linear.register_forward_hook(self._hook(name)) for name, linear in self.layers.items()]
        try:
            calibration.run(model)
        finally:
            for h in handles:
                h.remove()
            self._seen.clear()

    def _hook(self, name: str):
        def hook(module, inputs, output):
            x = inputs[0]
            if name not in self.group_of:  # first sight decides: the group of an earlier reader, or its own
                earlier = self._seen.get(id(x))
                self.group_of[name] = earlier[1] if earlier is not None and earlier[0] is x else name
                if self.group_of[name] != name:
                    self.stats[self.group_of[name]].members.append(name)
            if self.group_of[name] != name:
                return
            self._seen[id(x)] = (x, name)
            x = x.detach().reshape(-1, x.shape[-1]).float()
            if name not in self.stats:
                k = x.shape[-1]
                self.stats[name] = InputStats([name], x.new_zeros(k), x.new_zeros(k, k))
            stats = self.stats[name]
            stats.abs_sum += x.abs().sum(0)
            stats.gram.addmm_(x.t(), x)
            stats.tokens += x.shape[0]
        return hook


def output_error(delta: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """Σ over tokens of ‖x Δᵀ‖² = Σ_rows δ C δᵀ, for a weight error Δ (out, K) and C = Σ x xᵀ."""
    return ((delta @ gram) * delta).sum()


def weight_salience(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """AutoAWQ's mean|ŵ| per input channel: |w| relative to its group's max, averaged over rows."""
    w = weight.abs().reshape(weight.shape[0], -1, group_size)
    return (w / (w.amax(-1, keepdim=True) + 1e-6)).reshape(weight.shape).mean(0)


def scale_candidates(mean_abs: torch.Tensor, salience: torch.Tensor, grid: int):
    """(α, s): first (None, 1), plain rounding; then for α = 0, 1/grid, …, (grid − 1)/grid,
    s = mean|x|^α / mean|ŵ|^(1−α), normalised so that max(s) · min(s) = 1."""
    yield None, torch.ones_like(mean_abs)
    for i in range(grid):
        alpha = i / grid
        s = (mean_abs.pow(alpha) / (salience.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        yield alpha, s / (s.max() * s.min()).sqrt()


def search_clip(weight: torch.Tensor, gram: torch.Tensor, bits: int, group_size: int, asymmetric: bool,
                grid: int) -> torch.Tensor:
    """AWQ's clipping search: the ratio (out, groups) of each row-group's max|w| to clamp to, from
    1, 1 − 1/grid, … down to 1 − MAX_SHRINK, minimising that group's share of the output error (the
    diagonal block of C for the group's inputs: groups are rounded independently)."""
    out_features, in_features = weight.shape
    groups = in_features // group_size
    idx = torch.arange(groups, device=gram.device)
    blocks = gram.reshape(groups, group_size, groups, group_size)[idx, :, idx, :]  # (G, g, g)
    w = weight.reshape(out_features, groups, group_size)
    best_err = weight.new_full((out_features, groups), float("inf"))
    best = weight.new_ones(out_features, groups)
    for i in range(max(1, int(MAX_SHRINK * grid))):
        ratio = 1 - i / grid
        clip = weight.new_full((out_features, groups), ratio)
        delta = fake_quantize(weight, bits, group_size, asymmetric, clip).reshape_as(w) - w
        err = torch.einsum("ogk,gkl,ogl->og", delta, blocks, delta)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, ratio, best)
    return best


class CalibrationLoss:
    """The model's mean next-token cross-entropy on the calibration windows (no gradients)."""

    def __init__(self, model: nn.Module, calibration, key: str):
        self.model, self.calibration, self.key = model, calibration, key

    @torch.no_grad()
    def __call__(self) -> float:
        total = 0.0
        for inputs, targets in self.calibration.batches():
            logits = self.model(inputs)
            if not (isinstance(logits, torch.Tensor) and logits.shape[:-1] == targets.shape
                    and logits.shape[-1] > int(targets.max())):
                raise UserError("search = \"loss\" needs a model that returns next-token logits (B, T, vocab); "
                                "this one does not: use search = \"output\"", key=self.key)
            total += float(F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum"))
        return total / self.calibration.tokens


@dataclass
class Plan:
    """How one layer is quantised: W · diag(s) with clipping, 1/s kept for the input."""

    weight: torch.Tensor  # W · diag(s)
    input_scale: torch.Tensor  # 1 / s
    clip: torch.Tensor | None  # (out, groups) ratios, None for none
    alpha: float | None  # None: s = 1
    group: str  # the first layer of the group sharing s


class AWQOptions(GroupOptions):
    grid: int = Field(20, ge=2, le=1000, help="points of the searches: α in {0, 1/grid, …}, clip ratios "
                                              "1, 1 − 1/grid, … down to 0.5")
    search: Literal["loss", "output"] = Field(
        "loss", help="what picks each scale and clipping: loss, the model's calibration loss (needs "
                     "next-token logits); output, the layers' output error (the paper's criterion)")


class AWQ(GroupQuantizer):
    """``awq``: grouped round-to-nearest after AWQ's activation-aware scaling and clipping search."""

    Options = AWQOptions
    method_name = "awq"
    calibrated = True
    input_scaled = True

    def prepare(self, model: nn.Module, layers: dict[str, nn.Linear], calibration) -> dict:
        if calibration is None:
            raise UserError("measures activations and needs calibration data", key=self.key_prefix)
        collector = Collector(layers)
        collector.run(model, calibration)
        loss = None
        if self.options.search == "loss":
            loss = CalibrationLoss(model, calibration, f"{self.key_prefix}.search")
        originals = {name: linear.weight for name, linear in layers.items()}
        plans: dict[str, Plan] = {}
        try:
            for group, stats in collector.stats.items():
                plans.update(self._search(group, stats, layers, loss))
        finally:  # the loss search swaps candidate weights in; the originals go back (and stay tied)
            for name, linear in layers.items():
                linear.weight = originals[name]
        return plans

    def _search(self, group: str, stats: InputStats, layers: dict[str, nn.Linear], loss) -> dict[str, Plan]:
        o = self.options
        weights = {m: layers[m].weight.detach().float() for m in stats.members}

        def effective(m, s, clip=None):
            return fake_quantize(weights[m] * s, o.bits, o.group_size, o.asymmetric, clip) / s

        def score(candidate: dict[str, torch.Tensor]) -> float:
            if loss is None:
                return sum(float(output_error(w - weights[m], stats.gram)) for m, w in candidate.items())
            for m, w in candidate.items():  # a new parameter: a tied weight's other user keeps the original
                layers[m].weight = nn.Parameter(w.to(layers[m].weight.dtype), requires_grad=False)
            return loss()

        stacked = torch.cat(list(weights.values()))
        best = None
        for alpha, s in scale_candidates(stats.mean_abs, weight_salience(stacked, o.group_size), o.grid):
            err = score({m: effective(m, s) for m in stats.members})
            if best is None or err < best[0]:
                best = (err, alpha, s)
        err, alpha, s = best
        if loss is not None:
            score({m: effective(m, s) for m in stats.members})  # the layers hold the choice from here on
        gram = stats.gram / torch.outer(s, s)  # the scaled weight sees the inputs x / s
        plans = {}
        for m in stats.members:
            clip = search_clip(weights[m] * s, gram, o.bits, o.group_size, o.asymmetric, o.grid)
            if loss is not None:
                clipped = score({m: effective(m, s, clip)})
                if clipped < err:
                    err = clipped
                else:
                    clip = None
                    score({m: effective(m, s)})
            plans[m] = Plan(weights[m] * s, 1 / s, clip, alpha, group)
        return plans

    def quantize(self, name: str, linear: nn.Linear, plan: Plan | None) -> nn.Module:
        o = self.options
        if plan is None:  # the calibration never ran this layer: nothing to scale by, plain rounding
            plan = Plan(linear.weight, linear.weight.new_ones(linear.in_features), None, None, name)
        return GroupQuantLinear.from_linear(linear, o.bits, o.group_size, o.asymmetric, clip=plan.clip,
                                            input_scale=plan.input_scale, weight=plan.weight)

    def record_extra(self, plans: dict[str, Plan]) -> dict:
        scales: dict[str, dict] = {}
        for name, p in plans.items():
            scales.setdefault(p.group, {"layers": [], "alpha": p.alpha})["layers"].append(name)
        clipped = [float((p.clip < 1).float().mean()) if p.clip is not None else 0.0 for p in plans.values()]
        summary = {"scaled_groups": sum(g["alpha"] is not None for g in scales.values()),
                   "clipped_layers": sum(c > 0 for c in clipped),
                   "clipped_row_groups": sum(clipped) / len(clipped) if clipped else 0.0}
        return {**super().record_extra(plans), "search": self.options.search, "scales": scales, "summary": summary}


class Int4Options(Options):
    method: Literal["awq", "rtn"] = Field("awq", help="awq: activation-aware scaling and clipping (needs "
                                                      "calibration data); rtn: plain round-to-nearest")
    group_size: int = Field(32, gt=0, help="input weights per scale and zero point; must divide each layer's "
                                           "in_features")
    skip: list[str] = skip_field()


class Int4(Compressor):
    """``int4``: 4-bit grouped asymmetric weights by ``awq`` (default) or ``rtn``, under one name."""

    Options = Int4Options
    api = ">=1.9,<2"  # Compressor

    @property
    def calibrated(self) -> bool:  # on the class, the property object: truthy, as for the default method
        return self.options.method == "awq"

    def _method(self) -> GroupQuantizer:
        o = self.options
        given = {"skip": o.skip} if "skip" in o.model_fields_set else {}
        cls = AWQ if o.method == "awq" else RoundToNearest
        method = cls(cls.Options(bits=4, group_size=o.group_size, **given))
        method.name = self.name or "int4"  # errors name this method's options: compress.int4.group_size
        return method

    def check_model(self, model: nn.Module) -> None:
        self._method().check_model(model)

    def compress(self, model: nn.Module, calibration) -> dict:
        return self._method().compress(model, calibration)

    def restructure(self, model: nn.Module, record: dict) -> None:
        self._method().restructure(model, record)
