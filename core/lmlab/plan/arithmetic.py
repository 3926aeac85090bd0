"""The arithmetic of ``lmlab plan``: what was measured on a model × how a strategy lays it out
→ bytes per device at each moment of a step, and bytes each device sends per step. Pure Python (no
torch), so the ZeRO paper's numbers can be checked without a model; see ``lmlab.plan`` for the method."""

import re
from dataclasses import dataclass, field

from lmlab.api.layout import Collective, MemoryLayout
from lmlab.errors import UserError

STORAGE_DTYPE = {"32-true": "float32", "bf16-mixed": "float32", "16-mixed": "float32",
                 "bf16-true": "bfloat16", "16-true": "float16", "64-true": "float64"}
AUTOCAST_DTYPE = {"bf16-mixed": "bfloat16", "16-mixed": "float16"}
#: Bytes per element of the dtypes a layout or collective may name, by torch's names; integers of
#: every width torch has, signed and unsigned (int8 ... uint64).
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
               **{f"{sign}int{bits}": bits // 8 for sign in ("", "u") for bits in (8, 16, 32, 64)}}

#: Ring algorithms: the share of the full tensor each device sends.
_RING = {"all-reduce": lambda g: 2 * (g - 1) / g, "all-gather": lambda g: (g - 1) / g,
         "reduce-scatter": lambda g: (g - 1) / g, "send-recv": lambda g: 1.0}


@dataclass(frozen=True)
class ModelFacts:
    """What the planner measured on the model (bytes unless said otherwise)."""

    params: int  # parameters (numel), tied weights once
    trainable: int  # of which trainable
    buffer_bytes: int = 0  # module buffers (RoPE tables, ...), replicated on every device
    optimizer_bytes: int = 0  # the optimizer's states for all trainable parameters
    activation_bytes: int = 0  # saved for backward by one micro-batch's forward, parameters excepted
    transient_bytes: int = 0  # backward's working memory beyond that (largest saved tensor's gradient, a recomputed block)
    eval_bytes: int = 0  # one evaluation batch's logits and their log-softmax
    boundary_numel: int = 0  # micro-batch × block_size × d_model: one activation tensor between blocks
    activation_dtype: str = "float32"  # the dtype activations travel in (the compute dtype)


@dataclass
class DevicePlan:
    """One device's memory (bytes) and one step's communication, from facts × layout."""

    layout: MemoryLayout
    param_dtype: str
    grad_dtype: str
    params: float
    grads: float
    optimizer: float
    activations: float
    gathered: float
    grad_buffers: float
    transient: float
    host: float  # offloaded to host memory, per process
    phases: dict[str, float]  # moment of the step → bytes on the device then
    comm: list[tuple[Collective, float]] = field(default_factory=list)  # collective → bytes sent per step

    @property
    def model_states(self) -> float:
        """Parameters, gradients and optimizer states: what ZeRO shards (its paper's "model states")."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        """The peak: the largest of the step's moments."""
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def comm_bytes(self) -> float:
        return sum(volume for _, volume in self.comm)


def dtype_bytes(name: str) -> int:
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (one of {', '.join(DTYPE_BYTES)})") from None


def resolve_dtypes(layout: MemoryLayout, precision: str) -> tuple[str, str, str]:
    """(param dtype, grad dtype, dtype of the weights in the forward pass) for a layout and precision."""
    param = layout.param_dtype or STORAGE_DTYPE[precision]
    grad = layout.grad_dtype or param
    return param, grad, layout.compute_dtype or param


def estimate(facts: ModelFacts, layout: MemoryLayout, precision: str, grad_accum: int = 1) -> DevicePlan:
    """The per-device memory and per-step communication of ``layout`` for a model with ``facts``."""
    param_dtype, grad_dtype, compute_dtype = resolve_dtypes(layout, precision)
    pb, gb = dtype_bytes(param_dtype), dtype_bytes(grad_dtype)
    params = facts.params * pb * layout.params + facts.buffer_bytes
    grads = facts.trainable * gb * layout.grads
    master = 4 * facts.trainable if layout.master_weights else 0
    optimizer = (facts.optimizer_bytes + master) * layout.optimizer
    activations = facts.activation_bytes * layout.activations
    transient = facts.transient_bytes * layout.activations
    gathered = facts.params * dtype_bytes(compute_dtype) * layout.gathered
    grad_buffers = facts.trainable * gb * layout.grad_buffers
    host = 0.0
    on_device_params, on_device_optimizer = params, optimizer
    if layout.offload_params:
        host += params - facts.buffer_bytes
        on_device_params = facts.buffer_bytes
    if layout.offload_optimizer:
        host += optimizer
        on_device_optimizer = 0.0
    resident = on_device_params + on_device_optimizer + gathered + grad_buffers
    # Gradients between steps: kept (persistent buffers), freed by the strategy right after the
    # step, or (Lightning's loop) freed by zero_grad after the next forward pass.
    between_steps = grads if layout.persistent_grads or not layout.grads_freed_at_step else 0.0
    if layout.persistent_grads:
        training = resident + activations + grads + transient
    else:  # once backward starts, its working memory takes the place of the freed gradients
        training = resident + activations + max(between_steps, transient)
    # Stepping fp32 master weights from 16-bit gradients converts the gradient shard to fp32 first.
    step_extra = 4 * facts.trainable * layout.optimizer if layout.master_weights and not layout.offload_optimizer else 0
    phases = {
        "training": training,
        "optimizer step": on_device_params + grads + on_device_optimizer + grad_buffers + step_extra,
        "evaluation": resident + between_steps + facts.eval_bytes,
    }
    plan = DevicePlan(layout, param_dtype, grad_dtype, params, grads, optimizer, activations, gathered,
                      grad_buffers, transient, host, phases)
    plan.comm = [(c, communication_bytes(c, facts, param_dtype, grad_dtype, grad_accum)) for c in layout.collectives]
    return plan


def communication_bytes(c: Collective, facts: ModelFacts, param_dtype: str, grad_dtype: str,
                        grad_accum: int = 1) -> float:
    """Bytes one device sends for collective ``c`` in one optimizer step."""
    if c.group < 2:
        return 0.0
    if c.of == "activations":
        tensor = facts.boundary_numel * c.size * dtype_bytes(c.dtype or facts.activation_dtype)
    else:
        default = param_dtype if c.of == "parameters" else grad_dtype
        tensor = facts.trainable * c.size * dtype_bytes(c.dtype or default) if c.of == "gradients" \
            else facts.params * c.size * dtype_bytes(c.dtype or default)
    times = grad_accum if c.per == "micro-batch" else 1
    return _RING[c.op](c.group) * tensor * times


_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> float:
    """'80GB' → 8e10 bytes; 'GB'/'MB' are decimal, 'GiB'/'MiB' (and bare 'G'/'M', as nvidia-smi's
    80G cards count) binary."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS or not match.group(2):
        raise UserError(f"expected a size such as 80GB, 80GiB or 512MB, got {text!r}", key="--device-mem")
    value = float(match.group(1)) * _UNITS[match.group(2).upper()]
    if value <= 0:
        raise UserError(f"must be positive, got {text!r}", key="--device-mem")
    return value


def human(nbytes: float, unit: str | None = None) -> str:
    unit = unit or pick_unit(nbytes)
    return f"{nbytes / _UNITS[unit]:.{3 if unit == 'GB' else 1}f} {unit}"


def pick_unit(nbytes: float) -> str:
    return "GB" if nbytes >= 1e9 else "MB"
