"""Building a model without its random initialisation, where every value it would draw is about to
be replaced: on the meta device (``lmlab check``: no values at all), and before a trained run's
checkpoint is loaded into it (every parameter comes from the file). Filling SmolLM2-135M's weights
with ``normal_``/``kaiming_uniform_`` costs seconds on a CPU that the load then throws away.
"""

import contextlib


@contextlib.contextmanager
def without_random_init(parameters_only: bool = False):
    """Random fills (``normal_``, ``uniform_``, ``trunc_normal_`` and torch.nn.init's schemes) return
    their tensor unfilled inside the block. ``parameters_only``: only a parameter's (a checkpoint
    holds every parameter; a buffer filled at random, which it may not hold, is still filled)."""
    import torch
    from torch.overrides import TorchFunctionMode

    init = torch.nn.init
    random_fills = {torch.Tensor.normal_, torch.Tensor.uniform_, init.normal_, init.uniform_, init.trunc_normal_,
                    init.kaiming_uniform_, init.kaiming_normal_, init.xavier_uniform_, init.xavier_normal_,
                    init.orthogonal_}

    class WithoutRandomInit(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in random_fills:
                # The fill's one tensor argument, by position or keyword, returned as the fills return it.
                target = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor))
                if not parameters_only or isinstance(target, torch.nn.Parameter):
                    return target
            return func(*args, **(kwargs or {}))

    with WithoutRandomInit():
        yield
