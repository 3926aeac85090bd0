"""ZeRO: data parallelism without the redundant copies of the training state (DeepSpeed).

Plain data parallelism (``ddp``) keeps on every device the whole model, its gradients and the
optimizer state: with Adam in mixed precision, about 16 bytes per parameter, N times over. ZeRO
(the Zero Redundancy Optimizer) keeps the data-parallel computation, each rank training on its own
slice of the global batch, but partitions that state over the N ranks:

- stage 1 partitions the optimizer state (Adam's moments and the fp32 master weights): each rank
  updates only its 1/N of the parameters, then the updated parameters are all-gathered;
- stage 2 also partitions the gradients: a reduce-scatter leaves each rank the averaged
  gradients of its own partition, instead of an all-reduce that leaves everybody everything;
- stage 3 also partitions the parameters: each layer's weights are all-gathered just before its
  forward and backward and freed after, so no rank ever holds the whole model.

Each stage computes exactly what one device would on the global batch (the same gradient average
and update, in another summation order) and cuts the memory per device by up to N. Offloading
(ZeRO-Offload) moves the optimizer state and step to CPU memory (and, in stage 3, the parameters).

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020.
https://arxiv.org/abs/1910.02054 — Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model
Training", USENIX ATC 2021. https://arxiv.org/abs/2101.06840

The DeepSpeed config is generated: the ``zero_optimization`` section from this plugin's options,
and from the ``[train]`` table, which Lightning hands to the strategy through the Trainer, gradient
accumulation, gradient clipping and the precision (``fp16`` with its dynamic loss scaler, or
``bf16``). A raw DeepSpeed JSON file (``config``) is merged over the result for anything else
DeepSpeed offers; its keys are checked against DeepSpeed's own config models before training starts.

Checkpoints stay single files that ``lmlab generate`` and ``lmlab run --resume`` read: the file
holds the whole model's weights (gathered from the shards under stage 3) and Lightning's training
state, and names the DeepSpeed checkpoint (each rank's optimizer-state partition) written beside it
under ``checkpoints/deepspeed/<tag>/``, which resuming loads. See ``lmlab_deepspeed.strategy``.
"""

import json
import math
import os
from pathlib import Path
from datetime import timedelta
from typing import Any, Literal

from pydantic import PositiveInt, model_validator

from lmlab.api import Field, LaunchOptions, Parallel, UserError, hookimpl

# DeepSpeed config keys that lmlab's own tables decide; a raw config file must not contradict them.
OWNED_KEYS = {
    "train_batch_size": "train.batch_size", "train_micro_batch_size_per_gpu": "train.batch_size",
    "gradient_accumulation_steps": "train.grad_accum", "gradient_clipping": "train.grad_clip",
    "optimizer": "the [optimizer] table", "scheduler": "train.lr_schedule and train.warmup_steps",
}


class DeepSpeedOptions(LaunchOptions):
    accelerator: Literal["auto", "cpu", "gpu", "cuda"] = Field(
        "auto", help="device type; auto = cuda if available, else cpu")
    stage: Literal[1, 2, 3] = Field(
        2, help="ZeRO stage: 1 partitions the optimizer state, 2 also the gradients, 3 also the parameters")
    offload_optimizer: Literal["none", "cpu"] = Field(
        "none", help="keep the optimizer state in CPU memory and step it there (ZeRO-Offload)")
    cpu_adam: Literal["auto", "deepspeed", "torch"] = Field(
        "auto", help="with offload_optimizer = \"cpu\": the host step by DeepSpeed's vectorised CPU Adam (built on "
                     "first use; stands in for [optimizer] use = \"adamw\" only), by the [optimizer]'s own torch "
                     "optimizer, or auto: DeepSpeed's where it can stand in and builds, else the torch optimizer")
    offload_param: Literal["none", "cpu"] = Field(
        "none", help="keep the parameters in CPU memory between uses (stage 3 only)")
    contiguous_gradients: bool = Field(
        True, help="copy gradients into one contiguous buffer as they are produced (less fragmentation)")
    overlap_comm: bool = Field(True, help="overlap gradient reduction with the backward computation")
    reduce_bucket_size: PositiveInt = Field(
        200_000_000, help="elements reduced at once: larger is faster, smaller needs less memory")
    allgather_bucket_size: PositiveInt = Field(
        200_000_000, help="elements all-gathered at once after the step (stages 1 and 2)")
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        True, help="stage 3: gather the whole model into each checkpoint file, so `lmlab generate` "
                   "can load it; false leaves only DeepSpeed's shards (consolidate with zero_to_fp32)")
    config: Path | None = Field(
        None, help="a DeepSpeed JSON config merged over the generated one, for any other DeepSpeed option")

    @model_validator(mode="after")
    def _combinations(self):
        if self.offload_param != "none" and self.stage != 3:
            raise UserError(f"parameters are partitioned, hence offloadable, only in stage 3; "
                            f"set stage = 3 or offload_param = \"none\" (stage is {self.stage})",
                            key="parallel.offload_param")
        if self.cpu_adam == "deepspeed" and self.offload_optimizer != "cpu":
            raise UserError("DeepSpeed's CPU Adam steps an offloaded optimizer; set offload_optimizer = \"cpu\" "
                            "or leave cpu_adam at \"auto\"", key="parallel.cpu_adam")
        if self.config is not None:
            read_config_file(self.config)
        return self


def cannot_stand_in(optimizer: str) -> str:
    """The refusal of ``cpu_adam = "deepspeed"`` for an optimizer without AdamW's update (check and run;
    here, so that ``lmlab check`` imports no more of the plugin)."""
    return (f"DeepSpeed's CPU Adam implements AdamW's update only, and {optimizer} does not declare it "
            "(Optimizer.update_rule); set cpu_adam = \"torch\" or \"auto\" (which keeps that optimizer)")


def read_config_file(path: Path) -> dict:
    """The JSON object in ``path``; a UserError (key ``parallel.config``) when it is missing,
    malformed, or sets what lmlab's own tables decide."""
    try:
        config = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}", key="parallel.config") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON: {exc}", key="parallel.config") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} must hold a JSON object of DeepSpeed options", key="parallel.config")
    for key in config.keys() & OWNED_KEYS.keys():
        raise UserError(f"{path} sets {key!r}, which lmlab derives from {OWNED_KEYS[key]}; set it there",
                        key="parallel.config")
    for section in ("fp16", "bf16"):
        if isinstance(config.get(section), dict) and "enabled" in config[section]:
            raise UserError(f"{path} sets {section}.enabled, which lmlab derives from train.precision; "
                            "set it there", key="parallel.config")
    return config


def base_config(o: DeepSpeedOptions) -> dict[str, Any]:
    """The DeepSpeed config this plugin's options make, before [train] and the config file."""
    zero: dict[str, Any] = {
        "stage": o.stage, "contiguous_gradients": o.contiguous_gradients, "overlap_comm": o.overlap_comm,
        "reduce_bucket_size": o.reduce_bucket_size, "allgather_bucket_size": o.allgather_bucket_size,
    }
    if o.stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = o.stage3_gather_16bit_weights_on_model_save
    if o.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    if o.offload_param == "cpu":
        zero["offload_param"] = {"device": "cpu"}
    return {
        "zero_optimization": zero,
        # The [optimizer] slot's torch optimizer, not one of DeepSpeed's own: DeepSpeed would
        # otherwise refuse it under ZeRO, and insist on its JIT-compiled CPU Adam when offloading.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # lmlab logs progress itself
    }


def train_config(precision: str, accumulate: int, clip: float | None, scaler: dict | None = None) -> dict:
    """The DeepSpeed keys that follow the [train] table, as the Trainer carries it.

    ``scaler`` holds a dynamic loss scaler's settings (``init_scale``, ``growth_interval``,
    ``backoff_factor``, ``growth_factor``) when the run configured one for 16-bit training.
    """
    config: dict[str, Any] = {
        "gradient_accumulation_steps": accumulate,
        "gradient_clipping": float(clip or 0.0),
        # Only DeepSpeed's throughput log reads it; lmlab's loader yields whole batches.
        "train_micro_batch_size_per_gpu": 1,
    }
    if precision in ("16-mixed", "16-true"):
        config["fp16"] = {"enabled": True, "loss_scale": 0, **_loss_scaler(scaler or {})}
    elif precision in ("bf16-mixed", "bf16-true"):
        config["bf16"] = {"enabled": True}
    elif precision != "32-true":
        raise UserError(f"DeepSpeed trains in 32, 16 or bf16 precision, not {precision!r}", key="train.precision")
    return config


def _loss_scaler(scaler: dict) -> dict:
    # DeepSpeed's dynamic loss scaler starts at a power of two and halves or doubles the scale.
    settings = {"hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 16, "loss_scale_window": 1000}
    if "init_scale" in scaler:
        power = math.log2(scaler["init_scale"])
        if power != int(power):
            raise UserError(f"DeepSpeed's loss scale starts at a power of two, not {scaler['init_scale']}",
                            key="train.loss_scale_init")
        settings["initial_scale_power"] = int(power)
    if "growth_interval" in scaler:
        settings["loss_scale_window"] = int(scaler["growth_interval"])
    for key, factor, expected in (("backoff_factor", "backoff", 0.5), ("growth_factor", "growth", 2.0)):
        if key in scaler and scaler[key] != expected:
            raise UserError(f"DeepSpeed's loss scaler has a fixed {factor} factor of {expected}, not "
                            f"{scaler[key]}", key=f"train.loss_scale_{factor}")
    return settings


def merge(base: dict, update: dict) -> dict:
    """``update`` merged over ``base``, tables recursively."""
    merged = dict(base)
    for key, value in update.items():
        merged[key] = merge(merged[key], value) if isinstance(value, dict) and isinstance(
            merged.get(key), dict) else value
    return merged


class DeepSpeedZeRO(Parallel):
    """Data parallelism with the optimizer state, gradients and (stage 3) parameters partitioned
    over the ranks (DeepSpeed ZeRO, through a Lightning ``DeepSpeedStrategy``)."""

    Options = DeepSpeedOptions
    api = ">=1.20,<2"  # holds_whole_state; LaunchOptions.timeout_s, trainer_precision (1.7); resolved (1.15), update_rule, memory_savings (1.16) where there
    holds_whole_state = False  # ZeRO partitions the optimizer state (and, from stage 3, the weights)

    def trainer_kwargs(self) -> dict[str, Any]:
        o = self.options
        kind = o.processes()[0]
        if kind not in ("cuda", "cpu"):
            raise UserError(f"DeepSpeed runs on CUDA GPUs or the CPU, not {kind}", key="parallel.accelerator")
        # DeepSpeed picks its accelerator once per process, when imported: make it the device type
        # Lightning uses (the variable also reaches the processes Lightning starts for other ranks).
        os.environ["DS_ACCELERATOR"] = kind
        from deepspeed.accelerator import get_accelerator

        from lmlab_deepspeed.strategy import ZeROStrategy, check_config

        if get_accelerator().device_name() != kind:
            raise UserError(f"DeepSpeed was set to {get_accelerator().device_name()} earlier in this process",
                            key="parallel.accelerator")
        from lmlab_deepspeed import cpu_adam

        file_config = read_config_file(o.config) if o.config is not None else {}
        config = merge(base_config(o), file_config)
        check_config(config, o.config)
        offload = config["zero_optimization"].get("offload_optimizer", {}).get("device", "none") == "cpu"
        # The optimizer's update rule was read by check(), which every run calls first; unchecked
        # (a test building the strategy alone), no rule is known and the torch optimizer steps.
        rule, optimizer = getattr(self, "_optimizer_rule", (None, "the [optimizer]"))
        self._resolved = cpu_adam.resolve(o.cpu_adam, offload, rule, optimizer)
        strategy = ZeROStrategy(config=base_config(o), file_config=file_config, timeout=timedelta(seconds=o.timeout_s),
                                cpu_adam=self._resolved["optimizer_step"] == "deepspeed-cpu-adam")
        self._strategy = strategy
        return {"strategy": strategy, "accelerator": kind, "devices": o.devices, "num_nodes": o.num_nodes}

    def resolved(self) -> dict[str, Any]:
        """Which optimizer steps on the host under ZeRO-Offload, and why (after ``trainer_kwargs``)."""
        return dict(getattr(self, "_resolved", {}))

    def check(self, context) -> None:
        super().check(context)
        plugin = context.plugins.get("optimizer")
        # Asked of the plugin, not guessed from its name: only AdamW's exact update may be swapped.
        rule = getattr(plugin, "update_rule", lambda: None)()
        self._optimizer_rule = (rule, f"[optimizer] {getattr(plugin, 'name', None)!r}")
        if self.options.cpu_adam == "deepspeed" and self.options.offload_optimizer == "cpu" and rule != "adamw":
            raise UserError(cannot_stand_in(self._optimizer_rule[1]), key="parallel.cpu_adam")

    @hookimpl
    def lmlab_run_end(self, status: str, control) -> dict[str, Any] | None:
        """``optimizer_stepped`` in summary.json: what DeepSpeed's engine actually stepped with (set by
        the strategy once the engine holds the optimizer), beside the choice in provenance.json."""
        stepped = getattr(getattr(self, "_strategy", None), "stepped", None)
        return {"optimizer_stepped": stepped} if stepped else None

    def trainer_precision(self, train) -> dict[str, Any]:
        # The engine casts the model and scales the loss itself, as its config's fp16/bf16 section says
        # (train_config): the precision goes to it as it is, with no Lightning scaler on top.
        return {"precision": train.precision}

    @classmethod
    def memory_savings(cls) -> list[tuple[str, dict[str, Any]]]:
        """Each stage shards more at the cost of more communication; offloading then trades host
        memory and PCIe traffic for what no stage can shard away."""
        return [("ZeRO stage 1: optimizer states sharded", {"stage": 1}),
                ("ZeRO stage 2: gradients and optimizer states sharded", {"stage": 2}),
                ("ZeRO stage 3: parameters, gradients and optimizer states sharded", {"stage": 3}),
                ("ZeRO stage 3 with the optimizer states in host memory (ZeRO-Offload)",
                 {"stage": 3, "offload_optimizer": "cpu"}),
                ("ZeRO stage 3 with the optimizer states and parameters in host memory",
                 {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"})]

    @hookimpl
    def lmlab_checkpoint_saved(self, path: str) -> None:
        """A checkpoint file replaced another: drop the DeepSpeed shards no file names any more."""
        from lmlab_deepspeed.strategy import prune_shards

        prune_shards(Path(path).parent)

    def memory_layout(self, model, world_size: int | None, precision: str):
        """ZeRO's partitioning as DeepSpeed does it: the engine casts the model to 16 bits under
        mixed precision (no autocast) and keeps a separate fp32 copy of each partition with the
        optimizer state, in 32-bit training too; stage 1 partitions that, stage 2 the gradients as
        well, stage 3 the parameters as well. Gradient reduction goes through ``reduce_bucket_size``
        buffers (two with ``overlap_comm``); stage 3 also keeps its gradient partition in one flat
        buffer for the whole run. Stage 3 keeps up to ``stage3_max_live_parameters``
        gathered and does not release a parameter it will reuse within ``stage3_max_reuse_distance``:
        with the defaults (10⁹ each) a model under a billion parameters stays gathered from its
        forward into its backward."""
        from lmlab.api.layout import Collective, MemoryLayout

        o = self.options
        n = o.planned_processes(world_size)[1]
        config = merge(base_config(o), read_config_file(o.config) if o.config is not None else {})
        zero = config["zero_optimization"]
        half = {"bf16-mixed": "bfloat16", "bf16-true": "bfloat16", "16-mixed": "float16",
                "16-true": "float16"}.get(precision)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) or 1
        total = sum(p.numel() for p in model.parameters()) or 1
        shard = 1 / n
        buckets = (2 if zero.get("overlap_comm", True) else 1) * zero.get("reduce_bucket_size", 5e8) / trainable \
            if zero.get("contiguous_gradients", True) else 0.0
        stage = zero["stage"]
        gathered = min(1.0, zero.get("stage3_max_live_parameters", 1e9) / total) if stage == 3 else 0.0
        offload_optimizer = zero.get("offload_optimizer", {}).get("device", "none") == "cpu"
        offload_param = zero.get("offload_param", {}).get("device", "none") == "cpu"
        if stage == 3:
            collectives = (Collective("all-gather", "parameters", n, size=2.0, per="micro-batch",
                                      note="forward and backward"),
                           Collective("reduce-scatter", "gradients", n, per="micro-batch"))
        else:
            collectives = (Collective("reduce-scatter", "gradients", n, per="micro-batch" if stage == 2 else "step"),
                           Collective("all-gather", "parameters", n, note="updated partitions, after the step"))
        return MemoryLayout(
            devices=n, params=shard if stage == 3 else 1.0, grads=shard if stage >= 2 else 1.0, optimizer=shard,
            gathered=gathered, param_dtype=half, grad_dtype=half, autocast=False, master_weights=True,
            persistent_grads=stage == 3,  # stage 3 accumulates into one flat partition buffer, kept for the run
            grads_freed_at_step=True,  # the engine zeroes them in its step
            grad_buffers=buckets, offload_optimizer=offload_optimizer, offload_params=offload_param,
            collectives=collectives if n > 1 else ())

