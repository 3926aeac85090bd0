"""Conformance checks of attention plugins (token mixers: softmax attention, state-space layers, ...).

The module of layer 0 is checked on its own, called as the model calls it: ``module(x, ctx)`` in
training and ``module(x, ctx, state)`` with the state from ``new_state`` in cached decoding. The
position scheme in ``ctx`` is, in turn, none at all (``PositionModule()``, whose hooks do nothing)
and :class:`~lmlab.testing.reference.ReferencePositionModule`, which rotates queries and keys and
biases scores, so positions mishandled while decoding show up. A mixer that cannot use such a scheme
(a state-space layer) may refuse it with a ``UserError`` and is checked without one only.

A plugin that declares ``Attention.bidirectional`` is also checked with ``MixerContext.causal`` False:
every output must then depend on every input (and, without positions, not on their order).

Sequences are ``block_size`` long (16 in the default shape). A window, a chunk or any other int option
the plugin's options hold that reaches half of that would never be filled at 16 positions, so the
checks whose outcome depends on the sequence length (causality, incremental_decoding, cache_reorder)
run once more at a block_size past it: 2 × the largest such value + 3, at most 1024, stepping the
cache singly where each int option's value (and twice it) falls; and again with each int option at
the top of its declared (``le``/``lt``) or stated (``ranges=``) range. They read the options under
test, not the class defaults: pass the options that matter (a window of 5, say) to exercise one
that is larger than 510 by default and declares no maximum.
"""

import torch

from lmlab.api import AttentionModule, MixerContext, PositionModule, UserError
from lmlab.testing import generic
from lmlab.testing.common import (BF16, DEPENDENT, INDEPENDENT, SAME, Subject, decoding_schedule, expect_close,
                                  expect_mostly_close, expect_tensor, fail, scale)
from lmlab.testing.lengths import past_length_options
from lmlab.testing.reference import ReferencePositionModule

BATCH = 2


class AttentionSubject(Subject):
    slot = "attention"
    module_type = AttentionModule
    _schemes: list | None = None

    def build(self, seed: int, layer: int = 0) -> AttentionModule:
        return self.built(seed, layer)

    def schemes(self) -> list[tuple[str, PositionModule]]:
        """(description, position module) pairs the mixer is checked under.

        Every mixer must work without a position scheme. One that cannot honour ``rotate`` or
        ``attention_bias`` (a state-space layer has no queries or scores) may refuse such a scheme by
        raising ``lmlab.api.UserError``, as the manifest combining them is a user's mistake; it is then
        checked without one only.
        """
        if self._schemes is None:
            self._schemes = [("no position scheme", PositionModule().to(self.device))]
            reference = ReferencePositionModule(self.shape).to(self.device)
            x = self.randn(1, 2, self.shape.d_model, seed=self.seed)
            try:
                with torch.no_grad():
                    self.build(self.seed)(x, self.context(reference, 0, 2))
                self._schemes.append(("a rotating and biasing position scheme", reference))
            except UserError:
                pass
        return self._schemes

    def context(self, position: PositionModule, start: int, end: int, causal: bool = True) -> MixerContext:
        return MixerContext(position=position, positions=torch.arange(start, end, device=self.device), start=start,
                            causal=causal)

    def example(self, seed: int, dtype: torch.dtype = torch.float32, batch: int = BATCH) -> tuple:
        x = self.randn(batch, self.shape.block_size, self.shape.d_model, seed=seed, dtype=dtype)  # (B, T, C)
        return x, self.context(self.schemes()[-1][1], 0, self.shape.block_size)

    def forward(self, module, args: tuple) -> torch.Tensor:
        x, ctx = args
        return module(x, ctx)

    def grad_input(self, args: tuple) -> torch.Tensor:
        return args[0]


def _outputs(subject: AttentionSubject, dtype: torch.dtype) -> None:
    kind = str(dtype).removeprefix("torch.")
    for layer in range(subject.shape.n_layers):  # a plugin may build different mixers per layer
        module = subject.build(subject.seed, layer).to(dtype)
        x, ctx = subject.example(subject.seed + 1, dtype)
        with torch.no_grad():
            y = module(x, ctx)
            expect_tensor(y, x.shape, dtype, f"layer {layer}: the {kind} output of module(x, ctx)")
            state = module.new_state(BATCH, x.shape[1], subject.device, dtype)
            for start, end, what in decoding_schedule(x.shape[1])[:2]:
                y_step = module(x[:, start:end], subject.context(ctx.position, start, end), state)
                expect_tensor(y_step, x[:, start:end].shape, dtype,
                              f"layer {layer}: the {kind} output of a cached {what}")
        if dtype != torch.float32:
            reference = subject.build(subject.seed, layer)
            with torch.no_grad():
                expected = reference(x.float(), ctx)
            expect_mostly_close(y, expected, BF16, f"layer {layer}: the {kind} output differs from the float32 one")


def output_fp32(subject: AttentionSubject) -> None:
    """Every layer's module maps a float32 (B, T, C) to a finite float32 (B, T, C), in a full forward
    and in cached decoding (a prefill, then a single step)."""
    _outputs(subject, torch.float32)


def output_bf16(subject: AttentionSubject) -> None:
    """After ``module.to(torch.bfloat16)``, a bfloat16 input gives a finite bfloat16 output of the same
    shape (full forward, cached prefill and step, with a bfloat16 state) within 10% of the float32
    output's scale."""
    _outputs(subject, torch.bfloat16)


@past_length_options
def causality(subject: AttentionSubject) -> None:
    """Changing the inputs after position t leaves the outputs at positions up to t unchanged, for
    several t, under each position scheme (eval mode)."""
    module = subject.build(subject.seed)
    x, _ = subject.example(subject.seed + 1)
    T = x.shape[1]
    for label, position in subject.schemes():
        ctx = subject.context(position, 0, T)
        with torch.no_grad():
            y = module(x, ctx)
            for t in (0, T // 2 - 1, T - 2):
                changed = x.clone()
                changed[:, t + 1:] = subject.randn(BATCH, T - t - 1, x.shape[2], seed=subject.seed + 10 + t)
                expect_close(module(changed, ctx)[:, :t + 1], y[:, :t + 1], INDEPENDENT,
                             f"outputs up to position {t} changed when only inputs after {t} did ({label})")


def bidirectional(subject: AttentionSubject) -> None:
    """For a plugin that declares ``Attention.bidirectional``, with ``MixerContext.causal`` False: changing
    the inputs after position t changes the output at every position up to t, for several t, under
    each position scheme; and without a position scheme, permuting the tokens permutes the outputs
    alike (nothing but positions may tell tokens apart, so no mask is left). A plugin that does not
    declare it passes: the core never builds it for a bidirectional objective."""
    declared = getattr(subject.cls, "bidirectional", False)
    if not isinstance(declared, bool):
        fail(f"Attention.bidirectional must be a bool, got {declared!r}")
    if not declared:
        return
    module = subject.build(subject.seed)
    x, _ = subject.example(subject.seed + 1)
    T = x.shape[1]
    for label, position in subject.schemes():
        ctx = subject.context(position, 0, T, causal=False)
        with torch.no_grad():
            y = module(x, ctx)
            for t in (0, T // 2 - 1, T - 2):
                changed = x.clone()
                changed[:, t + 1:] = subject.randn(BATCH, T - t - 1, x.shape[2], seed=subject.seed + 10 + t)
                moved = (module(changed, ctx)[:, :t + 1] - y[:, :t + 1]).abs().flatten(2).amax(dim=(0, 2))  # (t+1,)
                still = (moved <= DEPENDENT * scale(y)).nonzero()
                if len(still):
                    p = still[0].item()
                    fail(f"with MixerContext.causal False, the output at position {p} did not change when the inputs "
                         f"after {t} did (by {moved[p].item():.3g}, output scale {scale(y):.3g}; {label}): the "
                         "plugin declares bidirectional = True but does not attend to later tokens")
    ctx = subject.context(subject.schemes()[0][1], 0, T, causal=False)
    order = torch.randperm(T, generator=torch.Generator().manual_seed(subject.seed)).to(subject.device)
    with torch.no_grad():
        expect_close(module(x[:, order], ctx), module(x, ctx)[:, order], SAME,
                     "with MixerContext.causal False and no position scheme, permuting the tokens did not permute "
                     "the outputs alike (a mask or an order-dependent weighting is left)")


@past_length_options
def incremental_decoding(subject: AttentionSubject) -> None:
    """Feeding the sequence piece by piece with the state from ``new_state`` (a prefill, single steps,
    multi-token chunks after the state holds tokens) gives the outputs of the full forward, under each
    position scheme."""
    module = subject.build(subject.seed)
    x, _ = subject.example(subject.seed + 1)
    T = x.shape[1]
    for label, position in subject.schemes():
        with torch.no_grad():
            full = module(x, subject.context(position, 0, T))
            state = module.new_state(BATCH, T, subject.device, x.dtype)
            for start, end, what in subject.schedule(T):
                y = module(x[:, start:end], subject.context(position, start, end), state)
                expect_close(y, full[:, start:end], SAME,
                             f"the cached {what} of positions {start}..{end - 1} differs from the full forward "
                             f"({label})", offset=start)


@past_length_options
def cache_reorder(subject: AttentionSubject) -> None:
    """``state.reorder(index)`` (beam search re-ranking rows, repeating some) after a prefill, then
    decoding on, gives the full forward of the reordered batch."""
    module = subject.build(subject.seed)
    x, _ = subject.example(subject.seed + 1, batch=3)
    T, position = x.shape[1], subject.schemes()[-1][1]
    index = torch.tensor([2, 0, 0], device=subject.device)
    pieces = subject.schedule(T)
    with torch.no_grad():
        full = module(x.index_select(0, index), subject.context(position, 0, T))
        state = module.new_state(3, T, subject.device, x.dtype)
        if not callable(getattr(state, "reorder", None)):
            fail(f"new_state returned a {type(state).__name__} without reorder(index) (see lmlab.api.LayerState)")
        start, end, _ = pieces[0]
        module(x[:, start:end], subject.context(position, start, end), state)
        state.reorder(index)
        x = x.index_select(0, index)
        for start, end, what in pieces[1:]:
            y = module(x[:, start:end], subject.context(position, start, end), state)
            expect_close(y, full[:, start:end], SAME, f"after state.reorder({index.tolist()}), the cached {what} of "
                         f"positions {start}..{end - 1} differs from the full forward of the reordered batch",
                         offset=start)


def ragged_decoding(subject: AttentionSubject) -> None:
    """A module that gives a ``kv_layout`` (API 1.8), fed as the core's engine feeds it: rows of
    different lengths in one shared cache, each prefilled alone, then decoded together one token per
    step with per-row positions and ``ctx.key_mask``; every output equals the full forward of its
    row alone, under each position scheme. Modules without a layout are not checked."""
    from lmlab.generation.kv import ContiguousKV, Plan

    module = subject.build(subject.seed)
    layout = module.kv_layout()
    if layout is None:
        return
    x, _ = subject.example(subject.seed + 1, batch=3)
    T = x.shape[1]
    prompts = [max(1, T // 2), 1, max(1, T - 4)]  # tokens each row holds before the steps
    device = subject.device
    for label, position in subject.schemes():
        with torch.no_grad():
            full = [module(x[r:r + 1], subject.context(position, 0, T)) for r in range(3)]  # (1, T, C) each
            store = ContiguousKV([layout], 3, T, device, x.dtype)
            lengths = list(prompts)
            for r, n in enumerate(prompts):
                positions = torch.arange(n, device=device)[None]                     # (1, n)
                store.plan = Plan(torch.tensor([r], device=device), positions, n, leading=False)
                mask = (torch.arange(n, device=device)[None, :] <= positions[0][:, None])[None, None]
                ctx = MixerContext(position=position, positions=positions, start=0, key_mask=mask)
                y = module(x[r:r + 1, :n], ctx, store.views[0])
                expect_close(y, full[r][:, :n], SAME, f"a prefill of {n} tokens into row {r} of a shared cache "
                             f"(per-row positions, key_mask) differs from the full forward ({label})")
            while min(lengths) < T:
                rows = [r for r in range(3) if lengths[r] < T]
                starts = torch.tensor([lengths[r] for r in rows], device=device)
                positions = starts[:, None]                                            # (B, 1)
                span = max(lengths[r] for r in rows) + 1
                store.plan = Plan(torch.tensor(rows, device=device), positions, span, leading=False)
                mask = (torch.arange(span, device=device)[None, :] <= positions)[:, None, None, :]
                ctx = MixerContext(position=position, positions=positions, start=0, key_mask=mask)
                tokens = torch.stack([x[r, lengths[r]] for r in rows])[:, None]        # (B, 1, C)
                y = module(tokens, ctx, store.views[0])
                for i, r in enumerate(rows):
                    expect_close(y[i:i + 1], full[r][:, lengths[r]:lengths[r] + 1], SAME,
                                 f"decoding rows of lengths {[lengths[q] for q in rows]} together, row {r}'s "
                                 f"position {lengths[r]} differs from its full forward ({label})")
                    lengths[r] += 1


#: name → check, in the order ``check_attention`` runs them.
def cross_attention(subject: AttentionSubject) -> None:
    """For a plugin that declares ``Attention.cross_attention`` (API 1.13): ``build_cross`` makes a
    ``CrossAttentionModule`` mapping (B, T, C) to (B, T, C) over a memory (B, S, C); every output sees
    every memory position and no other query's token; padded memory positions change nothing (the
    output equals the one over the memory without them); and the decoding path, ``memory_kv`` once and
    then ``state``, gives the direct path's outputs."""
    from lmlab.api import CrossAttentionModule

    declared = getattr(subject.cls, "cross_attention", False)
    if not isinstance(declared, bool):
        fail(f"Attention.cross_attention must be a bool, got {declared!r}")
    if not declared:
        return
    plugin = subject.plugin()
    torch.manual_seed(subject.seed)
    module = plugin.build_cross(subject.shape, 0).to(subject.device).eval()
    if not isinstance(module, CrossAttentionModule):
        fail(f"build_cross returned a {type(module).__name__}, not an lmlab.api.CrossAttentionModule")
    x, _ = subject.example(subject.seed + 1)
    B, T, C = x.shape
    S = 7
    memory = subject.randn(B, S, C, seed=subject.seed + 2)
    none = PositionModule().to(subject.device)

    def run(x, memory, padding=None, state=None):
        ctx = MixerContext(position=none, positions=torch.arange(T, device=subject.device),
                           memory=None if state is not None else memory, memory_padding=padding)
        with torch.no_grad():
            return module(x, ctx, state)

    y = run(x, memory)
    expect_tensor(y, x.shape, torch.float32, "the output of a cross-attention module")
    for s in (0, S // 2, S - 1):
        changed = memory.clone()
        changed[:, s] = subject.randn(B, C, seed=subject.seed + 20 + s)
        moved = (run(x, changed) - y).abs().amax(dim=(0, 2))  # (T,)
        if (moved <= DEPENDENT * scale(y)).any():
            fail(f"changing memory position {s} left some outputs unchanged: every query must see every "
                 "unpadded encoder position")
    changed = x.clone()
    changed[:, T // 2] = subject.randn(B, C, seed=subject.seed + 30)
    keep = [t for t in range(T) if t != T // 2]
    expect_close(run(changed, memory)[:, keep], y[:, keep], INDEPENDENT,
                 "changing one decoder token changed the cross-attention output at other positions")
    padding = torch.zeros(B, S, dtype=torch.bool, device=subject.device)
    padding[:, 4:] = True
    garbage = memory.clone()
    garbage[:, 4:] = subject.randn(B, S - 4, C, seed=subject.seed + 40)
    padded = run(x, memory, padding)
    expect_close(run(x, garbage, padding), padded, SAME, "padded memory positions (memory_padding True) changed "
                 "the output")
    expect_close(padded, run(x, memory[:, :4]), INDEPENDENT, "the output over padded memory differs from the one "
                 "over the memory without its padding")
    with torch.no_grad():
        state = module.memory_kv(memory)
    expect_close(run(x, None, padding, state=state), padded, INDEPENDENT,
                 "attending over memory_kv's keys and values (the decoding path) differs from the direct path")


CHECKS = {
    "plugin_class": generic.plugin_class,
    "output_fp32": output_fp32,
    "output_bf16": output_bf16,
    "causality": causality,
    "bidirectional": bidirectional,
    "incremental_decoding": incremental_decoding,
    "cache_reorder": cache_reorder,
    "ragged_decoding": ragged_decoding,
    "cross_attention": cross_attention,
    "gradients": generic.gradients,
    "determinism": generic.determinism,
    "state_dict": generic.state_dict,
    "compile": generic.compiled,
}
