"""3-D parallelism: pipeline stages, tensor parallelism inside each stage, FSDP across replicas.

The recipe of Megatron-LM (Narayanan et al. 2021) and torchtitan (Liang et al. 2024) for models too
large for any one of the three: ``p × d × t`` processes on one DeviceMesh ``(pipeline_parallel,
data_parallel, tensor_parallel)``, outermost first, as ``lmlab_modelparallel.pipeline_strategy``
lays it out. Tensor-parallel groups are adjacent ranks, so the per-layer all-reduces stay on one
node's fast links; the stages are the outermost dimension, so only point-to-point activations cross
the slowest links.

Each process first becomes its stage (``LanguageModel.pipeline_stage``), then splits the stage's
blocks by heads and hidden units over its tensor-parallel group (the attention and ffn plugins'
``tensor_parallel_plan``), then shards everything it holds over its data-parallel group with
FSDP2's ``fully_shard`` (each block, then the stage's root), and hands the result to
``torch.distributed.pipelining``, whose schedules defer FSDP's gradient reduce-scatter to the last
micro-batch. Parameters stay gathered from the first forward to the last backward of a step
(``reshard_after_forward=False``, torchtitan's choice under a pipeline): gathering them again for
every micro-batch would multiply the all-gathers by ``n_microbatches``.

Each data-parallel index trains on its own slice of the global batch (``batch_size × d``
sequences); the ``p × t`` ranks of one replica read the same slice. Gradient clipping uses the
norm of the whole model's gradient: each stage's norm over its shards, summed over the stages with
shared parameters counted once. Checkpoints are consolidated into the single-device layout, so a
3-D run's weights load into one device (``lmlab generate``) or any other layout (``[init]``).

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
SC 2021, https://arxiv.org/abs/2104.04473; Liang et al., "TorchTitan: One-stop PyTorch native
solution for production ready LLM pre-training", 2024, https://arxiv.org/abs/2410.06511.
"""

from typing import Any

from pydantic import PositiveInt

from lmlab.api import Field, UserError
from lmlab_modelparallel.common import clip_by_global_norm, dtensor_aware_norm
from lmlab_modelparallel.pipeline import PipelineOptions, PipelineParallel
from lmlab_modelparallel.tensor import plans


class ThreeDOptions(PipelineOptions):
    pipeline: PositiveInt = Field(1, help="pipeline stages (the outermost mesh dimension); at most model.n_layers")
    tensor: PositiveInt = Field(1, help="processes that split each layer (the innermost dimension: keep it "
                                        "within a node); must divide the heads and the ffn's hidden width")
    data: PositiveInt = Field(1, help="data-parallel replicas, sharded with FSDP2; the global batch is "
                                      "train.batch_size × data")


class ThreeD(PipelineParallel):
    """Pipeline × data × tensor parallelism on one DeviceMesh (Megatron-LM's 3-D layout)."""

    Options = ThreeDOptions
    api = ">=1.7,<2"  # as the pipeline plugin
    stages_key, stages_from = "parallel.pipeline", "parallel.pipeline"

    def degrees(self) -> tuple[int, int, int]:
        """(pipeline, data, tensor), outermost first."""
        o = self.options
        return o.pipeline, o.data, o.tensor

    def data_parallel_replicas(self) -> int:
        return self.options.data

    def _check_product(self, world: int, counted: str) -> None:
        p, d, t = self.degrees()
        if p * d * t != world:
            raise UserError(f"pipeline × data × tensor = {p} × {d} × {t} = {p * d * t}, but the run has {world} "
                            f"processes ({counted}); the degrees must multiply to the processes",
                            key="parallel.devices")

    def trainer_kwargs(self) -> dict[str, Any]:
        from datetime import timedelta

        from lmlab_modelparallel.pipeline_strategy import PipelineStrategy

        accelerator, devices, world = self.options.processes()
        self._check_product(world, "devices × num_nodes")
        p, d, t = self.degrees()
        strategy = PipelineStrategy(p, d, t, process_group_backend=self.options.backend,
                                    timeout=timedelta(seconds=self.options.timeout_s))
        return {"strategy": strategy, "accelerator": accelerator, "devices": devices,
                "num_nodes": self.options.num_nodes}

    def check(self, context) -> None:
        # Every degree is checked before any process starts, each naming its own option.
        if context.machine:
            _, _, world = self.options.processes()
            self._check_product(world, "devices × num_nodes")
        p, _, t = self.degrees()
        self.check_stages(context, p)
        if t > 1 and context.model is not None:
            plans(context.model, t, key="parallel.tensor")  # on the meta device: the plans, no weights
        super(PipelineParallel, self).check(context)  # the machine's devices and precision

    def configure_model(self, model, device_mesh) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        from lmlab_modelparallel.stage import Stage

        pp, dp, tp = (device_mesh[name] for name in ("pipeline_parallel", "data_parallel", "tensor_parallel"))
        index, stages = pp.get_local_rank(), pp.size()
        bounds = self.bounds(len(model.blocks), stages)
        model.pipeline_stage(bounds[index], bounds[index + 1])
        kept = [model.blocks[i] for i in range(bounds[index], bounds[index + 1])]
        if tp.size() > 1:
            for module, plan in plans(model, tp.size(), blocks=kept, key="parallel.tensor"):
                parallelize_module(module, tp, plan)
        if dp.size() > 1:
            from torch.distributed.fsdp import fully_shard

            for block in kept:  # innermost first: the stage's root takes what no block claimed
                fully_shard(block, mesh=dp, reshard_after_forward=False)
            fully_shard(model, mesh=dp, reshard_after_forward=False)
        # Every pipeline's global ranks, stage by stage: groups are created collectively over the world.
        p, d, t = device_mesh.mesh.shape
        pipelines = device_mesh.mesh.permute(1, 2, 0).reshape(d * t, p).tolist()
        self.stage = Stage(model, index, stages, pp.get_group(), self.microbatches(stages), self.options.schedule,
                           pipelines=pipelines)

    def clip_grad_norm(self, parameters, max_norm: float):
        import torch.distributed as dist

        # This stage's norm (over its data- and tensor-parallel shards), then the stages' summed.
        square = dtensor_aware_norm(self.stage.owned_grads()).to(self.stage.device).float().square()
        dist.all_reduce(square, group=self.stage.group)
        total = square.sqrt()
        clip_by_global_norm([p.grad for p in parameters if p.grad is not None], total, max_norm)
        return total

    def memory_layout(self, model, world_size: int | None, precision: str):
        """The fullest stage after tensor parallelism (its blocks' attention and ffn ``1/t``, the rest
        of the stage whole), sharded ``d`` ways by FSDP; the whole stage held gathered during a step
        (not resharded between micro-batches). Activations: the pipeline's micro-batches in flight
        on a stage, with the tensor-parallel share (``PipelineParallel.fullest_stage``). Communication
        per micro-batch: the tensor-parallel all-reduces of the stage's blocks, the pipeline's sends,
        and FSDP's all-gather and reduce-scatter of the stage."""
        from lmlab.api.layout import Collective, MemoryLayout

        p, d, t = self.degrees()
        if world_size is not None:
            self._check_product(world_size, "lmlab plan --devices")
        m = self.microbatches(p)
        stage_held, stage_blocks, activations = self.fullest_stage(model, p, tensor=t)
        shard = stage_held / d
        collectives = []
        if t > 1:
            collectives.append(Collective("all-reduce", "activations", t, size=4 * stage_blocks, per="micro-batch",
                                          note="tensor parallel: each block's attention and ffn, forward and backward"))
        if p > 1:
            collectives.append(Collective("send-recv", "activations", 2, size=2, per="micro-batch",
                                          note=f"pipeline: {m} micro-batches each way between neighbouring stages"))
        if d > 1:
            collectives += [Collective("all-gather", "parameters", d, size=stage_held, per="micro-batch",
                                       note="FSDP: the stage, once per step (kept through the micro-batches)"),
                            Collective("reduce-scatter", "gradients", d, size=stage_held, per="micro-batch",
                                       note="FSDP: after the last micro-batch's backward")]
        notes = (f"mesh (pipeline, data, tensor) = ({p}, {d}, {t}); fullest stage: {stage_blocks} blocks",)
        if p > 1:
            notes += (f"pipeline bubble: {(p - 1) / (m + p - 1):.0%} of each step idle",)
        return MemoryLayout(devices=p * d * t, replicas=d, params=shard, grads=shard, optimizer=shard,
                            activations=activations, gathered=stage_held - shard if d > 1 else 0.0,
                            collectives=tuple(collectives), notes=notes)
