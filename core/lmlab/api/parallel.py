"""The parallel slot: how the run is laid out over devices and nodes (a Lightning strategy), at which
precision, and the launch options every multi-process plugin shares."""

from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal

from pydantic import PositiveInt

from lmlab.api.errors import UserError
from lmlab.api.layout import MemoryLayout
from lmlab.api.options import Field, Options
from lmlab.api.plugin import Plugin

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from lmlab.api.batch import Batch

    LossFn = Callable[["torch.Tensor", "Batch"], "torch.Tensor"]
    """The objective's loss: (logits (B, T, V), batch) → scalar."""


class LaunchOptions(Options):
    """Where the processes of a multi-process parallel plugin run (API 1.6): the options every such
    plugin shares, so that a manifest says them the same way whatever the strategy. A plugin's Options
    subclass these and may narrow ``accelerator`` to the device types its strategy supports. The
    default [Parallel.check][lmlab.api.parallel.Parallel.check] checks them against the machine."""

    devices: PositiveInt | Literal["auto"] = Field(
        "auto", help="processes (devices) per node; auto = every GPU, or 1 on the CPU")
    num_nodes: int = Field(1, ge=1, help="number of machines")
    accelerator: Literal["auto", "cpu", "gpu", "cuda", "mps"] = Field("auto", help="device type")
    backend: str | None = Field(
        None, help="torch.distributed backend (nccl, gloo, ...); default nccl on GPUs, gloo on the CPU")
    timeout_s: float = Field(
        1800.0, gt=0, help="seconds a collective waits for every process before the run fails (torch's "
                           "default, 30 minutes); a failed run's diagnosis names the late process (API 1.7)")

    def processes(self) -> tuple[str, int, int]:
        """(device type, processes per node, processes in all), checked against this machine
        ([resolve_devices][lmlab.api.parallel.resolve_devices]); a UserError naming the option this
        machine cannot satisfy."""
        kind, per_node = resolve_devices(self.accelerator, self.devices)
        return kind, per_node, per_node * self.num_nodes

    def planned_processes(self, world_size: int | None) -> tuple[int, int]:
        """(processes per node, processes in all) for ``lmlab plan``: ``world_size`` when it asks for
        one, else the options, ``auto`` counting this machine's GPUs (one process on a CPU-only one)."""
        import torch

        per_node = self.devices if self.devices != "auto" else (torch.cuda.device_count() or 1)
        return per_node, world_size or per_node * self.num_nodes


class Parallel(Plugin):
    """How a run is laid out over devices and nodes: the Lightning strategy and its launch
    ([trainer_kwargs][lmlab.api.parallel.Parallel.trainer_kwargs]), the precision it trains in
    ([trainer_precision][lmlab.api.parallel.Parallel.trainer_precision]), how it shards or splits the
    model ([configure_model][lmlab.api.parallel.Parallel.configure_model]) and how ``lmlab plan`` lays
    out its memory ([memory_layout][lmlab.api.parallel.Parallel.memory_layout]).

    In a run, every process instantiates the plugin and calls
    [trainer_kwargs][lmlab.api.parallel.Parallel.trainer_kwargs] and
    [trainer_precision][lmlab.api.parallel.Parallel.trainer_precision] itself; the core hands the
    resulting Lightning strategy the model, the optimizer and the data, giving each data-parallel
    replica its own rows of every global batch.
    """

    slot = "parallel"

    def data_parallel_replicas(self) -> int:
        """How many data-parallel replicas a run has, each training on its own ``batch_size ×
        grad_accum`` sequences per optimizer step (API 1.7): the global batch that
        ``train.lr_scaling`` scales by, counted before any process starts. Default: every process
        of a plugin with [LaunchOptions][lmlab.api.parallel.LaunchOptions] (``devices × num_nodes``,
        ``devices = "auto"`` counting this machine's GPUs, or 1), else 1. Override it when processes
        share a batch (tensor or pipeline parallelism)."""
        if isinstance(self.options, LaunchOptions):
            return self.options.planned_processes(None)[1]
        return 1

    def trainer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``lightning.Trainer``: ``strategy``, ``accelerator``, ``devices``,
        ``num_nodes``.

        Called once per run in every process, when the trainer is built (after the model is built
        and before training); import Lightning here, not at the top of the module, so that loading
        the plugin stays cheap.

        Returns:
            A dict of keyword arguments; the core adds its own (steps, accumulation, clipping,
            precision) and must not be given those.
        """
        raise NotImplementedError

    def resolved(self) -> dict[str, Any]:
        """Choices this plugin made for the machine it runs on, called once in the main process after
        [trainer_kwargs][lmlab.api.parallel.Parallel.trainer_kwargs] (API 1.15): JSON values, such as
        which implementation steps an offloaded optimizer and why. ``provenance.json`` records them
        under ``plugins.parallel.resolved``, so a run says what it actually used. Default: none."""
        return {}

    def device_type(self) -> str:
        """The device type the processes train on: ``"cuda"``, ``"mps"`` or ``"cpu"`` (API 1.6).

        Read by the default [trainer_precision][lmlab.api.parallel.Parallel.trainer_precision] and
        [check][lmlab.api.parallel.Parallel.check]. The default reads the options' ``accelerator``
        (``"auto"`` without one) through [resolve_devices][lmlab.api.parallel.resolve_devices]: a
        UserError naming ``parallel.accelerator`` when the machine lacks it."""
        return resolve_devices(getattr(self.options, "accelerator", "auto"), 1)[0]

    def trainer_precision(self, train) -> dict[str, Any]:
        """The Trainer's precision arguments for ``[train]`` (``train.precision``, and the
        ``train.loss_scale_*`` options under ``16-mixed``), API 1.6: ``{"precision": ...}`` or
        ``{"plugins": [...]}``. Called once, when the trainer is built. The default: the precision as
        it is, and under ``16-mixed`` Lightning's mixed precision with a loss scaler that takes the
        loss-scale options (Lightning's own would ignore them); a strategy that scales otherwise
        (FSDP's sharded scaler, DeepSpeed's config) overrides it.

        Args:
            train: The variant's ``[train]`` table (its ``precision`` and ``loss_scale_*`` options).

        Returns:
            Keyword arguments for ``lightning.Trainer``.
        """
        if train.precision != "16-mixed":
            return {"precision": train.precision}
        import torch
        from lightning.pytorch.plugins.precision import MixedPrecision

        device = self.device_type()
        return {"plugins": [MixedPrecision("16-mixed", device, scaler=torch.amp.GradScaler(device, **loss_scaling(train)))]}

    def check(self, context) -> None:
        """Refuse a layout this variant or machine cannot run, before anything is built (see
        [Plugin.check][lmlab.api.plugin.Plugin.check]).

        The default refuses, on this machine (``context.machine``), an accelerator it lacks (and
        with [LaunchOptions][lmlab.api.parallel.LaunchOptions], more devices than it has) and
        ``16-mixed`` on the CPU. A plugin that overrides it calls it too.

        Args:
            context: The variant: shape, plugins, resolved manifest, the model on the meta device.
        """
        if not context.machine:
            return
        options = self.options
        if isinstance(options, LaunchOptions):
            options.processes()
        device = self.device_type()
        if context.run.train.precision == "16-mixed" and device == "cpu":
            raise UserError("16-mixed (float16 autocast with loss scaling) needs a GPU; on the CPU use bf16-mixed",
                            key="train.precision")

    def configure_model(self, model: "nn.Module", device_mesh: "DeviceMesh") -> None:
        """Shard or split ``model`` in place over ``device_mesh``; returns nothing.

        Called once in every process when the strategy from ``trainer_kwargs`` provides a device
        mesh (Lightning's ``ModelParallelStrategy``; strategies without one never call it): after the
        model is built, initialised and given its starting weights on the CPU, the same in every
        process, and before the optimizer is created, which then holds the parameters as this hook
        left them (DTensors for ``fully_shard`` or tensor parallelism). Attributes plugins set on
        parameters (``_no_weight_decay``) are copied by name onto the parameters that replace them.
        The default does nothing.

        ``device_mesh`` is the strategy's mesh with named dimensions (``ModelParallelStrategy``:
        ``"data_parallel"``, ``"tensor_parallel"``); the core gives each index of the data-parallel
        dimension its own slice of every global batch, and ranks that differ only in the other
        dimensions the same slice. ``model`` is the assembled language model: ``tok_emb``,
        ``position``, ``blocks`` (an ``nn.ModuleList`` of pre-norm transformer blocks, each with
        ``norm1``, ``attn``, ``norm2`` and ``ffn``), ``norm_f`` and ``head`` (whose weight is
        ``tok_emb.weight`` under ``model.tie_embeddings``). Parameter names must stay those of the
        plain model: checkpoints hold the gathered full state dict under those names, which
        ``lmlab generate`` loads into a single-device model.
        """

    holds_whole_state: ClassVar[bool] = True
    """Whether every process holds the whole model's weights and optimizer state as plain tensors
    (one device, data parallelism), so that ``RunControl.rollback`` can restore a checkpoint in place.
    A layout that shards or splits them (FSDP, ZeRO, tensor or pipeline parallelism) sets False: a
    rollback is then refused, and so is a monitor that would roll back. (API 1.20)"""

    runs_forward_backward: ClassVar[bool] = False
    """True for a layout that runs the model's forward and backward passes itself, as a pipeline
    schedule does (it interleaves micro-batches' forward and backward passes across ranks, so no
    single loss tensor exists to call ``backward()`` on). The core then calls
    [forward_backward][lmlab.api.parallel.Parallel.forward_backward] and
    [forward_loss][lmlab.api.parallel.Parallel.forward_loss] instead of calling the model. (API 1.3)"""

    def forward_backward(self, model: "nn.Module", batch: "Batch", loss_fn: "LossFn",
                         grad_scale: float) -> "torch.Tensor":
        """Forward and backward of one training micro-batch, for a plugin that sets
        ``runs_forward_backward``; called in every process, at the point where the core would call
        ``loss.backward()`` (after Lightning zeroed the gradients for a new step), with the same
        ``batch`` in every process of one data-parallel replica.

        Accumulate into the parameters' ``.grad`` the gradients of ``loss_fn(logits, batch) *
        grad_scale`` (``grad_scale`` is 1 / ``train.grad_accum``, times the loss scale under
        ``16-mixed``; the call runs under the precision's autocast); return the loss itself, unscaled
        and detached, as a 0-dim float tensor with the same value in every process (the core logs
        it, averaged over processes, and hands it to ``lmlab_train_batch_end``). ``loss_fn`` is the
        objective's: a mean over the targets that are not ``IGNORE_INDEX``, so a plugin that splits
        the batch weights each part by its counted targets to get the whole batch's loss.
        """
        raise NotImplementedError

    def forward_loss(self, model: "nn.Module", batch: "Batch", loss_fn: "LossFn") -> "torch.Tensor":
        """The loss of one evaluation batch, without gradients, for a plugin that sets
        ``runs_forward_backward``: ``loss_fn(logits, batch)`` detached, the same in every process.

        Called in every process for each validation batch, with the model in eval mode and under
        ``torch.inference_mode`` or ``torch.no_grad``; the core weights it by the batch's counted
        targets, as it does the model's own loss.

        Returns:
            A 0-dim float tensor.
        """
        raise NotImplementedError

    def clip_grad_norm(self, parameters: list["torch.Tensor"], max_norm: float) -> "torch.Tensor | None":
        """Scale the gradients of ``parameters`` (this process's, as the optimizer holds them) so
        that the norm of the whole model's gradient is at most ``max_norm``; return that norm before
        clipping. (API 1.3)

        Called in every process before each optimizer step when ``train.grad_clip`` > 0: after the
        gradients are accumulated and unscaled and the ``lmlab_before_optimizer_step`` hooks ran.
        None, the default, lets the core use ``torch.nn.utils.clip_grad_norm_``, which is right when
        every process holds whole gradients (DDP) or every parameter is a DTensor of one mesh
        (FSDP). A layout that mixes sharded and replicated parameters (tensor parallelism) or
        spreads the model over processes (a pipeline) computes the global norm itself.

        Args:
            parameters: Every parameter in the optimizer's param groups, in this process.
            max_norm: ``train.grad_clip``.

        Returns:
            The global gradient norm before clipping (a 0-dim tensor), or None to leave the
            clipping to the core.
        """
        return None

    def memory_layout(self, model: "nn.Module", world_size: int | None, precision: str) -> MemoryLayout:
        """How this strategy lays out the training state of ``model`` over ``world_size`` processes,
        for ``lmlab plan``: a [MemoryLayout][lmlab.api.layout.MemoryLayout] of sharding fractions, dtypes
        and the collectives of one step. The core multiplies them with what it measured.

        ``model`` is the assembled language model (as ``configure_model`` sees it) with parameters
        that hold no memory (fake tensors): read its structure and ``numel()``s, nothing else.
        ``world_size`` is the number of processes to plan for (``lmlab plan --devices``); None
        means what this plugin's options say. ``precision`` is ``[train] precision``
        (``"32-true"``, ``"bf16-mixed"``, ...). Raise a ``UserError`` naming the option for a world
        size the strategy cannot use. Called only by ``lmlab plan``, in one process. The default
        says the plugin cannot be planned.
        """
        raise UserError(f"parallel plugin {self.name!r} does not describe its memory layout "
                        "(Parallel.memory_layout), so lmlab plan cannot plan it", key="parallel.use")

    @classmethod
    def memory_savings(cls) -> list[tuple[str, dict[str, Any]]]:
        """Settings of this plugin that hold less per device than one process with the whole model,
        for the fixes of an out-of-memory diagnosis (API 1.16): ``(what it does, options)`` pairs,
        the least costly in communication first (``("ZeRO stage 2: gradients and optimizer states
        sharded", {"stage": 2})``). The options are this plugin's own (its ``Options`` fields, without
        ``devices``); the diagnosis plans each with
        [memory_layout][lmlab.api.parallel.Parallel.memory_layout] over the machine's GPUs and
        suggests the first that fits, as ``--set parallel.use=NAME --set parallel.OPTION=VALUE``.
        Default: none."""
        return []


def loss_scaling(train) -> dict[str, Any]:
    """``torch.amp.GradScaler``'s keyword arguments from ``[train]``'s loss-scale options."""
    return {"init_scale": train.loss_scale_init, "growth_interval": train.loss_scale_growth_interval,
            "backoff_factor": train.loss_scale_backoff}


def resolve_devices(accelerator: str, devices: int | str) -> tuple[str, int]:
    """The concrete device type (``"cuda"``, ``"mps"`` or ``"cpu"``) and the number of processes
    per node for a parallel plugin's ``accelerator`` and ``devices`` options, as Lightning would
    pick them; a ``UserError`` naming ``parallel.accelerator`` or ``parallel.devices`` when this
    machine lacks them.

    ``devices = "auto"`` means every visible GPU, or one process on the CPU. On the CPU any number
    of processes is allowed (Lightning oversubscribes the cores, which tests rely on); on GPUs the
    count is checked against ``torch.cuda.device_count()``, which honours ``CUDA_VISIBLE_DEVICES``.
    """
    import torch

    has_cuda = torch.cuda.is_available()
    has_mps = torch.backends.mps.is_available()
    if accelerator == "auto":
        kind = "cuda" if has_cuda else "mps" if has_mps else "cpu"
    elif accelerator == "gpu" and (has_cuda or has_mps):
        kind = "cuda" if has_cuda else "mps"
    elif accelerator == "cpu" or (accelerator == "cuda" and has_cuda) or (accelerator == "mps" and has_mps):
        kind = accelerator
    else:
        raise UserError(f"accelerator {accelerator!r} is not available on this machine (use \"auto\" or "
                        "\"cpu\")", key="parallel.accelerator")
    if kind == "cpu":
        return kind, 1 if devices == "auto" else int(devices)
    available = torch.cuda.device_count() if kind == "cuda" else 1
    if devices == "auto":
        return kind, available
    if int(devices) > available:
        raise UserError(f"{devices} devices per node requested, but this machine has {available} {kind} "
                        f"device(s){' visible (CUDA_VISIBLE_DEVICES)' if kind == 'cuda' else ''}",
                        key="parallel.devices")
    return kind, int(devices)
