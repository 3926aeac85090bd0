"""Conformance checks of optimizer plugins: what the core and Lightning do with the optimizer they build.

The optimizer is built as ``LMModule.configure_optimizers`` builds it: ``plugin.build(model.param_infos())``
on the core's ``LanguageModel`` (assembled with the kit's reference modules), so the weight-decay
grouping it receives is the core's own. The schedule is the core's too: a
``torch.optim.lr_scheduler.LambdaLR`` that writes each group's ``"lr"`` (its build-time value kept
under ``"initial_lr"``, times a factor) before a step.

Steps mostly run on seeded random gradients rather than a loss: what an optimizer does with a
gradient is independent of where the gradient came from, and the checks stay at milliseconds. Where
two learning rates are compared, the run is replayed from the same seed for each, which needs no
copy of the optimizer, only the determinism the state-dict check requires anyway.
"""


import torch
import torch.nn.functional as F

from lmlab.testing import generic
from lmlab.testing.common import Subject, fail, reloaded
from lmlab.testing.reference import ReferencePosition, reference_model

WARM_STEPS = 3  # steps before a compared one, so moment estimates and step counters are not at zero
SCALED = 0.25  # the schedule factor compared with 1: far enough from 1 that ignoring it cannot pass
PROPORTIONAL = 1e-3  # relative tolerance of "the update scales with lr" (float32 rounding is far below)
ROUNDING = 4 * torch.finfo(torch.float32).eps  # of a parameter's magnitude: what storing p + Δ may lose


class OptimizerSubject(Subject):
    slot = "optimizer"

    def model(self, seed: int) -> torch.nn.Module:
        """The core's LanguageModel (an embedding, norms and matrices: parameters of both decay kinds)."""
        with self.seeded(seed):
            model = reference_model(self.shape, ReferencePosition())
        return model.to(self.device)

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """``build(model.param_infos())`` on a fresh plugin instance, as ``configure_optimizers`` does."""
        optimizer = self.plugin().build(model.param_infos())
        if not isinstance(optimizer, torch.optim.Optimizer):
            # LambdaLR (the core's schedule) and Lightning both refuse anything else.
            fail(f"build() returned a {type(optimizer).__name__}, not a torch.optim.Optimizer")
        return optimizer

    def setup(self, seed: int, factor: float | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = self.model(seed)
        optimizer = self.optimizer(model)
        if factor is not None:
            schedule(optimizer, factor)
        return model, optimizer

    def set_grads(self, model: torch.nn.Module, seed: int | None) -> None:
        """Seeded random gradients for every parameter; all-zero ones for seed None."""
        for i, p in enumerate(model.parameters()):
            p.grad = torch.zeros_like(p) if seed is None else self.randn(*p.shape, seed=seed * 1009 + i, dtype=p.dtype)


def schedule(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """What the core's schedule does before a step: each group's lr = its ``initial_lr`` × ``factor``."""
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factor)


def _updates(subject: OptimizerSubject, factors: tuple[float, ...]) -> tuple[dict, dict]:
    """(parameters before, {factor: name → update}) of one step taken at each schedule ``factor`` from
    one state: WARM_STEPS steps at the peak lr, replayed from the seed for each factor."""
    before, updates = {}, {}
    for factor in factors:
        model, optimizer = subject.setup(subject.seed, 1.0)
        for k in range(WARM_STEPS):
            subject.set_grads(model, subject.seed + 1 + k)
            optimizer.step()
        start = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        if before and any(not torch.equal(start[n], before[n]) for n in start):
            fail("two runs of the same steps from the same seed reached different parameters; the "
                 "optimizer's step is not deterministic")
        before = start
        schedule(optimizer, factor)
        subject.set_grads(model, subject.seed + 100)
        optimizer.step()
        updates[factor] = {n: p.detach().double() - before[n] for n, p in model.named_parameters()}
    return before, updates


def _largest(update: dict) -> tuple[str, float]:
    name = max(update, key=lambda n: update[n].abs().max().item())
    return name, update[name].abs().max().item()


def param_groups(subject: OptimizerSubject) -> None:
    """``build`` returns a ``torch.optim.Optimizer`` whose param groups hold every parameter of
    ``param_infos()`` exactly once and nothing else, each group with a positive numeric ``"lr"`` (the
    schedule scales it, and the core reads the peak from group 0's); a parameter with ``decay`` False
    sits in a group whose ``"weight_decay"`` is 0 (or absent)."""
    model = subject.model(subject.seed)
    infos = model.param_infos()
    optimizer = subject.optimizer(model)
    names = {id(i.param): i.name for i in infos}
    decays = {id(i.param): i.decay for i in infos}
    seen: dict[int, int] = {}
    for g, group in enumerate(optimizer.param_groups):
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor) and lr.numel() == 1:  # torch allows a tensor lr (capturable steps)
            lr = lr.item()
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            fail(f"param group {g} has lr {lr!r}; the schedule needs a positive number to scale")
        for p in group["params"]:
            if id(p) not in names:
                fail(f"param group {g} holds a tensor of shape {tuple(p.shape)} that is not one of the model's "
                     "trainable parameters")
            if id(p) in seen:
                fail(f"{names[id(p)]} is in param groups {seen[id(p)]} and {g}; each parameter belongs to one")
            seen[id(p)] = g
            if not decays[id(p)] and group.get("weight_decay", 0) != 0:
                fail(f"{names[id(p)]} has decay False (a norm, bias or embedding) but sits in param group {g} "
                     f"with weight_decay {group['weight_decay']!r}")
    missing = [i.name for i in infos if id(i.param) not in seen]
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        fail(f"no param group holds {', '.join(missing[:4])}{more}: those parameters never train")


def lr_zero(subject: OptimizerSubject) -> None:
    """After a few steps, a step whose groups' ``"lr"`` the schedule set to 0 leaves every parameter
    unchanged (up to 1e-6 of what the same step moves them at the peak lr), while at the peak lr the
    step moves them: the update reads ``group["lr"]`` at every step, never a learning rate kept from
    ``build`` (warmup starts near 0 and decay ends near ``min_lr``; a cached lr ignores both)."""
    before, updates = _updates(subject, (1.0, 0.0))
    name, moved = _largest(updates[1.0])
    if moved == 0:
        fail("a step at the peak learning rate with non-zero gradients moved no parameter")
    still_name, still = _largest(updates[0.0])
    if still > 1e-6 * moved:
        fail(f"with every group's lr set to 0 (as the schedule does), a step still moved {still_name} by "
             f"{still:.3g} (at the peak lr it moves parameters by up to {moved:.3g}): step reads a learning rate "
             "other than param_groups[i]['lr'] (one stored at build time?)")


def lr_proportional(subject: OptimizerSubject) -> None:
    """After a few steps, a step at a quarter of each group's lr (set by the schedule) moves every
    parameter by a quarter of what the same step moves it at the peak lr, within 1e-3 of the update
    plus float32 rounding of the parameter: the schedule's factor reaches the update linearly, as in
    SGD, Adam(W), Lion and their relatives. (An optimizer that uses lr otherwise, a schedule-free one,
    skips this check and keeps ``lr_zero``.)"""
    before, updates = _updates(subject, (1.0, SCALED))
    _, moved = _largest(updates[1.0])
    if moved == 0:
        fail("a step at the peak learning rate with non-zero gradients moved no parameter")
    for name, full in updates[1.0].items():
        expected, actual = SCALED * full, updates[SCALED][name]
        p = before[name].abs()
        allowed = PROPORTIONAL * expected.abs() + ROUNDING * torch.maximum(p, (before[name] + full).abs())
        if ((actual - expected).abs() > allowed).any():
            ratio = actual.norm().item() / max(full.norm().item(), 1e-300)
            fail(f"with every group's lr scaled by {SCALED} (as the schedule does), the update of {name} was "
                 f"{ratio:.3g}× its update at the peak lr, not {SCALED}×: step does not scale its update by "
                 "param_groups[i]['lr'] (a learning rate stored at build time, or clamped?)")


def closure(subject: OptimizerSubject) -> None:
    """``step(closure=closure)``, called as Lightning calls it, calls the closure exactly once, with
    gradients enabled, and returns the loss the closure returned; and the update uses the gradients the
    closure computed: the parameters end as after a backward followed by ``step()`` without a closure."""
    idx = subject.randint(subject.shape.vocab_size, 2, subject.shape.block_size + 1, seed=subject.seed + 5)
    calls: list[bool] = []

    def loss_of(model):
        logits = model(idx[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), idx[:, 1:].flatten())

    model, optimizer = subject.setup(subject.seed)

    def lightning_closure():  # Lightning's closure: zero the gradients, forward, backward, return the loss
        calls.append(torch.is_grad_enabled())
        optimizer.zero_grad()
        loss = loss_of(model)
        if loss.requires_grad:
            loss.backward()
        return loss

    returned = optimizer.step(closure=lightning_closure)
    if len(calls) != 1:
        fail(f"step(closure=...) called the closure {len(calls)} times; Lightning's closure runs the step's last "
             "forward and backward, so it must run exactly once")
    if not calls[0]:
        fail("step(closure=...) called the closure with gradients disabled, so its backward cannot run; call it "
             "inside torch.enable_grad(), as torch's optimizers do")
    if not isinstance(returned, torch.Tensor):
        fail(f"step(closure=...) returned {returned!r}, not the loss the closure returned")
    reference, manual = subject.setup(subject.seed)
    loss = loss_of(reference)
    loss.backward()
    manual.step()
    if not torch.equal(returned.detach(), loss.detach()):
        fail(f"step(closure=...) returned {returned.item():.6g}, not the loss the closure returned "
             f"({loss.item():.6g})")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if not torch.equal(p, q):
            fail(f"after step(closure=...), {name} differs from a backward then step() by "
                 f"{(p - q).abs().max().item():.3g}: does step read the gradients before calling the closure?")
        if p.grad_fn is not None:
            fail(f"after step(closure=...), {name} has a grad_fn: the update was recorded by autograd "
                 "(run it under torch.no_grad())")


def no_decay(subject: OptimizerSubject) -> None:
    """From a fresh optimizer, two steps on all-zero gradients (any change is weight decay) leave every
    parameter the core marked ``decay`` False (norms, biases, embeddings) and every parameter of a group
    with ``weight_decay`` 0 (or no such key) bit-identical, and shrink the norm of every other one (a
    ``decay`` True parameter in a group with ``weight_decay`` > 0)."""
    model, optimizer = subject.setup(subject.seed)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    decays = {id(i.param): i.decay for i in model.param_infos()}
    for _ in range(2):
        subject.set_grads(model, None)
        optimizer.step()
    for group in optimizer.param_groups:
        decay = group.get("weight_decay", 0)
        for p in group["params"]:
            name = names[id(p)]
            if not decays[id(p)] or decay == 0:
                if not torch.equal(p, before[name]):
                    why = ("decay False: a norm, bias or embedding" if not decays[id(p)]
                           else "in a group with weight_decay 0")
                    fail(f"{name} ({why}) changed by {(p - before[name]).abs().max().item():.3g} after steps on zero "
                         "gradients: it was decayed")
            elif not p.norm() < before[name].norm():
                fail(f"{name} is in a group with weight_decay {decay!r}, but steps on zero gradients did not shrink "
                     f"it (norm {before[name].norm().item():.6g} → {p.norm().item():.6g})")


def state_dict(subject: OptimizerSubject) -> None:
    """After a few scheduled steps, the optimizer's state dict survives ``torch.save`` and
    ``torch.load(weights_only=True)`` (how a resumed run loads its checkpoint) and, loaded into an
    optimizer freshly built on a copy of the model, gives bit-identical parameters over the next steps."""
    model, optimizer = subject.setup(subject.seed, 0.5)
    for k in range(WARM_STEPS):
        subject.set_grads(model, subject.seed + 1 + k)
        optimizer.step()
    loaded = reloaded(optimizer.state_dict())
    resumed = subject.model(subject.seed + 1)
    resumed.load_state_dict(model.state_dict())
    other = subject.optimizer(resumed)
    other.load_state_dict(loaded)
    for k in range(2):
        for m in (model, resumed):
            subject.set_grads(m, subject.seed + 50 + k)
        optimizer.step()
        other.step()
        for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
            if not torch.equal(p, q):
                fail(f"step {k + 1} after loading the state dict into a fresh optimizer: {name} differs from the "
                     f"original's by {(p - q).abs().max().item():.3g}; is some state kept outside "
                     "optimizer.state, or not restored by load_state_dict?")


#: name → check, in the order ``check_optimizer`` runs them.
CHECKS = {
    "plugin_class": generic.plugin_class,
    "param_groups": param_groups,
    "lr_zero": lr_zero,
    "lr_proportional": lr_proportional,
    "closure": closure,
    "no_decay": no_decay,
    "state_dict": state_dict,
}
