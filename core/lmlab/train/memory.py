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


def reset_peak() -> None:
    """Start counting the peak afresh, so that each variant of a sweep run in one process reports its
    own (not the largest of every variant so far)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    try:  # Linux: "5" resets the process's peak resident set size (VmHWM), see proc(5)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # elsewhere the peak covers the whole process


def on_cuda() -> bool:
    """Whether this process has put anything on a CUDA device (its peak is then the device's)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def peak_mb() -> float:
    """The peak since :func:`reset_peak`: allocated CUDA memory on a GPU, else the process's peak
    resident set."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB elsewhere
