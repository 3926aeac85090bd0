"""Lightning's ``ModelParallelStrategy`` with a pipeline mesh and consolidated pipeline checkpoints.

The mesh is ``(pipeline_parallel, data_parallel, tensor_parallel)``, outermost first: ranks that
differ only in their tensor-parallel index are adjacent (one node's fast links carry the per-layer
all-reduces), the data-parallel replicas of one stage come next, and the pipeline stages are the
outermost dimension (point to point traffic only, which crosses nodes best). It is torchtitan's
order. A pipeline alone is ``(p, 1, 1)``.

Each stage holds only its part of the model, so the parent's checkpointing, which gathers DTensors
over the whole world, would save rank 0's stage alone. Here every stage gathers its own shards
(``full_tensor`` over its data- and tensor-parallel ranks), the stages' first ranks send their
state dicts to rank 0, and rank 0 merges them into the single-device state dict (the stages'
parameter names are the whole model's). Optimizer states are kept per rank, as each rank holds
them, under ``ranks`` with the layout beside them: a resumed run on the same layout takes its own
back; another layout starts from the weights (``[init]``) instead.
"""

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy

from lmlab.api import UserError

DIMENSIONS = ("pipeline_parallel", "data_parallel", "tensor_parallel")


class PipelineStrategy(ModelParallelStrategy):
    """Processes laid out as ``stages × data × tensor`` (outermost first), one pipeline per
    (data, tensor) index."""

    def __init__(self, stages: int, data: int = 1, tensor: int = 1, process_group_backend: str | None = None,
                 timeout=None):
        kwargs = {"timeout": timeout} if timeout is not None else {}
        # The parent checks data × tensor against the world size; its own 2-D mesh is replaced below.
        super().__init__(data_parallel_size=data, tensor_parallel_size=stages * tensor,
                         save_distributed_checkpoint=False, process_group_backend=process_group_backend, **kwargs)
        self.layout = (stages, data, tensor)

    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        super().setup_environment()
        self._device_mesh = init_device_mesh(self.root_device.type, self.layout, mesh_dim_names=DIMENSIONS)
        self.lightning_module._device_mesh = self._device_mesh

    def _stage_leader(self) -> bool:
        mesh = self._device_mesh
        return mesh["data_parallel"].get_local_rank() == 0 and mesh["tensor_parallel"].get_local_rank() == 0

    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        # full_tensor is a collective over the stage's own ranks, which all hold the same names.
        local = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                 for k, v in self.lightning_module.state_dict().items()}
        if not self._stage_leader():
            return {}
        stages = [None] * self.layout[0] if self.global_rank == 0 else None
        dist.gather_object(local, stages, dst=0, group=self._device_mesh["pipeline_parallel"].get_group())
        if stages is None:
            return {}
        merged: dict[str, Any] = {}
        for stage in stages:  # a name several stages hold has the same value in each
            merged.update({k: v for k, v in stage.items() if k not in merged})
        return merged

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
        local = _to_cpu(optimizer.state_dict())
        gathered = [None] * self.world_size if self.global_rank == 0 else None
        dist.gather_object(local, gathered, dst=0)
        return {} if gathered is None else {"ranks": gathered, "layout": list(self.layout)}

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        # Every process reads the file (on one machine, or a filesystem the nodes share).
        path = Path(self.broadcast(checkpoint_path))
        checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only)
        load_full_state_dict(self.lightning_module, checkpoint["state_dict"])
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            ranks = state.get("ranks", state.get("pipeline_stages"))  # "pipeline_stages": before 3-D layouts
            layout = tuple(state.get("layout", (len(ranks), 1, 1)))
            if layout != self.layout:
                if self.global_rank != 0:
                    # Every rank read the same file and finds the same mismatch: rank 0 alone says so
                    # (one line, exit 2); the others stop quietly with the same status.
                    raise SystemExit(2)
                raise UserError(f"the checkpoint {path} was written by a (pipeline, data, tensor) = {layout} run "
                                f"and this run is {self.layout}: a run resumes on its own layout; to start another "
                                "layout from these weights, name the run folder in [init]", key="parallel")
            optimizer.load_state_dict(ranks[self.global_rank])
            _rewrap_dtensor_state(optimizer)
        return checkpoint


def load_full_state_dict(module: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy the single-device state dict ``full`` into ``module``'s stage, shards and all."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    mine = module.state_dict()
    missing = sorted(set(mine) - set(full))
    if missing:  # a checkpoint of another model
        raise KeyError(f"the checkpoint lacks {missing[:3]}")
    with torch.no_grad():
        for name, value in mine.items():
            if isinstance(value, DTensor):
                # src_data_rank=None: every rank cuts its own shard from the full tensor it read.
                shard = distribute_tensor(full[name], value.device_mesh, value.placements, src_data_rank=None)
                value.to_local().copy_(shard.to_local())
            else:
                value.copy_(full[name])


def _rewrap_dtensor_state(optimizer) -> None:
    # The states were saved as each rank's local shards; a DTensor parameter's states are DTensors
    # placed as the parameter is.
    from torch.distributed.tensor import DTensor

    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0:
                    state[key] = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                                                    shape=p.shape, stride=p.stride())


def _to_cpu(value):
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local().detach().cpu()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
