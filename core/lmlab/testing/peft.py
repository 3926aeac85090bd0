"""Conformance for peft plugins: :func:`check_peft` applies a plugin to tiny models and checks what the
core relies on (``lmlab.api.Peft``).

========================  ====================================================================
check                     what it requires
========================  ====================================================================
starts_as_the_base        the adapted model's logits are the base model's (max |Δ| ≤ 1e-6)
trains_only_the_adapter   some parameters require gradients, all of them adapter entries; after a
                          backward pass exactly those have gradients, finite and not all zero (a
                          plugin without adapter entries, such as none, must leave all trainable)
adapter_round_trip        the adapter entries, loaded into the same base adapted afresh, give the
                          same logits (and survive safetensors)
merges                    for a plugin that merges: the merged model has the plain model's state
                          keys and its logits equal the adapted model's (max |Δ| ≤ 1e-5), with the
                          adapter moved away from its initial identity first
========================  ====================================================================

Each runs on every ``(attention, ffn)`` pair of ``architectures`` (installed plugins by name; the
default pairs softmax attention with an MLP and with SwiGLU) at :data:`DEFAULT_SHAPE`, fp32, CPU.
:func:`tiny_model` builds those models for a plugin's own tests.
"""

import copy

import torch

from lmlab.api import Peft, UserError
from lmlab.testing.common import DEFAULT_SHAPE, fail
from lmlab.testing.stand_in import stand_in_run

ARCHITECTURES = (("gqa", "mlp"), ("gqa", "swiglu"))

def kit_run():
    """What ``Peft.apply`` receives as the run in these checks."""
    return stand_in_run(train={"max_steps": 20}, parallel="single")


def tiny_model(attention: str = "gqa", ffn: str = "mlp", position: str = "learned", shape=DEFAULT_SHAPE,
               seed: int = 0, attention_options: dict | None = None, ffn_options: dict | None = None):
    """The core's LanguageModel built from installed attention, ffn and position plugins, seeded."""
    from lmlab import discovery
    from lmlab.model import LanguageModel

    def plugin(slot, name, options):
        cls = discovery.load(slot, name)
        return cls(cls.Options(**(options or {})))

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LanguageModel(shape, position=plugin("position", position, None),
                             attention=plugin("attention", attention, attention_options),
                             ffn=plugin("ffn", ffn, ffn_options))


def probe(shape=DEFAULT_SHAPE) -> torch.Tensor:
    return torch.randint(0, shape.vocab_size, (2, shape.block_size), generator=torch.Generator().manual_seed(1))


def adapted(plugin_cls, options: dict | None, attention: str = "gqa", ffn: str = "mlp", seed: int = 0):
    """(plugin instance, base model, adapted model) for one architecture; both models in eval mode."""
    plugin = plugin_cls(plugin_cls.Options(**(options or {})))
    base = tiny_model(attention, ffn, seed=seed).eval()
    model = copy.deepcopy(base)
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        plugin.apply(model, kit_run())
    return plugin, base, model.eval()


def perturb(plugin: Peft, model: torch.nn.Module, scale: float = 0.1) -> None:
    """Move every adapter tensor away from its initial value (which is the identity), seeded."""
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for key, value in model.state_dict(keep_vars=True).items():
            if plugin.is_adapter_key(key) and value.is_floating_point():
                value.add_(scale * torch.randn(value.shape, generator=generator, dtype=value.dtype))


def starts_as_the_base(plugin_cls, options, attention, ffn) -> None:
    _, base, model = adapted(plugin_cls, options, attention, ffn)
    x = probe()
    with torch.no_grad():
        difference = (model(x) - base(x)).abs().max().item()
    if difference > 1e-6:
        fail(f"a freshly adapted model's logits differ from the base model's by {difference:.2e}")


def trains_only_the_adapter(plugin_cls, options, attention, ffn) -> None:
    plugin, _, model = adapted(plugin_cls, options, attention, ffn)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if not any(plugin.is_adapter_key(k) for k in model.state_dict()):  # no adapter: full training
        if trainable != {n for n, _ in model.named_parameters()}:
            fail("declares no adapter entries (is_adapter_key) but froze parameters")
        return
    if not trainable:
        fail("no parameter requires gradients after apply")
    stray = sorted(n for n in trainable if not plugin.is_adapter_key(n))
    if stray:
        fail(f"parameters outside the adapter require gradients: {stray[:4]}")
    perturb(plugin, model)
    model.train()
    model(probe()).logsumexp(-1).mean().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    if with_grad != trainable:
        fail(f"gradients reached {sorted(with_grad ^ trainable)[:4]} (expected exactly the trainable parameters)")
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    if bad or all(p.grad.abs().max() == 0 for n, p in model.named_parameters() if p.grad is not None):
        fail(f"adapter gradients are not finite or all zero ({bad[:3]})")


def adapter_round_trip(plugin_cls, options, attention, ffn) -> None:
    from safetensors.torch import load, save

    plugin, _, model = adapted(plugin_cls, options, attention, ffn)
    if not any(plugin.is_adapter_key(k) for k in model.state_dict()):
        return
    perturb(plugin, model)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if plugin.is_adapter_key(k)}
    state = load(save(state))
    _, _, fresh = adapted(plugin_cls, options, attention, ffn, seed=0)
    result = fresh.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if plugin.is_adapter_key(k)]
    if missing or result.unexpected_keys:
        fail(f"the adapter entries do not load into a freshly adapted base (missing {missing[:3]}, "
             f"unexpected {result.unexpected_keys[:3]})")
    x = probe()
    with torch.no_grad():
        difference = (fresh(x) - model(x)).abs().max().item()
    if difference > 1e-6:
        fail(f"the adapter loaded into a freshly adapted base gives logits {difference:.2e} away")


def merges(plugin_cls, options, attention, ffn) -> None:
    plugin, base, model = adapted(plugin_cls, options, attention, ffn)
    if type(plugin).merge is Peft.merge:  # declares that it does not merge
        return
    perturb(plugin, model)
    x = probe()
    with torch.no_grad():
        before = model(x)
        plugin.merge(model)
        after = model(x)
    keys, plain = set(model.state_dict()), set(base.state_dict())
    if keys != plain:
        fail(f"the merged model's entries are not the plain model's: {sorted(keys ^ plain)[:4]}")
    difference = (after - before).abs().max().item()
    if difference > 1e-5:
        fail(f"the merged model's logits differ from the adapted model's by {difference:.2e}")
    if (after - base(x)).abs().max().item() < 1e-4:
        fail("the merged model computes what the base did: the adapter was lost")


CHECKS = {f.__name__: f for f in (starts_as_the_base, trains_only_the_adapter, adapter_round_trip, merges)}


def check_peft(plugin_cls, options: dict | None = None, architectures=ARCHITECTURES, skip=()) -> None:
    """Run every check on every architecture; one AssertionError naming each failure. ``skip``: names of
    checks not to run (a method that changes the base on purpose, as qlora quantises it, does not
    start as the full-precision base)."""
    from lmlab.testing.common import CheckFailed, ConformanceError

    failures = []
    for attention, ffn in architectures:
        for name, check in CHECKS.items():
            if name in skip:
                continue
            try:
                check(plugin_cls, options, attention, ffn)
            except CheckFailed as exc:
                failures.append(f"{name} ({attention} + {ffn}): {exc}")
            except UserError as exc:
                failures.append(f"{name} ({attention} + {ffn}): {exc}")
    if failures:
        raise ConformanceError(f"{getattr(plugin_cls, 'name', '') or plugin_cls.__name__}: " + "; ".join(failures))
