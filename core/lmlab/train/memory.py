"""Memory of a training step, measured the same way on any device: activations autograd saves for
backward, and the state a step keeps besides them (parameters, gradients, optimizer state)."""

import torch


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes of the tensors autograd saves for backward (each storage once): the
    activation memory of a step, the part that batch size, sequence length and checkpointing move.
    A device-independent measure, unlike a CPU process's peak resident set. Use as a context manager
    around a forward pass; ``total`` holds the count."""

    def __init__(self):
        self.total = 0
        seen = set()

        def pack(t: torch.Tensor):
            for storage in _storages(t):
                key = (storage.data_ptr(), storage.device)
                if key not in seen:
                    seen.add(key)
                    self.total += storage.nbytes()
            return t

        super().__init__(pack, lambda t: t)


def _storages(t: torch.Tensor):
    """The storages behind ``t``: a wrapper subclass (a DTensor under tensor parallelism) has none of
    its own, only those of the tensors it wraps (its local shard)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
    else:
        yield t.untyped_storage()


def state_bytes(model: torch.nn.Module, optimizers) -> int:
    """Parameters, their gradients and the optimizer's state: the memory a step needs besides activations."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return params + grads + optimizer_state_bytes(optimizers)


def optimizer_state_bytes(optimizers) -> int:
    """The tensors the optimizers keep per parameter (Adam's moments, step counters)."""
    return sum(v.numel() * v.element_size() for opt in optimizers for s in opt.state.values()
               for v in s.values() if torch.is_tensor(v))
