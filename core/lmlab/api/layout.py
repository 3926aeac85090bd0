"""How a parallel strategy lays a model's training state over devices: what ``lmlab plan`` multiplies.

A parallel plugin describes its layout in a :class:`MemoryLayout` (``Parallel.memory_layout``): the
fraction of the model's parameters, gradients and optimizer states one device holds, the dtypes it
keeps them in, what it gathers or buffers on top, and the collectives of one training step. The
core measures the model (parameter count, optimizer state, activations of one micro-batch) and does
the arithmetic; a plugin states only what it decides. Worked example, ZeRO stage 2 on N devices in
mixed precision (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", https://arxiv.org/abs/1910.02054): 16-bit parameters on every device, 16-bit
gradients and the fp32 master weights with Adam's two moments sharded N ways::

    MemoryLayout(devices=n, params=1.0, grads=1 / n, optimizer=1 / n, param_dtype="bfloat16",
                 grad_dtype="bfloat16", master_weights=True,
                 collectives=(Collective("reduce-scatter", "gradients", n),
                              Collective("all-gather", "parameters", n)))

Dtypes are torch dtype names (``"float32"``, ``"bfloat16"``, ``"float16"``); ``None`` means what
Lightning keeps under ``[train] precision``: float32 under ``32-true`` and under the ``*-mixed``
precisions (torch.autocast computes in 16 bits but parameters and gradients stay float32; the
16-bit copies autocast makes of the weights are measured with the activations), the named dtype
under ``bf16-true``/``64-true``.
"""

from dataclasses import dataclass
from typing import Literal

#: The collectives a layout may name. Volumes assume the bandwidth-optimal ring algorithms, as NCCL's
#: and gloo's large-message paths do: per device an all-reduce sends 2(g-1)/g of the tensor, an
#: all-gather or a reduce-scatter (g-1)/g of the full tensor; a send-recv sends the tensor once.
CollectiveOp = Literal["all-reduce", "all-gather", "reduce-scatter", "send-recv"]


@dataclass(frozen=True)
class Collective:
    """One kind of communication in a training step, as seen by one device.

    ``of`` says what is sent and ``size`` how much of it: for ``"parameters"`` and ``"gradients"`` a
    fraction of the whole model's parameters (1.0: all of them, in ``dtype``, default the layout's
    param/grad dtype); for ``"activations"`` a count of (micro-batch × block_size × d_model) tensors
    (tensor parallelism: 4 per block; a pipeline stage: 2 per micro-batch), in the compute dtype.
    ``group`` is how many devices take part; ``per`` whether it happens once per optimizer step or
    once per micro-batch (then ``train.grad_accum`` times a step).
    """

    op: CollectiveOp
    of: Literal["parameters", "gradients", "activations"]
    group: int
    size: float = 1.0
    per: Literal["step", "micro-batch"] = "step"
    dtype: str | None = None
    note: str = ""


@dataclass(frozen=True)
class MemoryLayout:
    """Where one training step's memory lives on each device, for ``lmlab plan``.

    Fractions are of the whole model (1.0: a full copy on every device; 1/N: sharded N ways).
    """

    #: processes (devices) the run uses in all
    devices: int
    #: data-parallel replicas, each training on its own micro-batch (default: ``devices``)
    replicas: int | None = None
    #: fraction of the parameters each device stores (ZeRO-3/FSDP: 1/N; tensor parallel: ~1/t)
    params: float = 1.0
    #: fraction of the gradients each device stores after the backward pass (ZeRO-2: 1/N)
    grads: float = 1.0
    #: fraction of the optimizer states (and the fp32 master weights) each device stores (ZeRO-1: 1/N)
    optimizer: float = 1.0
    #: multiple of one micro-batch's activations (whole model) a device holds: 1/t under tensor
    #: parallelism with sequence parallelism, several micro-batches' worth on a pipeline stage
    activations: float = 1.0
    #: fraction of the parameters held unsharded on top of the shard at the peak (FSDP/ZeRO-3: the
    #: gathered unit and the prefetched next one; all of them when not resharded after forward)
    gathered: float = 0.0
    #: dtype of the stored parameters and gradients (None: as the precision keeps them, see above)
    param_dtype: str | None = None
    grad_dtype: str | None = None
    #: dtype the weights have in the forward pass when the strategy casts them itself (FSDP's
    #: param_dtype); gathered parameters are in it. None: param_dtype (autocast casts under mixed)
    compute_dtype: str | None = None
    #: the forward pass runs under torch.autocast when the precision is ``*-mixed`` (Lightning's
    #: precision plugins); False where the strategy casts the model itself instead (DeepSpeed)
    autocast: bool = True
    #: a separate fp32 copy of the parameters lives with the optimizer states (DeepSpeed: ZeRO's K = 12)
    master_weights: bool = False
    #: gradients stay allocated between steps (DDP's bucket views) rather than freed by zero_grad
    persistent_grads: bool = False
    #: the strategy frees gradients right after the optimizer step (DeepSpeed's engine), not after the
    #: next forward pass as Lightning's loop does, so they are not allocated while activations peak
    grads_freed_at_step: bool = False
    #: fraction of the gradients held again in persistent communication buffers (DDP's buckets when
    #: gradients are not views of them)
    grad_buffers: float = 0.0
    #: optimizer states (and master weights) live in host memory and are stepped there
    offload_optimizer: bool = False
    #: the stored parameter shards live in host memory and are copied in when gathered
    offload_params: bool = False
    collectives: tuple[Collective, ...] = ()
    #: what the plan should say about this layout (one line each)
    notes: tuple[str, ...] = ()

    def __post_init__(self):
        if self.devices < 1:
            raise ValueError(f"devices must be at least 1, got {self.devices}")
        for name in ("params", "grads", "optimizer", "activations", "gathered", "grad_buffers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")

    @property
    def data_parallel(self) -> int:
        return self.replicas if self.replicas is not None else self.devices
