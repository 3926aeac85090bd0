"""Distributed data parallel (DDP).

Every process holds a full replica of the model and trains on its own batches (lmlab draws each
rank's random windows from a stream seeded by seed, rank and step; validation is sharded by
Lightning's ``DistributedSampler``). After the backward pass, gradients are
averaged across processes with bucketed all-reduce that overlaps the rest of the backward pass, so
the replicas take identical optimizer steps and stay bit-identical. The global batch is
``batch_size × devices × num_nodes``.

Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020.
https://arxiv.org/abs/2006.15704

Launching: ``start_method = "popen"`` (the default) re-runs the current command once per extra
local device, and is what ``torchrun`` and SLURM (which start every process themselves) need;
``spawn``/``fork`` start workers with ``multiprocessing`` from inside this process (notebooks,
tests), ``fork`` being unsafe once CUDA is initialised.
"""

from typing import Any, Literal

from lmlab.api import Field, LaunchOptions, Parallel


class DDPOptions(LaunchOptions):
    start_method: Literal["popen", "spawn", "fork", "forkserver"] = Field(
        "popen", help="how worker processes start; popen re-runs the command (torchrun/SLURM friendly)")
    find_unused_parameters: bool = Field(
        False, help="search the graph each step for parameters without gradients (slower; needed "
                    "when some parameters are skipped, e.g. MoE experts that get no tokens)")
    static_graph: bool = Field(
        False, help="promise the set of used parameters never changes between steps (enables "
                    "optimisations, and activation checkpointing with unused parameters)")
    gradient_as_bucket_view: bool = Field(
        True, help="gradients alias the all-reduce buckets, saving one gradient-sized copy of memory")


class DistributedDataParallel(Parallel):
    """One model replica per device; gradients all-reduced after each backward pass."""

    Options = DDPOptions
    api = ">=1.7,<2"  # LaunchOptions.timeout_s

    def trainer_kwargs(self) -> dict[str, Any]:
        from datetime import timedelta

        from lightning.pytorch.strategies import DDPStrategy

        o = self.options
        o.processes()  # checked against the machine (check did so too); Lightning gets the options as written
        strategy = DDPStrategy(
            process_group_backend=o.backend,  # None: Lightning picks nccl for CUDA, gloo otherwise
            start_method=o.start_method,
            timeout=timedelta(seconds=o.timeout_s),
            # The rest are forwarded to torch.nn.parallel.DistributedDataParallel.
            find_unused_parameters=o.find_unused_parameters,
            static_graph=o.static_graph,
            gradient_as_bucket_view=o.gradient_as_bucket_view,
        )
        return {"strategy": strategy, "accelerator": o.accelerator, "devices": o.devices, "num_nodes": o.num_nodes}

    def memory_layout(self, model, world_size: int | None, precision: str):
        """A full replica per device. Gradients live in DDP's all-reduce buckets, which persist between
        steps: as views of them (``gradient_as_bucket_view``) or beside them, a second copy. One
        all-reduce of all gradients per optimizer step (Lightning skips it on accumulating micro-batches)."""
        from lmlab.api.layout import Collective, MemoryLayout  # API 1.4; here so older cores still load the plugin

        o = self.options
        n = o.planned_processes(world_size)[1]
        views = o.gradient_as_bucket_view
        all_reduce = Collective("all-reduce", "gradients", n, note="bucketed, overlapped with the backward pass")
        return MemoryLayout(devices=n, persistent_grads=views, grad_buffers=0.0 if views else 1.0,
                            collectives=(all_reduce,) if n > 1 else ())

