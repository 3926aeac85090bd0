"""Tensor parallelism by heads (Megatron-LM, Shoeybi et al. 2019).

Megatron splits attention by heads: the query, key and value projections column-wise, so each of
``t`` ranks computes ``n_heads / t`` whole heads (and ``n_kv_heads / t`` key/value heads) without
communication, and the output projection row-wise, so one all-reduce sums the ranks' partial
outputs. torch's ``ColwiseParallel`` does the column split; :class:`HeadColwiseParallel` adds a
callback so the attention module learns, once its projection is sharded, which heads are its own
(it then computes only those, and takes only their slice of a position scheme's per-head bias).

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", 2019, https://arxiv.org/abs/1909.08053 (section 3, figure 3b).
"""

from collections.abc import Callable

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel


class HeadColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` that calls ``on_apply(mesh)`` once the layer is sharded."""

    def __init__(self, on_apply: Callable | None = None):
        super().__init__()
        self.on_apply = on_apply

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        if self.on_apply is not None:
            self.on_apply(device_mesh)
        return module
