"""Weight sparsity: ``wanda`` and ``magnitude``, one-shot pruning of the linear layers of every block,
without retraining.

``magnitude`` zeroes the weights of smallest absolute value, compared over the whole layer: the baseline
of Han et al. (2015, "Learning both Weights and Connections for Efficient Neural Networks") as Sun et al.
run it. ``wanda`` (Sun et al. 2023, "A Simple and Effective Pruning Approach for Large Language Models")
scores weight ``W_ij`` by ``|W_ij| · ‖X_j‖₂``, the norm of input feature j over every calibration token,
and compares the scores within each output row: a small weight on a feature that carries large
activations still matters, so it stays. Sun et al. find the row-wise comparison best on large language
models, whose few outlier features carry activations far above the rest; on a small model without such
features the whole-layer comparison can do better (the README's figures), so ``compare`` chooses either,
for both methods (defaults: as in the paper).

Both also take a semi-structured ``N:M`` pattern (Mishra et al. 2021, "Accelerating Sparse Deep Neural
Networks"): N weights kept in every group of M consecutive input weights of a row, the layout NVIDIA's
sparse tensor cores run at 2:4.

The embedding and the (tied) head are left dense, as in both papers. Weights stay dense tensors with
zeros in them: the state dict keeps its shapes, so a pruned run loads like any other (``restructure``
has nothing to do); the gain is in what a sparse kernel or a compressor can do with the zeros.

Wanda's input norms come from one calibration pass, with forward hooks on every linear layer, so each
layer sees the activations of the dense model (Sun et al.'s reference code instead prunes block by block,
feeding each block the output of the blocks already pruned; the one pass is simpler and costs one
forward).
"""

import re
from typing import ClassVar, Literal

import torch
from pydantic import field_validator
from torch import nn

from lmlab.api import Calibration, Compressor, Field, Options, UserError

PATTERN = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse_pattern(text: str) -> tuple[int, int]:
    """``"N:M"`` → (N, M), 1 ≤ N < M; ``ValueError`` saying what is wrong otherwise."""
    match = PATTERN.match(text)
    if not match:
        raise ValueError("must read N:M, N weights kept in each group of M (such as 2:4)")
    n, m = int(match[1]), int(match[2])
    if not 1 <= n < m:
        raise ValueError("N:M needs 1 <= N < M (N weights kept of every M)")
    return n, m


class SparsityOptions(Options):
    sparsity: float = Field(0.5, gt=0, lt=1, help="fraction of each pruned layer's weights set to zero "
                                                  "(unstructured; unused when pattern is set)")
    pattern: str | None = Field(None, help="N:M semi-structured sparsity instead, e.g. '2:4': N weights kept "
                                           "in every group of M consecutive input weights of a row")

    @field_validator("pattern")
    @classmethod
    def _pattern_reads_n_of_m(cls, value: str | None) -> str | None:
        if value is not None:
            parse_pattern(value)  # a ValueError here names compress.<method>.pattern
        return value


class MagnitudeOptions(SparsityOptions):
    compare: Literal["layer", "row"] = Field(
        "layer", help="unstructured: weights compete over the whole layer (the baseline as Sun et al. run it) or "
                      "within each output row")


class WandaOptions(SparsityOptions):
    compare: Literal["row", "layer"] = Field(
        "row", help="unstructured: weights compete within each output row (Sun et al.'s choice for language "
                    "models) or over the whole layer")


class Sparsity(Compressor):
    """Zero the lowest-scoring weights of every ``nn.Linear`` in ``model.blocks``: subclasses give the
    score (:meth:`scores`); unstructured, the scores compete within each output row or over the whole
    layer (option ``compare``, the "comparison group" Sun et al. ablate); N:M, within each group."""

    api = ">=1.9,<2"  # Compressor
    method: ClassVar[str] = ""  # the registered name, for UserError keys when used without discovery

    def check_model(self, model: nn.Module) -> None:
        self.pattern(block_linears(model))

    def compress(self, model: nn.Module, calibration: Calibration | None) -> dict:
        layers = block_linears(model)
        pattern = self.pattern(layers)
        scores = self.scores(model, layers, calibration)
        for name, linear in layers.items():
            score = scores[name]
            if pattern is not None:
                mask = n_of_m_mask(score, *pattern)
            elif self.options.compare == "row":
                mask = lowest_dropped(score, self.options.sparsity)
            else:
                mask = lowest_dropped(score.flatten(), self.options.sparsity).view_as(score)
            with torch.no_grad():
                linear.weight.mul_(mask.to(linear.weight.dtype))
        return record(model, layers)

    def pattern(self, layers: dict[str, nn.Linear]) -> tuple[int, int] | None:
        """(N, M) or None; a UserError naming the option when M does not divide a layer's input width
        (a group would straddle two rows)."""
        if self.options.pattern is None:
            return None
        key = f"compress.{self.name or self.method}.pattern"
        try:
            n, m = parse_pattern(self.options.pattern)
        except ValueError as exc:
            raise UserError(f"{exc} (got {self.options.pattern!r})", key=key) from None
        for name, linear in layers.items():
            if linear.in_features % m:
                raise UserError(f"M = {m} must divide every pruned layer's input width; {name} has "
                                f"{linear.in_features}", key=key)
        return n, m

    def scores(self, model: nn.Module, layers: dict[str, nn.Linear],
               calibration: Calibration | None) -> dict[str, torch.Tensor]:
        """name → the (out, in) importance of each weight of that layer; the lowest go."""
        raise NotImplementedError


class Magnitude(Sparsity):
    """``magnitude``: the weights of smallest |W| go, compared over the whole layer (unstructured) or
    within each group of M (N:M); needs no calibration."""

    Options = MagnitudeOptions
    method = "magnitude"

    def scores(self, model, layers, calibration):
        return {name: linear.weight.detach().abs() for name, linear in layers.items()}


class Wanda(Sparsity):
    """``wanda``: score |W_ij|·‖X_j‖₂ with input norms measured on the calibration windows, compared
    within each output row (unstructured) or each group of M (N:M), as Sun et al. (2023)."""

    Options = WandaOptions
    method = "wanda"
    calibrated = True

    def scores(self, model, layers, calibration):
        norms = input_norms(model, layers, calibration)
        return {name: linear.weight.detach().abs() * norms[name] for name, linear in layers.items()}


def block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every ``nn.Linear`` inside ``model.blocks``, by its name in the model (``blocks.0.attn.q_proj``):
    the layers both papers prune, leaving the embedding and head dense."""
    return {f"blocks.{name}": m for name, m in model.blocks.named_modules() if isinstance(m, nn.Linear)}


def input_norms(model: nn.Module, layers: dict[str, nn.Linear], calibration: Calibration) -> dict[str, torch.Tensor]:
    """name → (in,) ‖X_j‖₂ of each input feature over every token the layer saw in one calibration pass.
    A layer that saw no token (an MoE expert nobody was routed to) gets norms of one: its weights are
    then compared by magnitude alone, rather than all tying at zero."""
    squares = {name: torch.zeros(linear.in_features, dtype=torch.float64, device=linear.weight.device)
               for name, linear in layers.items()}
    seen = dict.fromkeys(layers, 0)

    def hook(name):
        def accumulate(module, args):
            x = args[0].detach().flatten(0, -2)  # (tokens, in)
            squares[name] += x.double().pow(2).sum(0)
            seen[name] += len(x)
        return accumulate

    handles = [linear.register_forward_pre_hook(hook(name)) for name, linear in layers.items()]
    try:
        calibration.run(model)
    finally:
        for handle in handles:
            handle.remove()
    return {name: (squares[name].sqrt() if seen[name] else torch.ones_like(squares[name])).to(layers[name].weight.dtype)
            for name in layers}


def lowest_dropped(score: torch.Tensor, sparsity: float) -> torch.Tensor:
    """A bool mask of ``score``'s shape, False at the ``round(sparsity · n)`` lowest entries of each row
    along the last dimension (n entries per row)."""
    drop = round(sparsity * score.shape[-1])
    mask = torch.ones_like(score, dtype=torch.bool)
    if drop:
        mask.scatter_(-1, torch.topk(score, drop, dim=-1, largest=False).indices, False)
    return mask


def n_of_m_mask(score: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """The (out, in) bool mask keeping the N highest scores of every M consecutive inputs of a row."""
    groups = score.view(score.shape[0], -1, m)  # (out, in / M, M)
    mask = torch.zeros_like(groups, dtype=torch.bool)
    mask.scatter_(-1, torch.topk(groups, n, dim=-1).indices, True)
    return mask.view_as(score)


def record(model: nn.Module, layers: dict[str, nn.Linear]) -> dict:
    """What was pruned, and the figures for the summary: the zeros reached over the pruned layers and
    the non-zero parameters left in the whole model (a tied weight counted once)."""
    zeros = {name: int((linear.weight == 0).sum()) for name, linear in layers.items()}
    pruned = sum(linear.weight.numel() for linear in layers.values())
    sparsity = sum(zeros.values()) / pruned if pruned else 0.0
    nonzero = sum(int(p.count_nonzero()) for p in model.parameters())
    return {
        "sparsity": sparsity,
        "layers": [{"name": name, "sparsity": zeros[name] / linear.weight.numel()} for name, linear in layers.items()],
        "summary": {"sparsity": sparsity, "nonzero_params": nonzero, "pruned_params": pruned},
    }
