"""Lightning's ``ModelParallelStrategy`` with a pipeline mesh and consolidated pipeline checkpoints.

Each process holds one stage, with plain (not DTensor) parameters, so the parent's checkpointing,
which gathers DTensors, would save rank 0's stage alone and refuse to load. Here rank 0 gathers
every stage's state dict into the single-device one (the stages' parameter names are the whole
model's) and keeps each stage's optimizer state under ``pipeline_stages``; loading gives each stage
its own part of both.
"""

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy


class PipelineStrategy(ModelParallelStrategy):
    """All processes form one pipeline: mesh ``(data_parallel = 1, pipeline_parallel = world size)``."""

    def __init__(self, stages: int, process_group_backend: str | None = None, timeout=None):
        kwargs = {"timeout": timeout} if timeout is not None else {}
        super().__init__(data_parallel_size=1, tensor_parallel_size=stages, save_distributed_checkpoint=False,
                         process_group_backend=process_group_backend, **kwargs)

    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        super().setup_environment()
        # The parent names the second dimension "tensor_parallel"; here it is the pipeline.
        self._device_mesh = init_device_mesh(self.root_device.type, (1, self.world_size),
                                             mesh_dim_names=("data_parallel", "pipeline_parallel"))
        self.lightning_module._device_mesh = self._device_mesh

    def _gather_to_rank0(self, obj: Any) -> list | None:
        gathered = [None] * self.world_size if self.global_rank == 0 else None
        dist.gather_object(obj, gathered, dst=0)
        return gathered

    def lightning_module_state_dict(self) -> dict[str, Any]:
        local = {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()}
        stages = self._gather_to_rank0(local)
        if stages is None:
            return {}
        merged: dict[str, Any] = {}
        for stage in stages:  # a name several stages hold has the same value in each
            merged.update({k: v for k, v in stage.items() if k not in merged})
        return merged

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
        local = _to_cpu(optimizer.state_dict())
        stages = self._gather_to_rank0(local)
        return {} if stages is None else {"pipeline_stages": stages}

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        # Every process reads the file (on one machine, or a filesystem the nodes share).
        path = Path(self.broadcast(checkpoint_path))
        checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only)
        module = self.lightning_module
        full = checkpoint["state_dict"]
        local = {k: full[k] for k in module.state_dict()}  # KeyError: a checkpoint of another model
        module.load_state_dict(local, strict=True)
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            optimizer.load_state_dict(state["pipeline_stages"][self.global_rank])
        return checkpoint


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
