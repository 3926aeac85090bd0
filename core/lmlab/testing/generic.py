"""Checks every architecture slot shares: the plugin class, gradients, determinism, the state dict and
``torch.compile``. Each takes a :class:`~lmlab.testing.common.Subject` and fails with what it saw.
"""

import contextlib
import copy
import logging
import os
from collections.abc import Iterator
from types import SimpleNamespace

import pydantic
import torch

from lmlab.api import SLOT_BASES
from lmlab.errors import UserError
from lmlab.plugin_check import check_plugin_class
from lmlab.testing.common import INDEPENDENT, SAME, Subject, difference, expect_close, fail, reloaded, scale


def verify_class(cls, slot: str, options=None) -> None:
    """The slot contract of a plugin class, as discovery checks it when a manifest names the plugin."""
    base = SLOT_BASES.get(slot)
    if base is None:
        fail(f"unknown slot {slot!r}; known slots: {', '.join(SLOT_BASES)}")
    # The same contract discovery enforces when a manifest names the plugin: one implementation.
    name = getattr(cls, "name", "") or getattr(cls, "__name__", repr(cls))
    info = SimpleNamespace(name=name, distribution="(under test)", version="",
                           target=f"{getattr(cls, '__module__', '?')}:{getattr(cls, '__qualname__', name)}")
    try:
        check_plugin_class(cls, slot, info, key=f"{slot}.use")
    except UserError as exc:
        fail(str(exc))
    if options is None:
        try:
            options = cls.Options()
        except pydantic.ValidationError as exc:
            fail(f"{cls.Options.__name__}() fails without arguments; every option needs a default: "
                 f"{' '.join(str(exc).split())}")
    cls(options)


def plugin_class(subject: Subject) -> None:
    """Derives from its slot's base in lmlab.api, declares an api range that includes this
    lmlab.api.API_VERSION, has an Options subclass of lmlab.api.Options that validates the options under
    test (or builds with every default), valid hook implementations, and is constructible."""
    verify_class(subject.cls, subject.slot, subject.options if subject.raw_options is not None else None)


def gradients(subject: Subject) -> None:
    """In training mode, a backward of a random projection of the output (plus any auxiliary loss the
    module reports) gives every trainable parameter of the plugin, and the floating-point input, a
    finite gradient that is not all zero. A parameter that only a zero-initialised weight hides (a
    zero-init output projection) passes: the check retries once after perturbing every weight.
    A module that stands for "no ffn" (``FFNModule.skip``) is never run by the model: nothing to check."""
    module = subject.build(subject.seed).train()
    if getattr(module, "skip", False):
        return
    problems = _backward_problems(subject, module)
    if problems and not any("non-finite" in p for p in problems):
        with torch.no_grad(), subject.seeded(subject.seed + 7):
            for p in module.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        problems = _backward_problems(subject, module)
    if problems:
        shown = ", ".join(problems[:6]) + (f" and {len(problems) - 6} more" if len(problems) > 6 else "")
        fail(f"after a backward in training mode: {shown} (a parameter unused in forward, a detached "
             "path, or an expert that received no token?)")


def _backward_problems(subject: Subject, module: torch.nn.Module) -> list[str]:
    module.zero_grad(set_to_none=True)
    args = subject.example(subject.seed + 1)
    x = subject.grad_input(args)
    if x is not None:
        x.requires_grad_(True)
    loss, _ = _loss(subject, module, args)
    loss.backward()
    problems = []
    named = [("input", x)] if x is not None else []
    named += [(n, p) for n, p in module.named_parameters() if p.requires_grad and subject.owns(n)]
    for name, p in named:
        if p.grad is None:
            problems.append(f"{name} got no gradient")
        elif not torch.isfinite(p.grad).all():
            problems.append(f"{name} got a non-finite gradient")
        elif not p.grad.any():
            problems.append(f"{name} got an all-zero gradient")
    return problems


def _loss(subject: Subject, module: torch.nn.Module, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, output): a random projection of the output (a plain sum can cancel, e.g. after a
    normalisation), plus the auxiliary loss the module reports."""
    out = subject.forward(module, args)
    weights = subject.randn(*out.shape, seed=subject.seed + 2)
    loss = (out.float() * weights).sum()
    aux = subject.aux_loss(module)
    if aux is not None:
        if not (isinstance(aux, torch.Tensor) and aux.numel() == 1 and torch.isfinite(aux).all()):
            fail(f"aux_loss must be a finite scalar tensor; got {aux!r}")
        loss = loss + aux.float().sum()
    return loss, out


def determinism(subject: Subject) -> None:
    """Two builds under one seed have identical parameters and buffers and give identical outputs,
    and two eval-mode forwards of one module on one input are identical."""
    a, b = subject.build(subject.seed), subject.build(subject.seed)
    state_a, state_b = a.state_dict(), b.state_dict()
    for name, value in state_a.items():
        if name not in state_b or not torch.equal(value, state_b[name]):
            fail(f"{name} differs between two builds under seed {subject.seed}: does initialisation draw "
                 "from a random source other than torch's seeded generator?")
    args = subject.example(subject.seed + 1)
    with torch.no_grad():
        first, second, other = subject.forward(a, args), subject.forward(a, args), subject.forward(b, args)
    s = scale(first)
    if difference(second, first) > INDEPENDENT * s:
        fail(f"two eval-mode forwards of one module on one input differ by {difference(second, first):.3g} "
             f"(output scale {s:.3g}): does forward draw random numbers outside training?")
    if difference(other, first) > INDEPENDENT * s:
        fail(f"two builds under seed {subject.seed} give outputs that differ by {difference(other, first):.3g} "
             f"(output scale {s:.3g}), though their state dicts are identical")


def state_dict(subject: Subject) -> None:
    """The state dict survives ``torch.save`` and ``torch.load(weights_only=True)``, a build under
    another seed accepts it (strictly), and then gives the same outputs as the module it came from."""
    source, target = subject.build(subject.seed), subject.build(subject.seed + 1)
    loaded = reloaded(source.state_dict())
    try:
        target.load_state_dict(loaded)
    except RuntimeError as exc:
        fail(f"a fresh build refuses the state dict of another: {' '.join(str(exc).split())}")
    args = subject.example(subject.seed + 1)
    with torch.no_grad():
        expected, actual = subject.forward(source, args), subject.forward(target, args)
    expect_close(actual, expected, SAME, "after loading another build's state dict, the output differs from that "
                 "build's", hint="is some state a plain tensor attribute, not a parameter or registered buffer?")


def compiled(subject: Subject) -> None:
    """``torch.compile(module, backend=compile_backend)`` ("aot_eager" by default: it traces forward
    and backward like the default inductor backend, without generating code) gives the eager output
    and the eager gradients of every parameter, in training mode. Resets torch.compile's caches first."""
    with _quiet_torch_trace():
        _compiled(subject)


def _compiled(subject: Subject) -> None:
    torch.compiler.reset()  # a plugin class compiled for many option sets would hit the recompile limit
    eager = subject.build(subject.seed).train()
    if getattr(eager, "skip", False):  # never run by the model (FFNModule.skip)
        return
    module = copy.deepcopy(eager)
    optimized = torch.compile(module, backend=subject.compile_backend)
    args = subject.example(subject.seed + 1)
    with subject.seeded(subject.seed):
        expected_loss, expected = _loss(subject, eager, args)
    with subject.seeded(subject.seed):
        actual_loss, actual = _loss(subject, optimized, args)
    expect_close(actual, expected, SAME, f"the output compiled with backend {subject.compile_backend!r} "
                                         "differs from the eager output")
    expected_loss.backward()
    actual_loss.backward()
    grads = dict(module.named_parameters())
    for name, p in eager.named_parameters():
        if p.grad is None or not subject.owns(name):
            continue
        q = grads[name].grad
        if q is None or difference(q, p.grad) > SAME * scale(p.grad):
            fail(f"the gradient of {name} compiled with backend {subject.compile_backend!r} differs from the "
                 f"eager one" + ("" if q is None else f" by {difference(q, p.grad):.3g} (scale {scale(p.grad):.3g})"))


@contextlib.contextmanager
def _quiet_torch_trace() -> Iterator[None]:
    """Silence torch's structured-trace logger ("torch.__trace") while the kit compiles.

    torch keeps that logger at DEBUG for TORCH_TRACE (tlparse) and stops it propagating; pytest (9 here)
    attaches its capture handler to non-propagating loggers too, so each failing test that compiled
    would print some 80 empty DEBUG records. Left alone when the user asked for a trace (TORCH_TRACE).
    """
    trace = logging.getLogger("torch.__trace")
    if os.environ.get("TORCH_TRACE"):
        yield
        return
    level = trace.level
    # torch replaces the logger's isEnabledFor with ``level >= trace.level``, so its level is the switch
    # (logging.disable would not reach it).
    trace.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        trace.setLevel(level)
