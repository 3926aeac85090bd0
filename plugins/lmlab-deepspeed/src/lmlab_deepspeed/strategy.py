"""The Lightning strategy behind the ``deepspeed`` plugin, and the checks of a DeepSpeed config.

``ZeROStrategy`` is Lightning's ``DeepSpeedStrategy`` (used as it is on CUDA GPUs wherever it can
be) with five changes:

- it also runs on the CPU (Gloo), where DeepSpeed has an accelerator but Lightning refuses one;
- the [train] settings reach the DeepSpeed config through the Trainer (``accumulate_grad_batches``,
  ``gradient_clip_val``, the precision plugin), and the ``config`` file is merged over them;
- a checkpoint is one file in Lightning's format with the whole model's weights, which ``lmlab
  generate`` loads into a single-device model, plus DeepSpeed's own checkpoint of each rank's
  partition under ``deepspeed/<tag>/`` beside it, named in the file's ``deepspeed`` entry. Every
  save writes a new tag, so the file the recorder atomically renames into place never names
  half-written shards; shards that no checkpoint file names any more are deleted
  (``prune_shards``, after each save). The last and best checkpoints of one step share their shards;
- when training ends, stage 3 gathers the whole weights back into every process (the closing
  evaluation and the sample then run on plain modules), and the engine is destroyed;
- the process group is destroyed at exit, so no communication thread outlives the interpreter
  (which otherwise sometimes aborts with "terminate called without an active exception").
"""

import argparse
import atexit
import difflib
import importlib
import logging
import shutil
import uuid
import warnings
from collections.abc import KeysView
from contextlib import contextmanager
from pathlib import Path

import deepspeed
import pydantic
import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import DeepSpeedPrecision
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from lmlab.api import UserError
from lmlab_deepspeed.zero import merge, train_config

SHARDS = "deepspeed"  # the folder, beside the checkpoint files, of DeepSpeed's per-rank checkpoints


class ZeROStrategy(DeepSpeedStrategy):
    def __init__(self, config: dict, file_config: dict | None = None, cpu_adam: bool = False, **kwargs):
        super().__init__(config=config, **kwargs)
        self.cpu_adam = cpu_adam  # step the offloaded AdamW with DeepSpeed's CPU Adam (lmlab_deepspeed.cpu_adam)
        self.stepped: str | None = None  # what the engine steps with, read back from it (cpu_adam.stepped)
        # lmlab's module overrides backward and gradient clipping for other layouts; here DeepSpeed's
        # engine does both, as configured, and Lightning's notes saying so would only alarm. The
        # deprecations (all_gather_into_tensor, ...) are torch's, addressed to DeepSpeed.
        warnings.filterwarnings("ignore", message=".*DeepSpeed handles (gradient clipping|the backward logic)")
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        self.file_config = file_config or {}
        self._shards: tuple[int, str] | None = None  # (global step, tag) of the shards last written

    # -- the CPU: DeepSpeed has an accelerator for it; Lightning's strategy checks for CUDA ---------

    def setup_environment(self) -> None:
        if self.root_device.type == "cuda":
            super().setup_environment()
        else:
            DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        if self.root_device.type == "cuda":
            super().setup_distributed()
        else:  # CPU devices have no index to check against the local rank
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()
        atexit.unregister(_destroy_process_group)  # once, however many fits and validations
        atexit.register(_destroy_process_group)

    def _init_deepspeed_distributed(self) -> None:
        if self.root_device.type == "cuda":
            return super()._init_deepspeed_distributed()
        # On the CPU, DeepSpeed's communication backend JIT-compiles (a minute or more) a shared-memory
        # all-reduce that only its inference engine uses; training never calls it.
        backend = importlib.import_module("deepspeed.comm.torch")  # the package's ``torch`` is torch itself
        build = getattr(backend, "build_shm_op", None)
        backend.build_shm_op = lambda: None
        try:
            super()._init_deepspeed_distributed()
        finally:
            if build is not None:
                backend.build_shm_op = build

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        if self.cpu_adam and optimizer is not None:
            from lmlab_deepspeed.cpu_adam import host_optimizer

            optimizer = host_optimizer(optimizer)
        if self.root_device.type == "cuda":
            engine, ds_optimizer = super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        else:  # DeepSpeed compares the device index with 0; a CPU device has none.
            engine, ds_optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self.local_rank), config=self.config, model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad], optimizer=optimizer,
                lr_scheduler=lr_scheduler, dist_init_required=False)
        if optimizer is not None:
            from lmlab_deepspeed.cpu_adam import stepped

            self.stepped = stepped(engine)
        return engine, ds_optimizer

    # -- the config: this plugin's options, then [train] from the Trainer, then the config file -----

    def _format_config(self) -> None:
        trainer = self.lightning_module.trainer
        plugin = self.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        if not isinstance(plugin, DeepSpeedPrecision):
            # A 16-bit loss scaler set up for another strategy: DeepSpeed's engine scales the loss
            # itself, with the same settings.
            self.precision_plugin = DeepSpeedPrecision(plugin.precision)
        scaler = None if scaler is None else {
            "init_scale": scaler._init_scale, "growth_interval": scaler._growth_interval,
            "backoff_factor": scaler._backoff_factor, "growth_factor": scaler._growth_factor}
        generated = train_config(self.precision_plugin.precision, trainer.accumulate_grad_batches,
                                 trainer.gradient_clip_val, scaler)
        self.config = merge(merge(self.config, generated), self.file_config)

    # -- evaluation outside fit: the weights are whole, so no engine is needed ----------------------

    def _initialize_deepspeed_inference(self, model) -> None:
        self.model = model
        self.model_to_device()

    def teardown(self) -> None:
        engine = self.model if isinstance(self.model, deepspeed.DeepSpeedEngine) else None
        if engine is not None:
            trainer = self.lightning_module.trainer
            # A collective: only when every rank got here by finishing, never on an error path.
            if self.zero_stage_3 and trainer.state.status == TrainerStatus.RUNNING:
                _unshard(engine.module)
            engine.destroy()
            self.model = self.lightning_module
        super().teardown()

    # -- checkpoints: one file with the whole weights, the per-rank state beside it -----------------

    def optimizer_state(self, optimizer) -> dict:
        return {}  # each rank's partition goes into DeepSpeed's shards, not into the file

    def lightning_module_state_dict(self) -> dict:
        engine = self.model
        if not (self.zero_stage_3 and isinstance(engine, deepspeed.DeepSpeedEngine)):
            return super().lightning_module_state_dict()  # stages 1 and 2 hold whole weights everywhere
        if not self.config["zero_optimization"].get("stage3_gather_16bit_weights_on_model_save"):
            return {}
        # Gathers one layer at a time onto rank 0 (a collective: every rank saves).
        return engine._zero3_consolidated_16bit_state_dict() or {}

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        filepath = Path(self.broadcast(str(filepath)))
        engine = self.model
        if isinstance(engine, deepspeed.DeepSpeedEngine):
            step = checkpoint["global_step"]
            if self._shards is None or self._shards[0] != step:  # else unchanged since the last save
                tag = self.broadcast(f"step{step}-{uuid.uuid4().hex[:8]}")
                engine.save_checkpoint(str(filepath.parent / SHARDS), tag=tag, client_state={}, save_latest=False)
                self._shards = (step, tag)
            checkpoint = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
            checkpoint["deepspeed"] = {"shards": f"{SHARDS}/{self._shards[1]}", "world_size": self.world_size,
                                       "stage": self.config["zero_optimization"]["stage"]}
        DDPStrategy.save_checkpoint(self, checkpoint, filepath, storage_options)  # rank 0 writes the file

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        checkpoint = DDPStrategy.load_checkpoint(self, checkpoint_path, weights_only)
        info = checkpoint.get("deepspeed")
        if info is None:
            raise UserError("was not written by the deepspeed plugin, so it holds no DeepSpeed state to resume",
                            key=str(checkpoint_path))
        if info["world_size"] != self.world_size:
            raise UserError(f"was written by {info['world_size']} processes; ZeRO resumes only on as many "
                            f"(this run has {self.world_size})", key="parallel.devices")
        shards = Path(checkpoint_path).parent / info["shards"]
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        self.model.load_checkpoint(str(shards.parent), tag=shards.name, load_optimizer_states=fitting,
                                   load_lr_scheduler_states=False,
                                   load_module_strict=self.lightning_module.strict_loading)
        self._shards = (checkpoint["global_step"], shards.name)
        return checkpoint


def prune_shards(directory: Path) -> None:
    """Delete the DeepSpeed checkpoints in ``directory/deepspeed`` that no ``*.ckpt`` file names."""
    shards = directory / SHARDS
    if not shards.is_dir():
        return
    keep = set()
    for path in directory.glob("*.ckpt"):
        try:  # mmap: reads the small entries, not the weights
            info = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("deepspeed")
        except Exception:
            return  # a file we cannot read might name any of them
        if info:
            keep.add(Path(info["shards"]).name)
    for tag in shards.iterdir():
        if tag.is_dir() and tag.name not in keep:
            shutil.rmtree(tag, ignore_errors=True)


def _unshard(module: torch.nn.Module) -> None:
    """Replace ZeRO-3's partitioned parameters by whole ones, in every process (a collective)."""
    whole: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        params = [p for p in sub._parameters.values() if p is not None and hasattr(p, "ds_id")]
        todo = [p for p in params if p.ds_id not in whole]
        with deepspeed.zero.GatheredParameters(todo):
            for p in todo:
                whole[p.ds_id] = torch.nn.Parameter(p.data.detach().clone(), requires_grad=p.requires_grad)
        for name, p in list(sub._parameters.items()):
            if p is not None and hasattr(p, "ds_id"):
                sub._parameters[name] = whole[p.ds_id]  # tied weights stay tied


def _destroy_process_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def check_config(config: dict, path: Path | None) -> None:
    """Refuse, naming the key, what DeepSpeed's own config models refuse or do not know in ``config``."""
    where = f"{path}: " if path else ""
    problem = _config_problem(config)
    if problem is not None:
        # Which top-level table is at fault: try each one on its own.
        culprit = next((key for key in config if _config_problem({key: config[key]})), None)
        raise UserError(where + _describe(problem, culprit), key="parallel.config")
    reader = _Recording({**config, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1})
    with _quiet():
        deepspeed.runtime.config.DeepSpeedConfig(reader)
    for key in config:
        if key not in reader.read:
            hint = difflib.get_close_matches(key, [k for k in reader.read if isinstance(k, str)], n=1)
            raise UserError(f"{where}unknown DeepSpeed option {key!r}" + (f" (did you mean {hint[0]!r}?)" if hint
                                                                          else ""), key="parallel.config")


def _config_problem(config: dict) -> Exception | None:
    with _quiet():
        try:
            deepspeed.runtime.config.DeepSpeedConfig(
                {**config, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1})
        except (pydantic.ValidationError, AssertionError, ValueError, TypeError, KeyError,
                deepspeed.runtime.config.DeepSpeedConfigError) as exc:
            return exc
    return None


def _describe(exc: Exception, table: str | None) -> str:
    if not isinstance(exc, pydantic.ValidationError):
        return f"DeepSpeed refuses the config{f' (in {table!r})' if table else ''}: {exc}"
    error = exc.errors()[0]
    key = ".".join(str(part) for part in ((table,) if table else ()) + tuple(error["loc"]))
    if error["type"] == "extra_forbidden":
        return f"unknown DeepSpeed option {key!r}"
    return f"DeepSpeed option {key!r}: {error['msg']} (got {error['input']!r})"


class _Recording(dict):
    """A config dict that notes every top-level key DeepSpeed reads; a key it never reads is unknown."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read: set = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def keys(self):
        return _RecordingKeys(self)


class _RecordingKeys(KeysView):
    def __contains__(self, key) -> bool:  # DeepSpeed often asks ``key in config.keys()``
        return key in self._mapping


@contextmanager
def _quiet():
    logger = deepspeed.utils.logger
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
