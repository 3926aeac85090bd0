"""Conformance checks of position plugins.

A position scheme acts in up to three places (``embed``, ``rotate``, ``attention_bias``), so most
checks run it where it runs for real: inside the core's ``LanguageModel``, assembled with the kit's
reference attention and feed-forward (:mod:`lmlab.testing.reference`), which honour every hook.
Gradients, determinism, the state dict and compile are checked on that model too, reporting only
the position module's own parameters. The module alone is probed for dtypes, shapes and flags.

Sequences are ``block_size`` long (16 in the default shape). A scheme with an int option that reaches
half of that (a window of relative positions, a chunk, a period) has causality and incremental_decoding
checked once more at a block_size past it: 2 × the largest such value + 3, at most 256 and at most the
scheme's ``max_positions``. They read the options under test, not the class defaults: pass the options
that matter to exercise a value larger than 256 by default.
"""

import dataclasses

import torch

from lmlab.api import PositionModule
from lmlab.testing import generic
from lmlab.testing.common import (BF16, INDEPENDENT, SAME, Subject, expect_close, expect_finite,
                                  expect_mostly_close, expect_tensor, fail)
from lmlab.testing.lengths import past_length_options
from lmlab.testing.reference import reference_model

BATCH = 2


class PositionSubject(Subject):
    slot = "position"
    module_type = PositionModule

    def module(self, seed: int) -> PositionModule:
        """The position module alone, built and initialised under ``seed``."""
        return self.built(seed)

    def build(self, seed: int):
        """The reference language model, of one block, with this position scheme (see ``reference_model``)."""
        self.module(seed)  # fails clearly on a build that returns the wrong type
        with self.seeded(seed):
            # One block is enough to meet every hook of the scheme, and halves the cost of compiling.
            model = reference_model(dataclasses.replace(self.shape, n_layers=1), self.plugin())
        return model.to(self.device).eval()

    def example(self, seed: int, dtype: torch.dtype = torch.float32, length: int | None = None) -> tuple:
        return (self.randint(self.shape.vocab_size, BATCH, length or self.shape.block_size, seed=seed),)  # (B, T)

    def owns(self, parameter_name: str) -> bool:
        return parameter_name.startswith("position.")

    def longest_block(self, block_size: int) -> int:
        # A scheme with a position limit cannot be run past it (``flags`` checks that it covers the shape's).
        limit = self.at_block_size(block_size).module(self.seed).max_positions
        return block_size if limit is None else min(block_size, limit)

    def heads(self) -> tuple[int, int]:
        """(query heads, key/value heads): fewer key heads, as grouped-query attention has."""
        H = self.shape.n_heads
        return H, H // 2 if H % 2 == 0 else H

    def probe(self, module: PositionModule, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor | None]:
        """What the module does in each of its three places, on fixed random inputs."""
        T, C, hs = self.shape.block_size, self.shape.d_model, self.shape.head_dim
        H, Hkv = self.heads()
        positions = torch.arange(T, device=self.device)
        x = self.randn(BATCH, T, C, seed=seed, dtype=dtype)                      # (B, T, C)
        q = self.randn(BATCH, H, T, hs, seed=seed + 1, dtype=dtype)              # (B, H, T, hs)
        k = self.randn(BATCH, Hkv, T, hs, seed=seed + 2, dtype=dtype)            # (B, Hkv, T, hs)
        with torch.no_grad():
            rotated_q, rotated_k = module.rotate(q, k, positions)
            # Two queries at the end over every key: the shape of a decoding step's scores.
            bias = module.attention_bias(positions[-2:], positions)
            return {"x": x, "q": q, "k": k, "embed": module.embed(x, positions),
                    "rotate q": rotated_q, "rotate k": rotated_k, "attention_bias": bias}


def flags(subject: PositionSubject) -> None:
    """A module that acts in a place sets that place's flag (attention plugins skip ``rotate`` unless
    ``rotates`` and ``attention_bias`` unless ``biases``); ``max_positions`` covers ``block_size``."""
    module = subject.module(subject.seed)
    out = subject.probe(module, torch.float32, subject.seed + 1)
    if not torch.equal(out["embed"], out["x"]) and not module.adds_embedding:
        fail("embed changes its input but adds_embedding is False")
    if not (torch.equal(out["rotate q"], out["q"]) and torch.equal(out["rotate k"], out["k"])) and not module.rotates:
        fail("rotate changes queries or keys but rotates is False, so attention plugins would never call it")
    if out["attention_bias"] is not None and not module.biases:
        fail("attention_bias returns a tensor but biases is False, so attention plugins would never add it")
    limit = module.max_positions
    if limit is not None and limit < subject.shape.block_size:
        fail(f"max_positions is {limit}, fewer than model.block_size = {subject.shape.block_size}")


def _outputs(subject: PositionSubject, dtype: torch.dtype) -> None:
    kind = str(dtype).removeprefix("torch.")
    module = subject.module(subject.seed).to(dtype)
    out = subject.probe(module, dtype, subject.seed + 1)
    expect_tensor(out["embed"], out["x"].shape, dtype, f"the {kind} output of embed")
    expect_tensor(out["rotate q"], out["q"].shape, dtype, f"the {kind} queries from rotate")
    expect_tensor(out["rotate k"], out["k"].shape, dtype, f"the {kind} keys from rotate (fewer heads than queries)")
    bias = out["attention_bias"]
    if bias is not None:
        T = subject.shape.block_size
        expected = (subject.shape.n_heads, 2, T)
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != expected:
            got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            fail(f"attention_bias of 2 query positions over {T} key positions gave {got}, expected {expected} "
                 "(n_heads, Tq, Tk)")
        if torch.isnan(bias).any() or (bias == float("inf")).any():
            fail(f"the {kind} attention_bias has NaN or +inf values")
    model = subject.build(subject.seed).to(dtype)
    (idx,) = subject.example(subject.seed + 2)
    with torch.no_grad():
        expect_finite(model(idx), f"the {kind} logits of the reference model with this scheme")
    if dtype != torch.float32:
        expected = subject.probe(subject.module(subject.seed), torch.float32, subject.seed + 1)
        for name in ("embed", "rotate q", "rotate k"):
            expect_mostly_close(out[name], expected[name], BF16,
                                f"the {kind} output of {name} differs from the float32 one")


def output_fp32(subject: PositionSubject) -> None:
    """``embed`` keeps the shape and dtype of x (B, T, C), ``rotate`` those of q (B, H, T, hs) and k
    (B, H_kv, T, hs) with H_kv < H, ``attention_bias`` is None or (H, Tq, Tk) without NaN; all finite,
    and the reference model built with the scheme gives finite logits."""
    _outputs(subject, torch.float32)


def output_bf16(subject: PositionSubject) -> None:
    """The same after ``.to(torch.bfloat16)`` with bfloat16 inputs, within 10% of the float32 outputs."""
    _outputs(subject, torch.bfloat16)


@past_length_options
def causality(subject: PositionSubject) -> None:
    """Changing what comes after position t leaves everything up to t unchanged: the output of
    ``embed`` alone, and the logits of the reference model built with the scheme (eval mode)."""
    module, model = subject.module(subject.seed), subject.build(subject.seed)
    x = subject.probe(module, torch.float32, subject.seed + 1)["x"]
    (idx,) = subject.example(subject.seed + 2)
    T = idx.shape[1]
    positions = torch.arange(T, device=subject.device)
    with torch.no_grad():
        embedded, logits = module.embed(x, positions), model(idx)
        for t in (0, T // 2 - 1, T - 2):
            changed = x.clone()
            changed[:, t + 1:] = subject.randn(BATCH, T - t - 1, x.shape[2], seed=subject.seed + 10 + t)
            expect_close(module.embed(changed, positions)[:, :t + 1], embedded[:, :t + 1], INDEPENDENT,
                         f"embed outputs up to position {t} changed when only inputs after {t} did")
            changed = idx.clone()
            changed[:, t + 1:] = subject.randint(subject.shape.vocab_size, BATCH, T - t - 1,
                                                 seed=subject.seed + 10 + t)
            expect_close(model(changed)[:, :t + 1], logits[:, :t + 1], INDEPENDENT,
                         f"with the reference attention, logits up to position {t} changed when only tokens after "
                         f"{t} did")


@past_length_options
def incremental_decoding(subject: PositionSubject) -> None:
    """The reference model built with the scheme gives, fed piece by piece through its inference
    cache (prefill, single steps, chunks), the logits of its full forward. A scheme without a position
    limit is run over twice ``block_size`` tokens, as generation beyond the training context would."""
    model = subject.build(subject.seed)
    length = subject.shape.block_size * (2 if model.max_context is None else 1)
    (idx,) = subject.example(subject.seed + 1, length=length)
    with torch.no_grad():
        full = model(idx)
        cache = model.new_cache(BATCH, length)
        for start, end, what in subject.schedule(length):
            expect_close(model(idx[:, start:end], cache=cache), full[:, start:end], SAME,
                         f"with the reference attention, the cached {what} of positions {start}..{end - 1} differs "
                         "from the full forward", offset=start)


#: name → check, in the order ``check_position`` runs them.
CHECKS = {
    "plugin_class": generic.plugin_class,
    "flags": flags,
    "output_fp32": output_fp32,
    "output_bf16": output_bf16,
    "causality": causality,
    "incremental_decoding": incremental_decoding,
    "gradients": generic.gradients,
    "determinism": generic.determinism,
    "state_dict": generic.state_dict,
    "compile": generic.compiled,
}
