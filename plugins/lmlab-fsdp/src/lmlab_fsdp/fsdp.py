"""Fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``).

Data parallel like DDP (each process trains on its own slice of the global batch), but no process
holds the whole model: every parameter, its gradient and its optimizer state are split in equal
shards across the N processes (ZeRO stage 3, Rajbhandari et al. 2020). The model is cut into
units (by default each transformer block, then the root: embeddings, final norm and head); before
a unit's forward its parameters are all-gathered, after it they are freed again
(``reshard_after_forward = true``) or kept until the backward pass (``false``: ZeRO-2-like, less
communication, more memory); after a unit's backward its gradients are reduce-scattered, so each
process ends the step with the averaged gradient of its own shard and steps the optimizer on that
shard alone. Per-device state is about 1/N of DDP's plus one gathered unit; the gathers of the
next unit overlap the computation of the current one. The global batch is
``batch_size × devices × num_nodes``.

Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB 2023,
https://arxiv.org/abs/2304.11277 (FSDP2 keeps each shard as a DTensor instead of a flat buffer);
Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
SC 2020, https://arxiv.org/abs/1910.02054.

Runs through Lightning's ``ModelParallelStrategy`` (its ``FSDPStrategy`` is FSDP1 and refuses the
CPU); the sharding itself is applied in ``configure_model``, which lmlab calls with the strategy's
device mesh. Checkpoints are consolidated: the full state dict and the full optimizer state are
gathered onto rank 0 and written as one file in the single-device format, so ``lmlab generate``
reads it as it reads any other, and a resumed run gives each process its shard of the weights and
of the optimizer state again. That costs a full copy of the model and optimizer state in rank 0's
host memory while saving.

Launching: Lightning re-runs the command once per extra local device (there is no ``spawn``); under
``torchrun`` or SLURM, which start every process themselves, it uses theirs.
"""

from typing import Any, Literal


from lmlab.api import Field, LaunchOptions, Parallel

Dtype = Literal["float32", "bfloat16", "float16"]


class FSDPOptions(LaunchOptions):
    accelerator: Literal["auto", "cpu", "gpu", "cuda"] = Field("auto", help="device type")
    reshard_after_forward: bool = Field(
        True, help="free each unit's gathered parameters after its forward and gather them again for "
                   "backward (ZeRO-3); false keeps them until backward (ZeRO-2-like: less communication, "
                   "more memory)")
    units: Literal["block", "part", "model"] = Field(
        "block", help="what is gathered at once: each transformer block (block), each block's attention "
                      "and ffn apart (part: less memory, more collectives), or the whole model (model); "
                      "the root (embeddings, final norm, head) is always one unit")
    param_dtype: Dtype | None = Field(
        None, help="dtype parameters are gathered and computed in (null: FSDP casts nothing and "
                   "train.precision alone decides, e.g. autocast under bf16-mixed)")
    reduce_dtype: Dtype | None = Field(
        None, help="dtype gradients are reduce-scattered in (null: param_dtype's, or the parameters' own)")
    cpu_offload: bool = Field(
        False, help="keep sharded parameters, gradients and optimizer state in host memory and step the "
                    "optimizer on the CPU (fits larger models, slower)")


class FullyShardedDataParallel(Parallel):
    """Parameters, gradients and optimizer state sharded across processes; units gathered as needed."""

    Options = FSDPOptions
    api = ">=1.20,<2"  # holds_whole_state; LaunchOptions.timeout_s (1.7); memory_savings (1.16) where there
    holds_whole_state = False

    def trainer_kwargs(self) -> dict[str, Any]:
        from datetime import timedelta

        from lightning.pytorch.strategies import ModelParallelStrategy

        o = self.options
        accelerator, devices, processes = o.processes()
        strategy = ModelParallelStrategy(
            # One mesh dimension: every process is a data-parallel replica holding one shard.
            data_parallel_size=processes, tensor_parallel_size=1,
            # Gather on rank 0 into one file: lmlab generate and resumption read the single-device format.
            save_distributed_checkpoint=False,
            process_group_backend=o.backend, timeout=timedelta(seconds=o.timeout_s))
        return {"strategy": strategy, "accelerator": accelerator, "devices": devices, "num_nodes": o.num_nodes}

    def configure_model(self, model, device_mesh) -> None:
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        o = self.options
        dtype = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        mixed = MixedPrecisionPolicy(param_dtype=dtype[o.param_dtype], reduce_dtype=dtype[o.reduce_dtype])
        # Pinned host memory needs an accelerator to pin for; on the CPU there is nothing to copy to.
        offload = (CPUOffloadPolicy(pin_memory=device_mesh.device_type != "cpu") if o.cpu_offload
                   else OffloadPolicy())
        shard = {"mesh": device_mesh["data_parallel"], "mp_policy": mixed, "offload_policy": offload}
        units = {"block": list(model.blocks),
                 "part": [m for b in model.blocks for m in (b.attn, b.ffn) if any(True for _ in m.parameters())],
                 "model": []}[o.units]
        for unit in units:  # innermost first: fully_shard(root) takes only what no unit claimed
            fully_shard(unit, reshard_after_forward=o.reshard_after_forward, **shard)
        # The logits leave in float32 so the loss is computed as autocast would compute it.
        root_mixed = MixedPrecisionPolicy(param_dtype=mixed.param_dtype, reduce_dtype=mixed.reduce_dtype,
                                          output_dtype=torch.float32 if o.param_dtype else None)
        # The root is needed again first in backward; FSDP keeps it gathered after forward anyway.
        fully_shard(model, reshard_after_forward=o.reshard_after_forward, **{**shard, "mp_policy": root_mixed})

    @classmethod
    def memory_savings(cls) -> list[tuple[str, dict[str, Any]]]:
        """Keeping the gathered units until backward saves a second all-gather; resharding, smaller
        units and host offload each hold less at the cost of more communication."""
        return [("FSDP, each block kept gathered from forward to backward (ZeRO-2-like)",
                 {"reshard_after_forward": False}),
                ("FSDP (ZeRO-3): parameters, gradients and optimizer states sharded, each block gathered "
                 "only while it computes", {"reshard_after_forward": True}),
                ("FSDP with each block's attention and ffn gathered apart", {"reshard_after_forward": True,
                                                                             "units": "part"}),
                ("FSDP with the sharded state in host memory", {"reshard_after_forward": True, "cpu_offload": True})]

    def memory_layout(self, model, world_size: int | None, precision: str):
        """Parameters, gradients and optimizer states sharded 1/N (FSDP2 shards every parameter);
        on top, the gathered units: the root (FSDP2 keeps it gathered from forward into backward),
        the unit being computed, the one prefetched and one unit's unsharded gradients, or every unit
        when they are not resharded after forward. Per micro-batch: parameters all-gathered for
        forward and, when resharded, again for backward; gradients reduce-scattered."""
        from lmlab.api.layout import Collective, MemoryLayout

        o = self.options
        n = o.planned_processes(world_size)[1]
        total = sum(p.numel() for p in model.parameters()) or 1
        if o.units == "block":
            units = list(model.blocks)
        elif o.units == "part":
            units = [m for b in model.blocks for m in (b.attn, b.ffn)]
        else:
            units = []
        unit = max((sum(p.numel() for p in u.parameters()) for u in units), default=0)
        root = total - sum(sum(p.numel() for p in u.parameters()) for u in units)
        gathered = 1.0 if not o.reshard_after_forward or not units else min(1.0, (root + 3 * unit) / total)
        shard = 1 / n if n > 1 else 1.0
        collectives = (
            Collective("all-gather", "parameters", n, size=2.0 if o.reshard_after_forward else 1.0,
                       per="micro-batch", dtype=o.param_dtype,
                       note="forward" + (" and backward" if o.reshard_after_forward else "")),
            Collective("reduce-scatter", "gradients", n, per="micro-batch", dtype=o.reduce_dtype or o.param_dtype),
        ) if n > 1 else ()
        return MemoryLayout(devices=n, params=shard, grads=shard, optimizer=shard,
                            gathered=gathered if n > 1 else 0.0, compute_dtype=o.param_dtype,
                            offload_params=o.cpu_offload, offload_optimizer=o.cpu_offload,
                            collectives=collectives)

