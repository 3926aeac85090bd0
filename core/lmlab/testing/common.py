"""What every slot's checks share: the error type, named checks, the plugin under test and numerics.

A :class:`Subject` is one plugin class with one set of options, seen through its slot: it knows how
to build the plugin's module under a seed, make example inputs and run a forward pass. The generic
checks in ``lmlab.testing.generic`` need nothing else, so each slot module only adds a ``Subject``
subclass and the checks that are particular to the slot.
"""

import contextlib
import copy
import dataclasses
import io
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import pydantic
import torch
from torch import nn

from lmlab.api import ModelShape, Options, Plugin, UserError
from lmlab.testing.schedule import decoding_schedule

#: The shape every check builds against unless a test passes its own: tiny, so the kit runs in seconds.
DEFAULT_SHAPE = ModelShape(n_layers=2, d_model=32, n_heads=4, block_size=16, vocab_size=37)

# Tolerances are relative to the largest magnitude of the reference output (a module initialised with
# std 0.02 may give outputs of 1e-3, where any absolute tolerance would be meaningless).
INDEPENDENT = 1e-5  # outputs that must not depend on a change at all (causality, position-wise)
SAME = 1e-4  # two computations of one function in float32 (cache vs full forward, compiled vs eager)
BF16 = 0.1  # bfloat16 against float32: 8 mantissa bits, accumulated through a few matmuls
DEPENDENT = 1e-4  # an output that must depend on a change moves by more than this (bidirectional mixers)

#: The longest block_size a sequence check is lengthened to for an option (see :func:`past_length_options`):
#: long enough to cross windows of 500 tokens twice, short enough that attention over it takes milliseconds.
LONGEST_BLOCK = 1024

#: The largest value an int option is set to for its declared maximum: the longest block crosses it twice.
LARGEST_OPTION = (LONGEST_BLOCK - 3) // 2


class ConformanceError(AssertionError):
    """A plugin broke the contract of its slot; the message names the plugin, the check and what was seen."""


class CheckFailed(Exception):
    """Raised inside a check with what was observed; :class:`Check` adds the plugin and check names."""


def fail(message: str) -> NoReturn:
    """Stop the running check, reporting ``message`` (what was observed)."""
    raise CheckFailed(message)


def reloaded(state: dict) -> dict:
    """``state`` written by ``torch.save`` and read back with ``torch.load(weights_only=True)``, as a
    checkpoint holds it; the check fails when the safe loader refuses it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    try:
        return torch.load(buffer, weights_only=True)
    except Exception as exc:  # noqa: BLE001 — whatever the loader refuses, the check reports it
        fail(f"torch.load(weights_only=True) refuses its saved state dict: {type(exc).__name__}: "
             f"{' '.join(str(exc).split())[:300]}")


class Check:
    """One named conformance check of one plugin: call it to run it.

    ``__name__`` is the check's name, so pytest uses it as the test id when a suite parametrizes over
    ``iter_checks(...)``.
    """

    def __init__(self, name: str, function: Callable[["Subject"], None], subject: "Subject"):
        self.name = self.__name__ = name
        self.function = function
        self.subject = subject
        self.__doc__ = function.__doc__

    def __call__(self) -> None:
        try:
            self.function(self.subject)
        except CheckFailed as exc:
            raise ConformanceError(f"{self.subject.label}: {self.name}: {exc}") from None
        except ConformanceError:
            raise
        except Exception as exc:  # the plugin raised: that is a failure of this check, not of the kit
            raise ConformanceError(f"{self.subject.label}: {self.name}: raised {type(exc).__name__}: {exc}") from exc

    def __repr__(self) -> str:
        return f"<check {self.name} of {self.subject.label}>"


def run_checks(checks: Iterable[Check]) -> None:
    """Run every check; raise one ConformanceError listing each failure (one line per failed check).

    A failing ``plugin_class`` check stops the run: every later check would fail for the same reason.
    """
    failures = []
    for check in checks:
        try:
            check()
        except ConformanceError as exc:
            failures.append(str(exc))
            if check.name == "plugin_class":
                break
    if len(failures) == 1:
        raise ConformanceError(failures[0])
    if failures:
        raise ConformanceError(f"{len(failures)} conformance checks failed:\n" + "\n".join(failures))


def select_checks(checks: dict[str, Callable[["Subject"], None]], subject: "Subject",
                  skip: Iterable[str] = ()) -> list[Check]:
    """The checks of a slot (name → function) bound to ``subject``, less those named in ``skip``;
    ``ValueError`` for a name in ``skip`` that is no check of the slot (a typo would skip nothing)."""
    unknown = set(skip) - set(checks)
    if unknown:
        raise ValueError(f"no check named {', '.join(sorted(unknown))} for slot {subject.slot!r}; "
                         f"checks: {', '.join(checks)}")
    return [Check(name, function, subject) for name, function in checks.items() if name not in set(skip)]


class Subject:
    """A plugin class with options, as the checks of its slot see it. Slot modules subclass it."""

    slot = ""

    def __init__(self, plugin, options: dict | Options | None = None, *, shape: ModelShape | None = None,
                 seed: int = 0, device: str | torch.device = "cpu", compile_backend: str = "aot_eager",
                 ranges: dict[str, tuple[int, int]] | None = None):
        if isinstance(plugin, Plugin):  # an instance carries its own options
            plugin, options = type(plugin), plugin.options if options is None else options
        self.cls = plugin
        self.raw_options = options
        self.shape = shape or DEFAULT_SHAPE
        self.seed = seed
        self.device = torch.device(device)
        self.compile_backend = compile_backend
        self.ranges = dict(ranges or {})  # option → (low, high) the author states it is meant for
        name = getattr(plugin, "name", "") or getattr(plugin, "__name__", repr(plugin))
        if isinstance(options, dict) and options:
            name += " (" + ", ".join(f"{k}={v!r}" for k, v in options.items()) + ")"
        self.label = name

    # -- the plugin --------------------------------------------------------------------------------
    @property
    def options(self) -> Options:
        """The options, validated by the plugin's Options class (a dict is what a manifest table holds)."""
        if isinstance(self.raw_options, Options):
            return self.raw_options
        try:
            return self.cls.Options(**(self.raw_options or {}))
        except pydantic.ValidationError as exc:
            fail(f"options {self.raw_options or {}!r} are refused by {self.cls.Options.__name__}: "
                 f"{_one_line(exc)}")

    def plugin(self) -> Plugin:
        return self.cls(self.options)

    # -- what each slot provides -------------------------------------------------------------------
    module_type: type[nn.Module] = nn.Module  # what the plugin's build returns

    def built(self, seed: int, *args) -> nn.Module:
        """``plugin.build(shape, *args)`` under ``seed``, initialised with ``reset_parameters`` as the
        model does, on the device, in eval mode."""
        with self.seeded(seed):
            module = self.plugin().build(self.shape, *args)
            if not isinstance(module, self.module_type):
                call = ", ".join(["shape", *map(str, args)])
                fail(f"build({call}) returned {type(module).__name__}, not an lmlab.api.{self.module_type.__name__}")
            module.reset_parameters(self.shape)
        return module.to(self.device).eval()

    def build(self, seed: int) -> nn.Module:
        """The module under test, built and initialised under ``seed``, on the device, in eval mode."""
        raise NotImplementedError

    def example(self, seed: int, dtype: torch.dtype = torch.float32) -> tuple:
        """Arguments of one forward pass (fixed by ``seed``)."""
        raise NotImplementedError

    def forward(self, module: nn.Module, args: tuple) -> torch.Tensor:
        return module(*args)

    def grad_input(self, args: tuple) -> torch.Tensor | None:
        """The floating-point input that must receive a gradient, if the module has one."""
        return None

    def owns(self, parameter_name: str) -> bool:
        """Whether a parameter of the built module belongs to the plugin (not to the kit's harness)."""
        return True

    def aux_loss(self, module: nn.Module) -> torch.Tensor | None:
        return None

    # -- helpers for the checks --------------------------------------------------------------------
    def randn(self, *size: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(*size, generator=generator).to(self.device, dtype)

    def randint(self, high: int, *size: int, seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, high, size, generator=generator).to(self.device)

    def seeded(self, seed: int):
        """Run a block under ``seed`` without disturbing the caller's random state."""
        return _seeded(seed, self.device)

    # -- sequence lengths the options call for -----------------------------------------------------
    def int_options(self) -> dict[str, int]:
        """name → value of every int option (not bool) as the options under test hold it."""
        options = self.options
        return {name: value for name in type(options).model_fields
                if isinstance(value := getattr(options, name), int) and not isinstance(value, bool)}

    def length_options(self) -> dict[str, int]:
        """name → value of each int option that the shape's block_size does not exceed twice over.

        Any int counts, whatever its name: a window, a chunk or a block size called ``w`` or ``radius``
        is as likely as one called ``window``, and lengthening a check for an int that is no length
        (a state size) costs milliseconds, while missing a window hides a wrong cache.
        """
        return {name: value for name, value in self.int_options().items() if 2 * value + 3 > self.shape.block_size}

    def option_tops(self) -> dict[str, tuple[int, str]]:
        """name → (value, where it comes from) of the largest value each int option is checked at: the
        top of the range the test states (``ranges={"window": (2, 300)}``), else the maximum its Options
        field declares (``le``/``lt``), at most :data:`LARGEST_OPTION`. Options without either are
        checked at their given value only."""
        fields = type(self.options).model_fields
        tops = {}
        for name, value in self.int_options().items():
            if name in self.ranges:
                top, why = int(self.ranges[name][1]), "the top of the range the test states"
            else:
                bounds = [m.le for m in fields[name].metadata if getattr(m, "le", None) is not None]
                bounds += [m.lt - 1 for m in fields[name].metadata if getattr(m, "lt", None) is not None]
                if not bounds:
                    continue
                top, why = min(min(bounds), LARGEST_OPTION), "its declared maximum"
                if top < min(bounds):
                    why = f"its declared maximum {min(bounds)} capped at the kit's {LARGEST_OPTION}"
            if top > value:
                tops[name] = (top, why)
        return tops

    def longest_block(self, block_size: int) -> int:
        """The longest block_size up to ``block_size`` the plugin can be checked at (a slot whose modules
        declare a position limit lowers it)."""
        return block_size

    def at_block_size(self, block_size: int) -> "Subject":
        """This subject with the shape's block_size replaced (the plugin, options and seed kept)."""
        other = copy.copy(self)
        other.shape = dataclasses.replace(self.shape, block_size=block_size)
        return other

    def with_option(self, name: str, value: int) -> "Subject | None":
        """This subject with option ``name`` set to ``value``, or None where the plugin refuses that
        value (its Options, or its build, raising UserError): a run could not use it either."""
        other = copy.copy(self)
        other.raw_options = {**self.options.model_dump(), name: value}
        other.label = self.label
        try:
            other.cls.Options(**other.raw_options)
            other.build(other.seed)
        except (pydantic.ValidationError, UserError):
            return None
        return other

    def schedule(self, length: int) -> list[tuple[int, int, str]]:
        """:func:`decoding_schedule` with single steps where each int option's value falls (and twice
        it): where a window fills, a cache evicts and a ring buffer wraps."""
        return decoding_schedule(length, self.int_options().values())


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def scale(reference: torch.Tensor) -> float:
    """The magnitude tolerances are relative to (never 0, so an all-zero output compares exactly)."""
    return max(reference.detach().float().abs().max().item(), 1e-12)


def difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.detach().float() - expected.detach().float()).abs().max().item()


def expect_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float, what: str,
                 offset: int = 0, hint: str = "") -> None:
    """Fail with ``what``, the first position along T where the difference exceeds ``tolerance`` times
    the output scale (reported as ``offset`` + index), by how much, and ``hint`` (a likely cause).

    Both tensors are (B, T, ...); ``what`` says which outputs were compared, and why they must agree.
    """
    if actual.shape != expected.shape:
        fail(f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    expect_finite(actual, what)
    s = scale(expected)
    per_position = (actual.detach().float() - expected.detach().float()).abs().flatten(2).amax(dim=(0, 2))  # (T,)
    bad = (per_position > tolerance * s).nonzero()
    if len(bad):
        t = bad[0].item()
        fail(f"{what}: first at position {offset + t}, by {per_position[t].item():.3g} "
             f"(output scale {s:.3g}, tolerance {tolerance:g} of it)" + (f"; {hint}" if hint else ""))


def expect_mostly_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float, what: str,
                        fraction: float = 0.1) -> None:
    """Like :func:`expect_close` for a lower precision, per token (every dimension but the last): at
    most ``fraction`` of the tokens may be off by more than ``tolerance`` of the output scale, since
    rounding may legitimately flip a discrete decision (an MoE router's choice) for a few tokens."""
    if actual.shape != expected.shape:
        fail(f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    expect_finite(actual, what)
    s = scale(expected)
    per_token = (actual.detach().float() - expected.detach().float()).abs().amax(dim=-1).flatten()
    off = per_token > tolerance * s
    if off.float().mean().item() > fraction:
        fail(f"{what}: {int(off.sum())} of {off.numel()} tokens are off by more than {tolerance:g} of the output "
             f"scale {s:.3g} (worst by {per_token.max().item():.3g}); at most {fraction:.0%} may be")


def expect_finite(tensor: torch.Tensor, what: str) -> None:
    if not torch.isfinite(tensor).all():
        fail(f"{what}: {(~torch.isfinite(tensor)).sum().item()} non-finite values")


def expect_tensor(output: Any, shape: tuple, dtype: torch.dtype, what: str) -> None:
    if not isinstance(output, torch.Tensor):
        fail(f"{what} is a {type(output).__name__}, not a tensor")
    if tuple(output.shape) != tuple(shape):
        fail(f"{what} has shape {tuple(output.shape)}, expected {tuple(shape)}")
    if output.dtype != dtype:
        fail(f"{what} has dtype {output.dtype}, expected {dtype} (the dtype of the module and its input)")
    expect_finite(output, what)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
