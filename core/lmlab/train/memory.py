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
            key = (t.untyped_storage().data_ptr(), t.device)
            if key not in seen:
                seen.add(key)
                self.total += t.untyped_storage().nbytes()
            return t

        super().__init__(pack, lambda t: t)


def state_bytes(model: torch.nn.Module, optimizers) -> int:
    """Parameters, their gradients and the optimizer's state: the memory a step needs besides activations."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    state = sum(v.numel() * v.element_size() for opt in optimizers for s in opt.state.values()
                for v in s.values() if torch.is_tensor(v))
    return params + grads + state
