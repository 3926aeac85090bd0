"""How a parallel strategy lays a model's training state over devices: what ``lmlab plan`` multiplies.

A parallel plugin describes its layout in a [MemoryLayout][lmlab.api.layout.MemoryLayout]
([Parallel.memory_layout][lmlab.api.parallel.Parallel.memory_layout]): the
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

CollectiveOp = Literal["all-reduce", "all-gather", "reduce-scatter", "send-recv"]
"""The collectives a layout may name. Volumes assume the bandwidth-optimal ring algorithms, as NCCL's
and gloo's large-message paths do: per device an all-reduce sends 2(g-1)/g of the tensor, an
all-gather or a reduce-scatter (g-1)/g of the full tensor; a send-recv sends the tensor once."""


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
    """The kind of collective."""
    of: Literal["parameters", "gradients", "activations"]
    """What is sent."""
    group: int
    """How many devices take part."""
    size: float = 1.0
    """How much is sent: a fraction of the model's parameters, or a count of activation tensors."""
    per: Literal["step", "micro-batch"] = "step"
    """Once per optimizer step, or once per micro-batch."""
    dtype: str | None = None
    """The dtype sent (None: the layout's param/grad dtype, or the compute dtype for activations)."""
    note: str = ""
    """What the plan prints beside it (when in the step it happens, ...)."""


@dataclass(frozen=True)
class MemoryLayout:
    """Where one training step's memory lives on each device, for ``lmlab plan``.

    Fractions are of the whole model (1.0: a full copy on every device; 1/N: sharded N ways). Dtypes
    are torch dtype names, None meaning what the precision keeps (see the module's description).
    """

    devices: int
    """Processes (devices) the run uses in all."""
    replicas: int | None = None
    """Data-parallel replicas, each training on its own micro-batch (default: ``devices``)."""
    params: float = 1.0
    """Fraction of the parameters each device stores (ZeRO-3/FSDP: 1/N; tensor parallel: ~1/t)."""
    grads: float = 1.0
    """Fraction of the gradients each device stores after the backward pass (ZeRO-2: 1/N)."""
    optimizer: float = 1.0
    """Fraction of the optimizer states (and the fp32 master weights) each device stores (ZeRO-1:
    1/N)."""
    activations: float = 1.0
    """Multiple of one micro-batch's activations (whole model) a device holds: 1/t under tensor
    parallelism with sequence parallelism, several micro-batches' worth on a pipeline stage."""
    gathered: float = 0.0
    """Fraction of the parameters held unsharded on top of the shard at the peak (FSDP/ZeRO-3: the
    gathered unit and the prefetched next one; all of them when not resharded after forward)."""
    param_dtype: str | None = None
    """Dtype of the stored parameters (None: as the precision keeps them)."""
    grad_dtype: str | None = None
    """Dtype of the stored gradients (None: as the precision keeps them)."""
    compute_dtype: str | None = None
    """Dtype the weights have in the forward pass when the strategy casts them itself (FSDP's
    param_dtype); gathered parameters are in it. None: ``param_dtype`` (autocast casts under
    ``*-mixed``)."""
    autocast: bool = True
    """The forward pass runs under ``torch.autocast`` when the precision is ``*-mixed`` (Lightning's
    precision plugins); False where the strategy casts the model itself instead (DeepSpeed)."""
    master_weights: bool = False
    """A separate fp32 copy of the parameters lives with the optimizer states (DeepSpeed: ZeRO's
    K = 12)."""
    persistent_grads: bool = False
    """Gradients stay allocated between steps (DDP's bucket views) rather than freed by
    ``zero_grad``."""
    grads_freed_at_step: bool = False
    """The strategy frees gradients right after the optimizer step (DeepSpeed's engine), not after
    the next forward pass as Lightning's loop does, so they are not allocated while activations
    peak."""
    grad_buffers: float = 0.0
    """Fraction of the gradients held again in persistent communication buffers (DDP's buckets when
    gradients are not views of them)."""
    offload_optimizer: bool = False
    """Optimizer states (and master weights) live in host memory and are stepped there."""
    offload_params: bool = False
    """The stored parameter shards live in host memory and are copied in when gathered."""
    collectives: tuple[Collective, ...] = ()
    """The communication of one training step, as seen by one device."""
    notes: tuple[str, ...] = ()
    """What the plan should say about this layout (one line each)."""

    def __post_init__(self):
        if self.devices < 1:
            raise ValueError(f"devices must be at least 1, got {self.devices}")
        for name in ("params", "grads", "optimizer", "activations", "gathered", "grad_buffers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")

    @property
    def data_parallel(self) -> int:
        """Data-parallel replicas: ``replicas``, or ``devices`` when it is None."""
        return self.replicas if self.replicas is not None else self.devices
