"""Conformance checks of ffn plugins (the position-wise part of each block: MLPs, gated units, MoE).

The module of layer 0 is checked on its own, called as the model calls it: ``module(x)``. Inputs
hold 4 x block_size tokens of unit variance, so that a router with a handful of experts sends
tokens to each of them and every expert's weights can receive a gradient.

Position-wise independence is checked in eval mode. A mixture of experts with a capacity limit
legitimately couples tokens in training (a token may be dropped because others filled its expert),
but at inference it must not: cached decoding feeds one token at a time, so an output that depends on
the other tokens of the batch would differ between generation and a full forward. In training such
coupling must still be causal: the loss at position t of a causal language model may see tokens up
to t only, so an output at t that depends on later tokens (a capacity served in GShard's order, every
first choice before any second one) leaks the future into training.
"""

import torch

from lmlab.api import FFNModule
from lmlab.testing import generic
from lmlab.testing.common import (BF16, INDEPENDENT, SAME, Subject, expect_close, expect_mostly_close, expect_tensor,
                                  fail, scale)

BATCH = 4


class FFNSubject(Subject):
    slot = "ffn"
    module_type = FFNModule

    def build(self, seed: int, layer: int = 0) -> FFNModule:
        return self.built(seed, layer)

    def example(self, seed: int, dtype: torch.dtype = torch.float32) -> tuple:
        return (self.randn(BATCH, self.shape.block_size, self.shape.d_model, seed=seed, dtype=dtype),)  # (B, T, C)

    def grad_input(self, args: tuple) -> torch.Tensor:
        return args[0]

    def aux_loss(self, module) -> torch.Tensor | None:
        return getattr(module, "aux_loss", None)


def _outputs(subject: FFNSubject, dtype: torch.dtype) -> None:
    kind = str(dtype).removeprefix("torch.")
    for layer in range(subject.shape.n_layers):  # a plugin may build different modules per layer
        module = subject.build(subject.seed, layer).to(dtype)
        (x,) = subject.example(subject.seed + 1, dtype)
        with torch.no_grad():
            y = module(x)
            expect_tensor(y, x.shape, dtype, f"layer {layer}: the {kind} output")
            expect_tensor(module(x[:1, :1]), (1, 1, x.shape[2]), dtype,
                          f"layer {layer}: the {kind} output for one token")
        if dtype != torch.float32:
            with torch.no_grad():
                expected = subject.build(subject.seed, layer)(x.float())
            expect_mostly_close(y, expected, BF16, f"layer {layer}: the {kind} output differs from the float32 one")


def output_fp32(subject: FFNSubject) -> None:
    """Every layer's module maps a float32 (B, T, C) to a finite float32 (B, T, C), and (1, 1, C) to
    (1, 1, C)."""
    _outputs(subject, torch.float32)


def output_bf16(subject: FFNSubject) -> None:
    """After ``module.to(torch.bfloat16)``, a bfloat16 input gives a finite bfloat16 output of the same
    shape, within 10% of the float32 output's scale."""
    _outputs(subject, torch.bfloat16)


def position_wise(subject: FFNSubject) -> None:
    """In eval mode, changing the input at one (row, position) changes the output there only, and a
    token fed alone (as in cached decoding) gets the output it gets within the batch."""
    module = subject.build(subject.seed)
    (x,) = subject.example(subject.seed + 1)
    B, T, C = x.shape
    with torch.no_grad():
        y = module(x)
        s = scale(y)
        for row, t in ((0, 0), (B - 1, T // 2)):
            changed = x.clone()
            changed[row, t] = subject.randn(C, seed=subject.seed + 10 + t)
            diff = (module(changed) - y).abs().amax(dim=-1)                      # (B, T)
            diff[row, t] = 0
            if diff.max() > INDEPENDENT * s:
                r, p = divmod(int(diff.argmax()), T)
                fail(f"changing the input at row {row}, position {t} changed the output at row {r}, position {p} "
                     f"by {diff[r, p].item():.3g} (output scale {s:.3g}); tokens must not interact in eval mode")
        for t in (0, T - 1):
            expect_close(module(x[:, t:t + 1]), y[:, t:t + 1], SAME,
                         f"the output for position {t} fed alone (as in cached decoding) differs from its output "
                         "within the sequence", offset=t)
            expect_close(module(x[B - 1:, t:t + 1]), y[B - 1:, t:t + 1], SAME,
                         f"the output for one token (batch 1, position {t}) fed alone differs from its output within "
                         "the batch", offset=t)


def training_causality(subject: FFNSubject) -> None:
    """In training mode, changing the inputs after position t (in every row) leaves the outputs at
    positions up to t unchanged, for several t: tokens may interact in training (a capacity limit),
    but only with tokens at the same or earlier positions. Both forwards run under one seed, so
    dropout draws the same masks."""
    module = subject.build(subject.seed).train()
    if getattr(module, "skip", False):  # never run by the model (FFNModule.skip)
        return
    (x,) = subject.example(subject.seed + 1)
    B, T, C = x.shape
    with torch.no_grad():
        with subject.seeded(subject.seed + 3):
            y = module(x)
        for t in (0, T // 2 - 1, T - 2):
            changed = x.clone()
            changed[:, t + 1:] = subject.randn(B, T - t - 1, C, seed=subject.seed + 10 + t)
            with subject.seeded(subject.seed + 3):
                moved = module(changed)
            expect_close(moved[:, :t + 1], y[:, :t + 1], INDEPENDENT,
                         f"in training mode, outputs up to position {t} changed when only inputs after {t} did",
                         hint="does a decision shared by the batch (capacity, a normalisation) count later tokens?")


#: name → check, in the order ``check_ffn`` runs them.
CHECKS = {
    "plugin_class": generic.plugin_class,
    "output_fp32": output_fp32,
    "output_bf16": output_bf16,
    "position_wise": position_wise,
    "training_causality": training_causality,
    "gradients": generic.gradients,
    "determinism": generic.determinism,
    "state_dict": generic.state_dict,
    "compile": generic.compiled,
}
