"""Finding where a non-finite value starts: the step's last micro-batch run again with a check on
every module's output and gradient. Hooks are attached only for this rerun, so a run pays nothing
for it until a monitor asks."""

import contextlib

import torch

from lmlab.model import compute_loss


def _tensors(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _finite(value) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in _tensors(value) if t.is_floating_point())


def locate(model: torch.nn.Module, objective, batch, context=None) -> str | None:
    """The first module (in execution order) whose forward output holds a non-finite value, or else
    the first whose output's gradient does (in backward order, where it arises): ``"NAME (forward
    output)"`` / ``"NAME (gradient)"``; ``"the loss"`` when only the loss is; None when all is finite.
    The parameters' gradients are restored afterwards."""
    found = {"forward": None, "backward": None}
    handles = []

    def on_forward(name):
        def hook(module, args, output):
            if found["forward"] is None and not _finite(output):
                found["forward"] = name
            for t in _tensors(output):
                if t.requires_grad and t.is_floating_point():
                    t.register_hook(on_gradient(name))
        return hook

    def on_gradient(name):
        def hook(grad):
            if found["backward"] is None and not bool(torch.isfinite(grad).all()):
                found["backward"] = name
        return hook

    for name, module in model.named_modules():
        if name:  # the model itself would only repeat what its last module says
            handles.append(module.register_forward_hook(on_forward(name)))
    saved = {p: p.grad for p in model.parameters()}
    for p in saved:
        p.grad = None
    try:
        with torch.enable_grad(), context if context is not None else contextlib.nullcontext():
            loss = compute_loss(model, objective, batch).total
        if found["forward"] is None and loss.requires_grad:
            loss.backward()
        if found["forward"] is not None:
            return f"{found['forward']} (forward output)"
        if found["backward"] is not None:
            return f"{found['backward']} (gradient)"
        for name, p in model.named_parameters():  # finite activations, yet a weight's gradient overflows
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                return f"{name} (parameter gradient)"
        return None if bool(torch.isfinite(loss)) else "the loss"
    finally:
        for handle in handles:
            handle.remove()
        for p, grad in saved.items():
            p.grad = grad
