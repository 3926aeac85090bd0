"""Tensor parallelism (Megatron-LM), alone or with FSDP over a second mesh dimension (2D).

Shoeybi et al. (2019) split each transformer layer across ``t`` devices instead of splitting the
batch: attention by heads (query, key and value projections column-wise, so each device computes
``n_heads / t`` whole heads; the output projection row-wise) and the feed-forward network by hidden
units (the projections into the hidden width column-wise, the one back row-wise). Each part then
needs a single all-reduce of its output in the forward pass and one of its input gradient in the
backward pass; weights, gradients and optimizer states of those layers shrink ``t``-fold. The
embeddings, norms and head stay whole and replicated in every device of the group, which computes
them on the same input (their gradients agree because the sharded layers' input gradients are
all-reduced). Layers are split with DTensors (``torch.distributed.tensor.parallel``).

The plugin knows no module's insides: each block's attention and ffn modules supply their plan
through ``lmlab.api`` (``AttentionModule.tensor_parallel_plan``, ``FFNModule.tensor_parallel_plan``),
and a layout they cannot take (heads not divisible) is refused when the model is built, before any
process starts.

2D: with ``devices × num_nodes = d × t`` processes, the mesh is ``(data_parallel = d,
tensor_parallel = t)``, tensor-parallel groups being adjacent ranks (one node's fast links carry the
per-layer all-reduces). Tensor parallelism is applied first, then FSDP2's ``fully_shard`` over the
data-parallel dimension (each block, then the root), as torchtitan does; each data-parallel index
trains on its own slice of the global batch (``batch_size × d`` sequences), the ``t`` ranks of a
group on the same one.

Checkpoints are consolidated: rank 0 gathers the full state dict (and optimizer state) and writes
one file in the single-device layout and names, which ``lmlab generate`` loads into a one-device
model and a resumed run loads back into the shards. Gradient clipping uses the norm of the whole
gradient: sharded parts summed over their ranks, replicated ones counted once.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", 2019, https://arxiv.org/abs/1909.08053; Liang et al., "TorchTitan: One-stop PyTorch
native solution for production ready LLM pre-training", 2024, https://arxiv.org/abs/2410.06511.
"""

from typing import Any

from pydantic import PositiveInt

from lmlab.api import Field, Parallel, UserError
from lmlab_modelparallel.common import ModelParallelLaunchOptions, clip_by_global_norm, dtensor_aware_norm, numel


class TensorParallelOptions(ModelParallelLaunchOptions):
    tensor_parallel_size: PositiveInt | None = Field(
        None, help="processes that split each layer (its heads and hidden units); must divide the "
                   "processes in all, the rest forming FSDP data-parallel replicas; default: the "
                   "processes of one node")


class TensorParallel(Parallel):
    """Layers split across devices by heads and hidden units (Megatron-LM), FSDP across the rest."""

    Options = TensorParallelOptions
    api = ">=1.20,<2"  # holds_whole_state; LaunchOptions.timeout_s, Plugin.check (1.7); configure_model, clip_grad_norm, tensor_parallel_plan
    holds_whole_state = False

    def sizes(self) -> tuple[str, int, int, int]:
        """(accelerator, processes per node, data-parallel size, tensor-parallel size)."""
        accelerator, devices, world = self.options.processes()
        tp = self.options.tensor_parallel_size or devices
        if world % tp:
            raise UserError(f"must divide the {world} processes (devices × num_nodes); got {tp}",
                            key="parallel.tensor_parallel_size")
        return accelerator, devices, world // tp, tp

    def data_parallel_replicas(self) -> int:
        per_node, n = self.options.planned_processes(None)
        return max(1, n // (self.options.tensor_parallel_size or per_node))

    def trainer_kwargs(self) -> dict[str, Any]:
        from datetime import timedelta

        from lightning.pytorch.strategies import ModelParallelStrategy

        accelerator, devices, dp, tp = self.sizes()
        strategy = ModelParallelStrategy(
            data_parallel_size=dp, tensor_parallel_size=tp,
            # Gathered on rank 0 into one file: the single-device format lmlab generate reads.
            save_distributed_checkpoint=False, process_group_backend=self.options.backend,
            timeout=timedelta(seconds=self.options.timeout_s))
        return {"strategy": strategy, "accelerator": accelerator, "devices": devices,
                "num_nodes": self.options.num_nodes}

    def check(self, context) -> None:
        # Before any process starts: a layout the modules refuse (heads that do not split) is bad input.
        super().check(context)
        if not context.machine:
            return
        _, _, _, tp = self.sizes()
        if tp > 1 and context.model is not None:
            plans(context.model, tp)  # on the meta device: the plans, no weights

    def configure_model(self, model, device_mesh) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        tp_mesh, dp_mesh = device_mesh["tensor_parallel"], device_mesh["data_parallel"]
        if tp_mesh.size() > 1:
            for module, plan in plans(model, tp_mesh.size()):
                parallelize_module(module, tp_mesh, plan)
        if dp_mesh.size() > 1:
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:  # innermost first: the root takes what no block claimed
                fully_shard(block, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)

    def memory_layout(self, model, world_size: int | None, precision: str):
        """The blocks' attention and ffn weights (and their gradients and optimizer states) split
        ``t`` ways, the rest replicated in the group; FSDP shards all of it ``d`` ways more. Activations
        as Korthikanti et al. (2022, arXiv:2205.05198) count them without sequence parallelism: of the 34 units per token
        and width a layer saves, 24 are split ``t`` ways. Per micro-batch, per block, an all-reduce of
        the activations in forward and one in backward for attention and for the ffn."""
        from lmlab.api.layout import Collective, MemoryLayout

        per_node, n = self.options.planned_processes(world_size)
        tp = self.options.tensor_parallel_size or per_node
        if n % tp:
            raise UserError(f"must divide the {n} processes planned for; got {tp}", key="parallel.tensor_parallel_size")
        dp = n // tp
        total = numel(model) or 1
        split = sum(numel(m) for b in model.blocks for m in (b.attn, b.ffn) if not getattr(m, "skip", False))
        held = (split / tp + total - split) / total / dp
        collectives = [Collective("all-reduce", "activations", tp, size=4 * len(model.blocks), per="micro-batch",
                                  note="the sharded layers' outputs in forward, their inputs' gradients in backward")]
        if dp > 1:
            collectives += [Collective("all-gather", "parameters", dp, size=2 * held * dp, per="micro-batch",
                                       note="FSDP: forward and backward"),
                            Collective("reduce-scatter", "gradients", dp, size=held * dp, per="micro-batch")]
        unit = max((numel(b) for b in model.blocks), default=0) / total
        return MemoryLayout(devices=n, replicas=dp, params=held, grads=held, optimizer=held,
                            activations=(10 + 24 / tp) / 34, gathered=3 * unit / tp if dp > 1 else 0.0,
                            collectives=tuple(collectives) if n > 1 else ())

    def clip_grad_norm(self, parameters, max_norm: float):
        grads = [p.grad for p in parameters if p.grad is not None]
        total = dtensor_aware_norm(grads)
        clip_by_global_norm(grads, total, max_norm)
        return total


def plans(model, tp_size: int, blocks=None, key: str = "parallel.tensor_parallel_size") -> list[tuple[Any, dict]]:
    """(module, plan) for the attention and ffn of every block (or of ``blocks``, a pipeline stage's); a
    UserError naming the manifest key when a module has no plan (its plugin does not support tensor
    parallelism) or cannot be split so (``key``: the option that sets ``tp_size``)."""
    found = []
    for block in model.blocks if blocks is None else blocks:
        parts = [("attention", block.attn)]
        if not getattr(block.ffn, "skip", False):
            parts.append(("ffn", block.ffn))
        for slot, module in parts:
            try:
                plan = module.tensor_parallel_plan(tp_size)
            except ValueError as exc:
                raise UserError(f"does not fit the {slot} plugin: {exc}", key=key) from None
            if plan is None:
                raise UserError(f"the {slot} plugin's modules ({type(module).__name__}) do not support tensor "
                                f"parallelism (no tensor_parallel_plan); choose another {slot} plugin or "
                                "another parallel plugin", key=f"{slot}.use")
            found.append((module, plan))
    return found
