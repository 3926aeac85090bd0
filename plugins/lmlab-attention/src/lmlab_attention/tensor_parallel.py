"""Tensor parallelism for a fused query/key/value projection (Megatron-LM, Shoeybi et al. 2019).

Megatron splits attention by heads: the query, key and value projections column-wise, so each of
``t`` ranks computes ``n_heads / t`` whole heads (and ``n_kv_heads / t`` key/value heads) without
communication, and the output projection row-wise, so one all-reduce sums the ranks' partial
outputs. ``qkv_proj`` stacks the three projections in one weight, rows ``[q; k; v]``. torch's
``ColwiseParallel`` would cut those stacked rows into ``t`` contiguous blocks: with ``t = 2``,
rank 0 would get every query row and half the key rows. :class:`FusedColwiseParallel` instead
cuts each section (q, k, v) into ``t`` blocks and gives rank ``r`` ``[q_r; k_r; v_r]``: it permutes
the rows to rank-major order before sharding them with ``Shard(0)``.

The DTensor therefore describes the permuted matrix. State-dict hooks on the projection undo the
permutation when a state dict is taken (the saved weight is the single-device one, under its
single-device name) and redo it when one is loaded, so checkpoints move freely between a
tensor-parallel run, a resumed one and a single-device model. Optimizer states are not passed
through ``Module.state_dict`` and stay in the permuted order, which is consistent on resumption
with the same layout (lmlab resumes only an identical manifest).

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", 2019, https://arxiv.org/abs/1909.08053 (section 3, figure 3b).
"""

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel


def rank_major_rows(sections: Sequence[int], parts: int) -> torch.Tensor:
    """Row indices that reorder stacked ``sections`` so that part ``r`` of every section comes
    together: ``[s0_0, s1_0, s2_0, s0_1, s1_1, ...]``; each section must split into ``parts``."""
    starts = [sum(sections[:i]) for i in range(len(sections))]
    order = []
    for r in range(parts):
        for start, size in zip(starts, sections):
            step = size // parts
            order.append(torch.arange(start + r * step, start + (r + 1) * step))
    return torch.cat(order)


class FusedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a linear layer whose output rows stack several projections.

    ``sections`` are the row counts of the stacked projections (``[H·hs, Hkv·hs, Hkv·hs]`` for
    q, k, v); each must divide by the mesh size. ``on_apply(mesh)`` runs once the layer is sharded,
    so its owner can switch to its local share. The layer's output is the local tensor
    ``[q_r, k_r, v_r]`` along the last dimension, as ``ColwiseParallel`` returns by default.
    """

    def __init__(self, sections: Sequence[int], on_apply: Callable | None = None):
        super().__init__()
        self.sections = list(sections)
        self.on_apply = on_apply

    def _partition_linear_fn(self, name, module, device_mesh):
        order = rank_major_rows(self.sections, device_mesh.size())
        for param_name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach()[order.to(param.device)], device_mesh, [Shard(0)],
                                        src_data_rank=self.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.register_state_dict_post_hook(partial(_single_device_rows, torch.argsort(order)))
        module.register_load_state_dict_pre_hook(partial(_sharded_rows, order))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        if self.on_apply is not None:
            self.on_apply(device_mesh)
        return module


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _single_device_rows(inverse: torch.Tensor, module, state_dict, prefix, local_metadata) -> None:
    # Every process gathers (a collective): state dicts are taken in all of them, as checkpoints are.
    for name, _ in module.named_parameters(recurse=False):
        key = prefix + name
        if key in state_dict:
            full = _full(state_dict[key])
            state_dict[key] = full[inverse.to(full.device)]


def _sharded_rows(order: torch.Tensor, module, state_dict, prefix, *args) -> None:
    for name, param in module.named_parameters(recurse=False):
        key = prefix + name
        if key in state_dict:
            full = _full(state_dict[key]).to(param.device, param.dtype)[order.to(param.device)]
            mesh = param.device_mesh
            # Replicate first: every process then cuts its own shard, whatever the placements (FSDP
            # on top of tensor parallelism shards the same rows again over a second mesh dimension).
            replicated = distribute_tensor(full, mesh, [Replicate()] * mesh.ndim)
            state_dict[key] = replicated.redistribute(mesh, param.placements)
