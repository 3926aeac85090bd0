"""Pipeline parallelism: the blocks split into consecutive stages, one per process, fed micro-batches.

GPipe (Huang et al. 2019) cuts the layer stack into ``p`` stages on ``p`` devices and each batch into
``m`` micro-batches: stage ``s`` runs micro-batch ``i`` while stage ``s + 1`` runs micro-batch
``i - 1``, and only activations at stage boundaries travel (point to point). GPipe runs every
forward pass, then every backward pass, so a stage keeps the activations of all ``m`` micro-batches;
1F1B (PipeDream-Flush, Narayanan et al. 2021) alternates one forward and one backward once the pipe
is full, keeping at most ``p`` micro-batches' activations, with the same bubble (idle) fraction
``(p - 1) / (m + p - 1)``. Gradients of the micro-batches accumulate, so one optimizer step sees the
whole batch, exactly as on one device. The schedules are ``torch.distributed.pipelining``'s.

The stages come from the model itself (``lmlab.api.LanguageModel.pipeline_stage``): the first keeps
the token embedding, the last the final norm and head, every stage the position module; parameter
names stay the single-device ones. A parameter held by several stages (the embedding that the head
shares under weight tying, as Megatron-LM's first and last stages share it; a position module's
weights) has its gradient summed over those stages after each backward pass, so its copies take
identical optimizer steps and never drift apart. Gradient clipping uses the norm of the whole
model's gradient, summed over the stages (shared parameters counted once).

How it meets Lightning, which has no pipeline strategy: the strategy is Lightning's
``ModelParallelStrategy`` (process group, launcher, device mesh) with the mesh
``(pipeline_parallel = p, data_parallel = 1, tensor_parallel = 1)``, so every stage reads the same
batch (the ``3d`` plugin grows the other two dimensions). The schedule
runs forward and backward together, so this plugin sets ``Parallel.runs_forward_backward``: lmlab's
LightningModule then hands each training micro-batch to :meth:`PipelineParallel.forward_backward`
where it would call ``loss.backward()`` and each evaluation batch to ``forward_loss``; everything
else (optimizer, learning-rate schedule, accumulation, logging, checkpoint timing) stays Lightning's.
The loss exists on the last stage only, and is broadcast from there, so every process reports the
same value (and lmlab's average over processes is that value). The strategy subclass gathers the
stages' state dicts on rank 0 into one single-device checkpoint (``lmlab generate`` loads it into a
whole model), with each stage's optimizer state beside it for resumption on the same layout.

Limits: one data-parallel replica (the stages are all the processes); ffn modules with an auxiliary
loss (``moe``) are refused, their loss would stay on their own stage; ``train.compile`` is not applied
to the stages; with dropout the masks differ from a single device's (each stage draws its own).

Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism",
NeurIPS 2019, https://arxiv.org/abs/1811.06965; Narayanan et al., "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", SC 2021, https://arxiv.org/abs/2104.04473.
"""

from datetime import timedelta
from typing import Any, Literal

import torch
from pydantic import PositiveInt

from lmlab.api import Batch, FFNModule, Field, Parallel, UserError
from lmlab_modelparallel.common import ModelParallelLaunchOptions, clip_by_global_norm, numel


class PipelineOptions(ModelParallelLaunchOptions):
    schedule: Literal["gpipe", "1f1b"] = Field(
        "1f1b", help="gpipe: all forward passes, then all backward passes; 1f1b: alternate once the "
                     "pipe is full (same bubble, activations of at most `stages` micro-batches)")
    n_microbatches: PositiveInt | None = Field(
        None, help="micro-batches each train.batch_size batch is cut into (must divide it; 1f1b needs "
                   "at least one per stage); default: one per stage")
    split: list[PositiveInt] | None = Field(
        None, help="blocks per stage, first to last, e.g. [3, 5]; one entry per process, summing to "
                   "model.n_layers; default: as even as possible, earlier stages taking the extra ones")


class PipelineParallel(Parallel):
    """Consecutive blocks on consecutive processes; micro-batches flow through (GPipe, 1F1B)."""

    Options = PipelineOptions
    api = ">=1.20,<2"  # CheckContext.run; LaunchOptions.timeout_s, Plugin.check (1.7); configure_model, runs_forward_backward, clip_grad_norm, pipeline_stage
    runs_forward_backward = True
    holds_whole_state = False
    stages_key, stages_from = "parallel.devices", "one per process: devices × num_nodes"

    def __init__(self, options=None):
        super().__init__(options)
        self.stage = None  # this process's stage, once configure_model has split the model

    def data_parallel_replicas(self) -> int:
        return 1  # every stage reads the same batch

    def trainer_kwargs(self) -> dict[str, Any]:
        from lmlab_modelparallel.pipeline_strategy import PipelineStrategy

        accelerator, devices, stages = self.options.processes()
        return {"strategy": PipelineStrategy(stages, process_group_backend=self.options.backend,
                                                timeout=timedelta(seconds=self.options.timeout_s)),
                "accelerator": accelerator, "devices": devices, "num_nodes": self.options.num_nodes}

    def bounds(self, n_layers: int, stages: int) -> list[int]:
        """Block indices where the stages start, and n_layers: stage s runs [b[s], b[s + 1])."""
        o = self.options
        if stages > n_layers:
            raise UserError(f"{stages} pipeline stages ({self.stages_from}) need at least as many blocks, and "
                            f"model.n_layers is {n_layers}", key=self.stages_key)
        if o.split is None:
            sizes = [n_layers // stages + (s < n_layers % stages) for s in range(stages)]
        elif len(o.split) != stages or sum(o.split) != n_layers:
            raise UserError(f"needs one entry per stage ({stages}, devices × num_nodes) summing to model.n_layers "
                            f"({n_layers}); got {o.split}", key="parallel.split")
        else:
            sizes = o.split
        return [sum(sizes[:s]) for s in range(stages + 1)]

    def microbatches(self, stages: int) -> int:
        return self.options.n_microbatches or stages

    def check(self, context) -> None:
        # Checked before any process starts, so bad input stops with one line.
        super().check(context)
        if context.machine:
            self.check_stages(context, self.options.processes()[2])

    def check_stages(self, context, stages: int) -> None:
        """Refuse ``stages`` stages the model's blocks or the batch's micro-batches cannot make."""
        self.bounds(context.shape.n_layers, stages)
        m, batch = self.microbatches(stages), context.run.train.batch_size
        if batch % m:
            raise UserError(f"must divide train.batch_size ({batch}); got {m}", key="parallel.n_microbatches")
        if self.options.schedule == "1f1b" and m < stages:
            raise UserError(f"1f1b needs at least one micro-batch per stage ({stages}); got {m}",
                            key="parallel.n_microbatches")

    def configure_model(self, model, device_mesh) -> None:
        from lmlab_modelparallel.stage import Stage

        mesh = device_mesh["pipeline_parallel"]
        index, stages = mesh.get_local_rank(), mesh.size()
        bounds = self.bounds(len(model.blocks), stages)
        model.pipeline_stage(bounds[index], bounds[index + 1])
        self.stage = Stage(model, index, stages, mesh.get_group(), self.microbatches(stages), self.options.schedule)

    def forward_backward(self, model, batch: Batch, loss_fn, grad_scale: float) -> torch.Tensor:
        loss = self.stage.run(batch, loss_fn, grad_scale, train=True)
        if any(isinstance(m, FFNModule) and m.aux_loss is not None for m in model.modules()):
            raise UserError("an ffn module with an auxiliary loss (e.g. moe's load balancing) cannot be "
                            "pipelined: its loss stays on its own stage", key="ffn.use")
        return loss

    def forward_loss(self, model, batch: Batch, loss_fn) -> torch.Tensor:
        return self.stage.run(batch, loss_fn, 1.0, train=False)

    def memory_layout(self, model, world_size: int | None, precision: str):
        """The fullest stage: its blocks (the first also the embedding, the last the final norm and
        head, and the embedding again when tied), with their gradients and optimizer states, and the
        activations of the micro-batches it holds at once (all of them under GPipe; under 1F1B at
        most one per stage from it to the last), each ``1 / n_microbatches`` of a batch. Per micro-batch, each stage
        sends its output forward and receives a gradient back."""
        from lmlab.api.layout import Collective, MemoryLayout

        _, stages = self.options.planned_processes(world_size)
        m = self.microbatches(stages)
        fullest, _, activations = self.fullest_stage(model, stages)
        sends = (Collective("send-recv", "activations", 2, size=2, per="micro-batch",
                            note=f"{m} pipeline micro-batches each way"),) if stages > 1 else ()
        return MemoryLayout(devices=stages, replicas=1, params=fullest, grads=fullest, optimizer=fullest,
                            activations=activations, collectives=sends,
                            notes=(f"pipeline bubble: {(stages - 1) / (m + stages - 1):.0%} of each step idle",))

    def fullest_stage(self, model, stages: int, tensor: int = 1) -> tuple[float, int, float]:
        """For ``lmlab plan``: the largest fraction of the model one stage holds (its blocks' attention
        and ffn split ``tensor`` ways), that stage's number of blocks, and the most activations a
        stage keeps, as a multiple of one micro-batch's through the whole model (the micro-batches
        in flight on it: all under GPipe, under 1F1B at most one per stage from it to the last;
        each ``1 / n_microbatches`` of a batch, with Korthikanti et al.'s (2022) tensor-parallel
        share: 24 of the 34 units per token and width are split ``tensor`` ways)."""
        n_layers, m = len(model.blocks), self.microbatches(stages)
        bounds = self.bounds(n_layers, stages)
        total = numel(model) or 1
        embedding, position = numel(model.tok_emb), numel(model.position)
        tied = model.head.weight is model.tok_emb.weight
        head = numel(model.norm_f) + (0 if tied else numel(model.head))
        fullest, fullest_blocks, activations = 0.0, 0, 0.0
        for s in range(stages):
            first, final = s == 0, s == stages - 1
            blocks = range(bounds[s], bounds[s + 1])
            split = sum(numel(part) for i in blocks for part in (model.blocks[i].attn, model.blocks[i].ffn)
                        if not getattr(part, "skip", False)) if tensor > 1 else 0
            rest = position + sum(numel(model.blocks[i]) for i in blocks) - split
            rest += embedding * (first or (final and tied)) + head * final
            held = (split / tensor + rest) / total
            if held > fullest:
                fullest, fullest_blocks = held, len(blocks)
            in_flight = m if self.options.schedule == "gpipe" else min(stages - s, m)
            activations = max(activations, len(blocks) / n_layers * in_flight / m * (10 + 24 / tensor) / 34)
        return fullest, fullest_blocks, activations

    def clip_grad_norm(self, parameters, max_norm: float):
        import torch.distributed as dist

        owned = self.stage.owned_grads()
        square = torch.zeros((), device=self.stage.device)
        for g in owned:
            square += g.detach().float().square().sum()
        dist.all_reduce(square, group=self.stage.group)  # the stages' sums: the whole model's
        total = square.sqrt()
        clip_by_global_norm([p.grad for p in parameters if p.grad is not None], total, max_norm)
        return total
