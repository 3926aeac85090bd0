"""Measuring a variant's model for ``lmlab plan``: built at its real size on fake tensors (no memory),
its parameters counted, its optimizer stepped once and one training forward's saved tensors counted;
see ``lmlab.plan`` for the method."""

import contextlib
import functools
from dataclasses import dataclass

from lmlab.api.layout import MemoryLayout
from lmlab.errors import UserError
from lmlab.plan.arithmetic import (AUTOCAST_DTYPE, DevicePlan, ModelFacts, dtype_bytes, estimate, human,
                                   resolve_dtypes)

#: Parameter bytes up to which a model whose forward cannot run on fake tensors is run for real.
REAL_FORWARD_LIMIT = 2e9


def measure_model(build, plugins: dict, shape, train, layout: MemoryLayout, precision: str) -> ModelFacts:
    """Measure the model that ``build(dtype)`` makes (on fake tensors, with parameters of that dtype;
    ``build(dtype, fake=False)``: a real one) for a run with ``layout``: see ``lmlab.plan``."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               unset_fake_temporarily)

    param_dtype, _, compute_dtype = resolve_dtypes(layout, precision)
    autocast = AUTOCAST_DTYPE.get(precision) if layout.autocast else None
    model = build(compute_dtype)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    n_trainable = sum(p.numel() for p in params if p.requires_grad)
    # Buffers keep their dtype in storage; the weights' compute dtype says nothing about them.
    buffers = sum(b.numel() * b.element_size() for b in build(param_dtype).buffers())

    batch, block = train.batch_size, shape.block_size

    def saved_for_backward(policy: str) -> _Saved:
        try:
            return _saved_for_backward(model, plugins["objective"], batch, block, shape.vocab_size, autocast, policy)
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            # A module whose forward reads tensor values (an MoE router sizing its buffers by the
            # busiest expert on the CPU) cannot run on fake tensors; a small model runs for real.
            size = n_params * dtype_bytes(compute_dtype)
            if size > REAL_FORWARD_LIMIT:
                raise UserError(f"cannot measure activations without running the model: a module's forward "
                                f"depends on tensor values ({exc}), and at {human(size)} of parameters it is "
                                "too large to run here; plan a smaller model (fewer layers) and scale",
                                key="model") from None
            with unset_fake_temporarily():
                return _saved_for_backward(build(compute_dtype, fake=False), plugins["objective"], batch, block,
                                           shape.vocab_size, autocast, policy)

    saved = saved_for_backward(train.checkpointing)
    transient = saved.largest
    if train.checkpointing != "none":
        # Backward recomputes one block's dropped activations at a time.
        plain = saved_for_backward("none")
        transient += max(0, plain.total - saved.total) / max(1, shape.n_layers)
    state_dtype = "float32" if layout.master_weights else param_dtype
    try:
        optimizer_bytes = _optimizer_state_bytes(build(state_dtype), plugins["optimizer"])
    except Exception as exc:  # noqa: BLE001 - whatever a step on fake tensors cannot do
        # An optimizer whose step reads tensor values (Adafactor's scalar step size, a quantised
        # state's absmax) cannot step fake parameters; a small model steps for real instead.
        size = n_params * dtype_bytes(state_dtype)
        if size > REAL_FORWARD_LIMIT:
            raise UserError(f"cannot measure optimizer {plugins['optimizer'].name!r}'s state without stepping it "
                            f"for real ({type(exc).__name__}), and at {human(size)} of parameters the model is "
                            "too large to step here; plan a smaller model (fewer layers) and scale",
                            key="optimizer.use") from None
        with unset_fake_temporarily():
            optimizer_bytes = _optimizer_state_bytes(build(state_dtype, fake=False), plugins["optimizer"])
    eval_batch = train.eval_batch_size
    # The logits (compute dtype, or fp32 when not autocast) and the loss's fp32 log-softmax; under
    # autocast the loss first makes an fp32 copy of the logits too.
    logits = eval_batch * block * shape.vocab_size
    per_logit = 2 + 4 + 4 if autocast else dtype_bytes(compute_dtype) + 4
    return ModelFacts(params=n_params, trainable=n_trainable, buffer_bytes=buffers,
                      optimizer_bytes=optimizer_bytes, activation_bytes=saved.total, transient_bytes=int(transient),
                      eval_bytes=logits * per_logit, boundary_numel=batch * block * shape.d_model,
                      activation_dtype=autocast or compute_dtype)


def fake_mode():
    """A context in which tensors have shapes and dtypes but no storage (building a model is free)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=False)


class CannotPlan(UserError):
    """A variant whose model cannot be measured on fake tensors; ``lmlab plan`` goes on with the others."""


def _build_fake(built):
    """``built``'s model as a run trains it (with its adapter), on fake tensors."""
    if built.plugins.get("peft") is None:
        return built.build_model()
    try:
        with _no_op_conversions():
            return built.build_model(adapted=True)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        # A parameter that is a tensor subclass of its own (a 4-bit quantised weight) cannot wrap a fake tensor.
        raise CannotPlan(f"cannot be measured on fake tensors ({str(exc).splitlines()[0]}); plan the same "
                         "adapter without quantisation and count the frozen base weights at their stored size",
                         key="peft.use") from None


@contextlib.contextmanager
def _no_op_conversions():
    """``Module.to`` returns the module itself when every tensor already has the device and dtype asked for.

    A peft plugin moves each adapter layer it inserts to its base layer's device and dtype. On fake
    tensors ``Module.to`` always swaps the parameters for converted ones, and PyTorch refuses to swap a
    parameter made under a fake mode (it holds a weak reference); the conversion would change nothing.
    """
    import torch

    original = torch.nn.Module.to

    def to(module, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*module.parameters(), *module.buffers()]
        if all((device is None or t.device == device) and (dtype is None or not t.is_floating_point()
                                                           or t.dtype == dtype) for t in tensors):
            return module
        return original(module, *args, **kwargs)

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original


class _Saved:
    """Counts the bytes of the tensors autograd saves for backward, each storage once, skipping the
    parameters (already counted as such). Works on fake tensors: storages are told apart by identity,
    not by address (fake storages have none)."""

    def __init__(self, model):
        import torch

        self.total = self.largest = 0
        self._seen = {p.untyped_storage()._cdata for p in model.parameters()}

        def pack(t):
            storage = t.untyped_storage()
            if storage._cdata not in self._seen:
                self._seen.add(storage._cdata)
                self.total += storage.nbytes()
                self.largest = max(self.largest, storage.nbytes())
            return t

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _saved_for_backward(model, objective, batch: int, block: int, vocab: int, autocast: str | None,
                        checkpointing: str) -> _Saved:
    import contextlib

    import torch

    from lmlab.api import Windows
    from lmlab.model import compute_loss

    model.train()
    model.set_checkpointing(checkpointing)
    windows = torch.randint(0, vocab, (batch, block + 1))
    # The batch the objective makes in a run (mlm masks spans, sft scores responses). Every token is
    # labelled scored here: which tokens are scored changes no tensor's size.
    made = (objective.make_batch_from(Windows(windows, labels=torch.ones_like(windows, dtype=torch.uint8)))
            if objective.wants_windows() else objective.make_batch(windows))
    counter = _Saved(model)
    cast = (torch.autocast("cpu", dtype=getattr(torch, autocast)) if autocast else contextlib.nullcontext())
    with counter.hooks, cast:
        compute_loss(model, objective, made)
    return counter


def _optimizer_state_bytes(model, optimizer_plugin) -> int:
    """Bytes of optimizer state after one step of the plugin's optimizer on the fake parameters."""
    import torch

    infos = model.param_infos()
    optimizer = optimizer_plugin.build(infos)
    for info in infos:
        info.param.grad = torch.zeros_like(info.param)
    optimizer.step()
    total = sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
                if torch.is_tensor(v) and v.dim() > 0)  # scalar step counters are not state worth counting
    return total


@dataclass
class VariantPlan:
    name: str
    shape: object  # ModelShape
    facts: ModelFacts
    device: DevicePlan
    parallel: str  # the parallel plugin's name
    train: object  # the [train] table (lmlab.config.TrainOptions)
    optimizer: str


def plan_variant(variant, world_size: int | None = None) -> VariantPlan:
    """Build ``variant``'s model on fake tensors, ask its parallel plugin for the layout, measure, estimate."""
    from lmlab.assemble import assemble

    train = variant.train
    precision = train.precision
    # The plugins, and the vocabulary a run would have: the tokenizer's (fitted on the data and cached,
    # as a run would, when it cannot say without fitting) with room for the objective's special tokens
    # (mlm's [MASK]), or model.vocab_size when it decides alone. The model is built below, per dtype.
    built = assemble(variant, model=False)
    plugins, shape = built.plugins, built.shape
    peft = plugins.get("peft")
    if peft is not None:
        from lmlab.train.adapters import check_parallel

        check_parallel(peft, variant)

    mode = fake_mode()

    @functools.cache  # one model per dtype: a large one takes a second to build, even on fake tensors
    def build_model(dtype: str = "float32", fake: bool = True):
        import torch

        default = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, dtype))
        try:
            # A frozen base and a trainable adapter: gradients and optimizer states are the adapter's.
            if not fake:
                return built.build_model(adapted=True)
            with mode:
                return _build_fake(built)
        finally:
            torch.set_default_dtype(default)

    try:
        with mode:
            layout = plugins["parallel"].memory_layout(build_model(), world_size, precision)
            if not isinstance(layout, MemoryLayout):
                raise TypeError(f"parallel plugin {variant.plugins['parallel'].name!r}: memory_layout returned "
                                f"{type(layout).__name__}, not a MemoryLayout")
            facts = measure_model(build_model, plugins, shape, train, layout, precision)
    except RuntimeError as exc:
        if "overflow" not in str(exc):
            raise
        # A tensor of more than 2^63 bytes: no machine holds it, so it is a typo in the shape.
        sizes = {key: shape_value for key in ("d_model", "vocab_size", "block_size", "n_layers", "n_heads")
                 if isinstance(shape_value := getattr(shape, key), int)}
        key = max(sizes, key=sizes.get)
        raise UserError(f"{sizes[key]:,} makes tensors too large to exist ({str(exc).splitlines()[0]})",
                        key=f"model.{key}") from None
    return VariantPlan(variant.name, shape, facts, estimate(facts, layout, precision, train.grad_accum),
                       variant.plugins["parallel"].name, train, variant.plugins["optimizer"].name)
