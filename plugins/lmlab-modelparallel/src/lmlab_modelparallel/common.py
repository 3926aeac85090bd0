"""What the ``tensor`` and ``pipeline`` plugins share: launch options and gradient-norm clipping."""

from typing import Literal

import torch

from lmlab.api import Field, LaunchOptions


class ModelParallelLaunchOptions(LaunchOptions):
    accelerator: Literal["auto", "cpu", "gpu", "cuda"] = Field("auto", help="device type")


def numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def clip_by_global_norm(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place as ``torch.nn.utils.clip_grad_norm_`` does, given the global norm."""
    from torch.distributed.tensor import DTensor

    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    # A DTensor's local shard is scaled in place: the scale is the same everywhere, so no placement
    # changes, and no collective is needed.
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.device))


def dtensor_aware_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of the whole gradient when some of ``grads`` are DTensors (sharded or replicated
    over possibly different meshes) and the rest are plain tensors replicated in every process of
    the group (so counted once). One collective per distinct (mesh, placements)."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    squares = []
    for key, members in groups.items():
        norm = torch.nn.utils.get_total_norm(members, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # sums the shards' squares over the mesh
        squares.append(norm.float().square())
    if not squares:
        return torch.zeros(())
    device = squares[0].device
    return torch.stack([s.to(device) for s in squares]).sum().sqrt()
