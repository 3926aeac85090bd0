"""Conformance checks of architecture plugins (how the position, attention and ffn modules are wired).

The plugin builds its model from the kit's reference position, attention and ffn
(:mod:`lmlab.testing.reference`) on the tiny default shape, once for each family it declares that the
kit can build: ``decoder`` (a causal model, trained here with next-token cross-entropy) and
``encoder`` (bidirectional, ``shape.causal`` False, trained on random targets). An architecture that
builds only encoder–decoder models gets the class checks only: the kit has no reference
cross-attention to build one with.

The kit's attention and ffn plugins remember every module they build, so the checks find them
whatever the wiring: that the model's blocks expose them as ``attn`` and ``ffn`` (which tensor
parallelism, FSDP, PEFT roles, head pruning and decoding caches read), and that every auxiliary loss
they set reaches ``model.aux_loss()``.
"""

import dataclasses
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.api import AttentionModule, FFNModule, ModelParts, ModelShape
from lmlab.api.architecture import CHECKPOINTING, FAMILIES
from lmlab.testing import generic
from lmlab.testing.common import INDEPENDENT, CheckFailed, Subject, expect_close, expect_tensor, fail, scale
from lmlab.testing.reference import ReferenceAttention, ReferenceFFN, ReferenceMLP, ReferencePosition

BATCH = 2
#: The families the kit builds models of, in the order it checks them.
BUILDABLE = ("decoder", "encoder")
#: Cached decoding against the full forward; checkpointing (a recomputation of the same float32 ops)
#: against none: the loss and each gradient, relative to its scale.
DECODING = 1e-5
RECOMPUTED = 1e-6


class RecordingAttention(ReferenceAttention):
    """The reference attention, remembering each module it builds."""

    def __init__(self, options=None):
        super().__init__(options)
        self.modules: list[AttentionModule] = []

    def build(self, shape: ModelShape, layer: int):
        module = super().build(shape, layer)
        self.modules.append(module)
        return module


class AuxMLP(ReferenceMLP):
    """The reference MLP, also setting ``aux_loss`` (a small penalty on its output) as a router's
    balance loss does, so the kit can see whether the model collects it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        self.aux_loss = 0.01 * y.float().pow(2).mean()
        return y


class RecordingFFN(ReferenceFFN):
    """The reference ffn (with ``aux_loss`` when ``aux``), remembering each module it builds."""

    def __init__(self, options=None, aux: bool = False):
        super().__init__(options)
        self.aux = aux
        self.modules: list[FFNModule] = []

    def build(self, shape: ModelShape, layer: int):
        module = AuxMLP(shape) if self.aux else super().build(shape, layer)
        self.modules.append(module)
        return module


@dataclasses.dataclass
class Built:
    """A model the plugin built, with the kit's plugins it was built from."""

    model: nn.Module
    attention: RecordingAttention
    ffn: RecordingFFN
    family: str


class ArchitectureSubject(Subject):
    slot = "architecture"

    def families(self) -> list[str]:
        """The families the plugin declares that the kit can build."""
        return [f for f in BUILDABLE if f in tuple(getattr(self.cls, "families", ()))]

    def instance(self):
        """The plugin, with the plugins its options' nested tables name built as a run builds them."""
        from lmlab.composition import resolve
        from lmlab.variant import Choice

        return resolve(Choice(self.cls, self.options), "architecture", Path.cwd()).build()

    def model(self, family: str, seed: int | None = None, aux: bool = False) -> Built:
        """The plugin's model of ``family``, built from the kit's reference plugins under ``seed``, on the
        device, in eval mode."""
        from lmlab.variant import components_of

        plugin = self.instance()
        shape = self.shape if family == "decoder" else dataclasses.replace(self.shape, causal=False)
        attention, ffn = RecordingAttention(), RecordingFFN(aux=aux)
        parts = ModelParts(shape=shape, family=family, position=ReferencePosition(), attention=attention, ffn=ffn,
                           components=components_of(plugin))
        with self.seeded(self.seed if seed is None else seed):
            model = plugin.build(parts)
        if not isinstance(model, nn.Module):
            fail(f"build(parts) returned {type(model).__name__}, not an nn.Module (return a "
                 "lmlab.api.architecture.Stack, or a module with the lmlab.api.LanguageModel interface)")
        return Built(model.to(self.device).eval(), attention, ffn, family)

    def build(self, seed: int) -> nn.Module:
        return self.model(self.families()[0], seed).model

    def example(self, seed: int, dtype: torch.dtype = torch.float32) -> tuple:
        return (self.randint(self.shape.vocab_size, BATCH, self.shape.block_size, seed=seed),)  # (B, T)


def per_family(check):
    """Run ``check(subject, family)`` for each family the kit builds, naming the family in a failure."""

    @functools.wraps(check)
    def run(subject: ArchitectureSubject) -> None:
        for family in subject.families():
            try:
                check(subject, family)
            except CheckFailed as exc:
                raise CheckFailed(f"the {family} model: {exc}") from None

    return run


def families(subject: ArchitectureSubject) -> None:
    """``families`` is a non-empty tuple of lmlab.api.architecture.FAMILIES, and ``family`` picks each
    of them for an objective that trains it."""
    declared = getattr(subject.cls, "families", None)
    if not isinstance(declared, tuple) or not declared:
        fail(f"families is {declared!r}; declare a non-empty tuple of {FAMILIES}")
    unknown = [f for f in declared if f not in FAMILIES]
    if unknown:
        fail(f"families names {unknown}, which are none of {FAMILIES}")
    plugin = subject.instance()
    for family in declared:
        chosen = plugin.family((family,), "kit")
        if chosen != family:
            fail(f"family(({family!r},), ...) gave {chosen!r} although families declares {family!r}")


@per_family
def language_model(subject: ArchitectureSubject, family: str) -> None:
    """The model has the lmlab.api.LanguageModel interface: ``vocab_size`` and ``block_size`` of the
    shape; ``model(idx)`` maps int64 (B, T) to float32 (B, T, V) logits and ``model(idx, hidden=True)``
    to (B, T, C); a decoder's ``new_cache`` gives a cache, an encoder's raises ValueError (a
    bidirectional model cannot decode left to right)."""
    model = subject.model(family).model
    shape = subject.shape
    for attribute, expected in (("vocab_size", shape.vocab_size), ("block_size", shape.block_size)):
        if getattr(model, attribute, None) != expected:
            fail(f"model.{attribute} is {getattr(model, attribute, None)!r}, expected {expected} (the shape's); "
                 "decoding and evaluation read it (a Stack sets it)")
    (idx,) = subject.example(subject.seed + 1)
    B, T = idx.shape
    with torch.no_grad():
        expect_tensor(model(idx), (B, T, shape.vocab_size), torch.float32, "model(idx), the logits,")
        expect_tensor(model(idx, hidden=True), (B, T, shape.d_model), torch.float32,
                      "model(idx, hidden=True), the final norm's output,")
    if not callable(getattr(model, "new_cache", None)):
        fail("the model has no new_cache(batch_size, max_len) (lmlab.api.LanguageModel)")
    if family == "decoder":
        model.new_cache(B, T)
        return
    try:
        model.new_cache(B, T)
    except ValueError:
        return
    fail("new_cache gave a cache for a bidirectional model; raise ValueError: it cannot decode left to right")


@per_family
def incremental_decoding(subject: ArchitectureSubject, family: str) -> None:
    """A causal decoder fed through ``new_cache`` (a prefill, single steps and chunks) gives the full
    forward's logits at every position, within 1e-5 of their scale."""
    if family != "decoder":
        return
    model = subject.model(family).model
    (idx,) = subject.example(subject.seed + 1)
    T = idx.shape[1]
    with torch.no_grad():
        full = model(idx)
        cache = model.new_cache(idx.shape[0], T)
        for start, end, kind in subject.schedule(T):
            expect_close(model(idx[:, start:end], cache=cache), full[:, start:end], DECODING,
                         f"the logits of a cached {kind} over positions {start}..{end - 1} differ from the full "
                         "forward's", offset=start,
                         hint="does every block pass its own state (cache.states[i]) to its mixer, and the model "
                              "read cache.length as the start position?")


@per_family
def causality(subject: ArchitectureSubject, family: str) -> None:
    """Decoder: changing the tokens after position t leaves the logits up to t unchanged (within 1e-5 of
    their scale). Encoder: changing the last token moves earlier positions' logits by more than that (the
    family asks for a bidirectional model, ``shape.causal`` False)."""
    model = subject.model(family).model
    (idx,) = subject.example(subject.seed + 1)
    B, T = idx.shape
    with torch.no_grad():
        logits = model(idx)
        if family == "encoder":
            changed = idx.clone()
            changed[:, -1] = (idx[:, -1] + 1) % subject.shape.vocab_size
            # At init the blocks' branches are small, so an encoder's earlier logits may move little: any
            # move past the causal check's tolerance shows the model reads later tokens.
            moved = (model(changed)[:, :-1] - logits[:, :-1]).abs().max().item()
            if moved <= INDEPENDENT * scale(logits):
                fail(f"changing the last token moved the earlier positions' logits by only {moved:.3g} (scale "
                     f"{scale(logits):.3g}): the model is causal, but the encoder family is bidirectional (build it "
                     "with causal=False when parts.family is not 'decoder', as parts.shape.causal says)")
            return
        for t in (0, T // 2 - 1, T - 2):
            changed = idx.clone()
            changed[:, t + 1:] = subject.randint(subject.shape.vocab_size, B, T - t - 1, seed=subject.seed + 10 + t)
            expect_close(model(changed)[:, :t + 1], logits[:, :t + 1], INDEPENDENT,
                         f"the logits up to position {t} changed when only the tokens after {t} did",
                         hint="a decoder block must not see later tokens: does a block mix positions outside its "
                              "mixer, or build the mixer's context with causal=False?")


def _loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, family: str) -> torch.Tensor:
    """The kit's reference objective: next-token cross-entropy for a decoder, the targets' for an
    encoder, plus the model's auxiliary losses."""
    logits = model(idx)
    if family == "decoder":
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), idx[:, 1:].flatten())
    else:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    aux = model.aux_loss() if callable(getattr(model, "aux_loss", None)) else None
    return loss if aux is None else loss + aux


def _backward(model: nn.Module, idx, targets, family: str) -> tuple[torch.Tensor, dict, int]:
    """The loss, each trainable parameter's gradient and how many elements autograd kept for backward
    outside activation checkpointing (a checkpointed region keeps its own, recomputed ones)."""
    saved = 0

    def pack(tensor):
        nonlocal saved
        saved += tensor.numel()
        return tensor

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = _loss(model, idx, targets, family)
    loss.backward()
    grads = {name: p.grad.detach().clone() if p.grad is not None else None
             for name, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, saved


@per_family
def checkpointing(subject: ArchitectureSubject, family: str) -> None:
    """In training mode, ``set_checkpointing(p)`` for every p of CHECKPOINTING sets each block's
    ``checkpointing`` to p and leaves the loss and every parameter's gradient as under ``"none"`` (within
    1e-6 of their scale); ``"full"`` keeps fewer activations for backward than ``"none"`` (the block's
    forward honours it)."""
    model = subject.model(family).model.train()
    if not callable(getattr(model, "set_checkpointing", None)):
        fail("the model has no set_checkpointing(policy) (a Stack has it); train.checkpointing calls it")
    (idx,) = subject.example(subject.seed + 1)
    targets = subject.randint(subject.shape.vocab_size, *idx.shape, seed=subject.seed + 2)
    reference = None
    for policy in ("none", *(p for p in CHECKPOINTING if p != "none")):
        model.set_checkpointing(policy)
        for i, block in enumerate(getattr(model, "blocks", ())):
            if getattr(block, "checkpointing", policy) != policy:
                fail(f"set_checkpointing({policy!r}) left block {i}'s checkpointing at "
                     f"{block.checkpointing!r}")
        with subject.seeded(subject.seed + 3):  # dropout, if any, draws the same masks
            loss, grads, saved = _backward(model, idx, targets, family)
        if reference is None:
            reference = loss, grads, saved
            continue
        what = f"with set_checkpointing({policy!r})"
        if (loss - reference[0]).abs().item() > RECOMPUTED * scale(reference[0]):
            fail(f"{what} the training loss is {loss.item():.8g}, under 'none' {reference[0].item():.8g}: "
                 "a checkpointed part must compute what the plain forward computes")
        for name, expected in reference[1].items():
            got = grads.get(name)
            if (got is None) != (expected is None):
                fail(f"{what} parameter {name} {'gets no' if got is None else 'gets a'} gradient, under 'none' "
                     f"{'it does' if got is None else 'none'}")
            if got is not None and (got - expected).abs().max().item() > RECOMPUTED * scale(expected):
                fail(f"{what} the gradient of {name} differs from the one under 'none' by "
                     f"{(got - expected).abs().max().item():.3g} (scale {scale(expected):.3g}): does a "
                     "checkpointed part compute something else than the plain forward?")
        if policy == "full" and saved >= reference[2]:
            fail(f"{what} autograd kept {saved} elements for backward, as many as under 'none' ({reference[2]}): "
                 "the blocks' forward ignores self.checkpointing; under 'full' run the block through "
                 "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) in training")


@per_family
def param_infos(subject: ArchitectureSubject, family: str) -> None:
    """``model.param_infos()`` lists every trainable parameter exactly once (by identity), under its
    ``named_parameters`` name, and ``model.num_params()`` counts every parameter once."""
    model = subject.model(family).model
    if not callable(getattr(model, "param_infos", None)):
        fail("the model has no param_infos() (lmlab.api.architecture.param_infos(model) gives it)")
    trainable = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    seen: dict[int, str] = {}
    for info in model.param_infos():
        key = id(info.param)
        if key in seen:
            fail(f"param_infos() lists the parameter {trainable.get(key, info.name)} twice ({seen[key]!r} and "
                 f"{info.name!r}): the optimizer would update it twice")
        if key not in trainable:
            fail(f"param_infos() lists {info.name!r}, which is no trainable parameter of the model")
        seen[key] = info.name
    missing = [name for key, name in trainable.items() if key not in seen]
    if missing:
        fail(f"param_infos() leaves out the trainable parameters {', '.join(missing[:5])}"
             f"{' ...' if len(missing) > 5 else ''}: the optimizer would never update them "
             "(lmlab.api.architecture.param_infos(model) lists them all)")
    expected = sum(p.numel() for p in model.parameters())
    if callable(getattr(model, "num_params", None)) and model.num_params() != expected:
        fail(f"num_params() is {model.num_params()}, but the model has {expected} parameter elements "
             "(lmlab.api.architecture.num_params(model) counts them)")


@per_family
def aux_loss(subject: ArchitectureSubject, family: str) -> None:
    """With an ffn whose modules set a tensor ``aux_loss`` in their forward (as a mixture of experts'
    balance loss), ``model.aux_loss()`` after a training forward is their sum (within 1e-6)."""
    built = subject.model(family, aux=True)
    model = built.model.train()
    (idx,) = subject.example(subject.seed + 1)
    for module in built.ffn.modules:
        module.aux_loss = None
    with torch.no_grad():
        model(idx)
    ran = [m.aux_loss for m in built.ffn.modules if m.aux_loss is not None]
    if not ran:
        fail("no ffn module built by parts.ffn ran in the forward: the blocks must call their ffn")
    expected = torch.stack(ran).sum()
    got = model.aux_loss() if callable(getattr(model, "aux_loss", None)) else "missing"
    if not isinstance(got, torch.Tensor):
        fail(f"model.aux_loss() is {got!r} after a forward in which {len(ran)} ffn modules set aux_loss: sum every "
             "module's tensor aux_loss (a Stack does), and keep each ffn a registered submodule (block.ffn)")
    if (got.detach().float() - expected).abs().item() > RECOMPUTED * scale(expected):
        fail(f"model.aux_loss() is {got.item():.6g}, but the {len(ran)} ffn modules that ran set aux_loss summing "
             f"to {expected.item():.6g}: is some module's aux_loss left out (or counted twice)?")


@per_family
def block_contract(subject: ArchitectureSubject, family: str) -> None:
    """``model.blocks`` holds the blocks; each has ``attn``, an AttentionModule, ``ffn``, an FFNModule,
    and ``checkpointing``; every module parts.attention and parts.ffn built is some block's ``attn`` or
    ``ffn``."""
    built = subject.model(family)
    blocks = getattr(built.model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not len(blocks):
        fail("the model has no model.blocks (an nn.ModuleList of its blocks), which decoding caches, pipeline "
             "stages and parallel plugins read")
    why = "(tensor parallelism, FSDP, PEFT roles, head pruning and decoding caches look for it there)"
    for i, block in enumerate(blocks):
        if not isinstance(getattr(block, "attn", None), AttentionModule):
            fail(f"block {i} has no attn, its mixer as an lmlab.api.AttentionModule {why}")
        if not isinstance(getattr(block, "ffn", None), FFNModule):
            fail(f"block {i} has no ffn, its feed-forward as an lmlab.api.FFNModule {why}")
        if getattr(block, "checkpointing", None) not in CHECKPOINTING:
            fail(f"block {i}'s checkpointing is {getattr(block, 'checkpointing', None)!r}, not one of {CHECKPOINTING} "
                 "(set it to 'none' in __init__; set_checkpointing changes it)")
    attns = {id(block.attn) for block in blocks}
    ffns = {id(block.ffn) for block in blocks}
    for kind, modules, exposed in (("attn", built.attention.modules, attns), ("ffn", built.ffn.modules, ffns)):
        hidden = sum(id(m) not in exposed for m in modules)
        if hidden:
            fail(f"{hidden} of the {len(modules)} modules parts.{'attention' if kind == 'attn' else 'ffn'} built "
                 f"are no block's {kind} {why}")


#: name → check, in the order ``check_architecture`` runs them.
CHECKS = {
    "plugin_class": generic.plugin_class,
    "families": families,
    "language_model": language_model,
    "block_contract": block_contract,
    "causality": causality,
    "incremental_decoding": incremental_decoding,
    "checkpointing": checkpointing,
    "param_infos": param_infos,
    "aux_loss": aux_loss,
}
