"""The LightningModule around an assembled LanguageModel (its data: lmlab.train.data_module)."""

import lightning as L
import torch

from lmlab.compress.restore import KEY as COMPRESS_KEY
from lmlab.compress.restore import records_of
from lmlab.model import compute_loss
from lmlab.train.memory import SavedBytes
from lmlab.train.schedule import WarmupDecay


_PLAIN_ATTRIBUTES = frozenset({"_current_fx_name", "_param_requires_grad_state", "_metric_attributes"})


class LMModule(L.LightningModule):
    def __init__(self, model, objective, optimizer, train_cfg, hooks, compile: bool = False,
                 parallel=None, peft=None, control=None, lr_factor: float = 1.0):
        super().__init__()
        self.control = control  # lmlab.train.control.Control: what monitors may do to the run
        self.lr_factor = lr_factor  # train.lr_scaling's multiplier of every param group's learning rate
        self.last_batch = None  # the step's last micro-batch, kept (a reference) for locating a non-finite value
        self._grad_norm: torch.Tensor | None = None  # this step's pre-clip norm, when the hooks asked for it
        self.model = model
        # A PEFT run (lmlab.train.adapters.PeftRun): checkpoints keep only its adapter, and its
        # plugin's regularization (None for most) joins the training loss.
        self.peft = peft
        self._peft_loss = peft.regularization if peft is not None else None
        if peft is not None:  # checkpoints hold the adapter alone (PeftRun.restore checks its entries)
            self.strict_loading = False
        self.parallel = parallel  # the parallel plugin, asked to shard the model under a device mesh
        # A pipeline schedule runs forward and backward itself (Parallel.forward_backward).
        self._plugin_steps = parallel is not None and parallel.runs_forward_backward
        self._pending = None  # the batch whose forward and backward wait for backward()
        self._parallelised = False
        # The training step runs the compiled model; evaluation and decoding run the eager one (their
        # shapes vary, and each new shape would cost a recompilation). Kept off the module registry
        # so parameter names and checkpoints stay those of the eager model.
        if compile:  # compiled graphs cached where a later run finds them (lmlab.compile_cache)
            from lmlab.compile_cache import use_compile_cache

            use_compile_cache()
        object.__setattr__(self, "train_forward", torch.compile(model) if compile else model)
        self.objective = objective
        # Dispatched once: an objective that asks for Windows (labels, padding, randomness) gets them;
        # others get the plain (B, T+1) tensors, with nothing added per step.
        # Only an objective that can leave a whole batch unscored pays for counting what each scored.
        self._counts_scored = objective is not None and objective.drops_truncated
        self.make_batch = (None if objective is None else
                           objective.make_batch_from if objective.wants_windows() else objective.make_batch)
        self.optimizer_plugin = optimizer
        self.cfg = train_cfg  # lmlab.config.TrainOptions
        self.hooks = hooks
        # Objective.report's figures: summed on the device over the logging interval (train) and the
        # evaluation (val); name → (sum, count).
        self.train_reports: dict[str, tuple[torch.Tensor, int]] = {}
        self._val_reports: dict[str, tuple[torch.Tensor, int]] = {}
        self.val_reports: dict[str, float] = {}
        self.last_loss: torch.Tensor | None = None  # the current step's loss (micro-batch mean), not synced
        self.last_scored: torch.Tensor | None = None  # of the current step's micro-batches, those that scored any
        self.last_aux: torch.Tensor | None = None  # its auxiliary loss (e.g. MoE load balancing)
        self._loss_step, self._micro = -1, 0  # the optimizer step last_loss averages over, micro-batches so far
        self.val_loss: float | None = None
        self.val_extra_losses: list[float] | None = None  # each of the model's extra_heads', as val_loss
        self.activation_bytes: int | None = None
        self._val_sum = self._val_count = self._val_extra_sum = None

    def __setattr__(self, name: str, value) -> None:
        # Lightning sets bookkeeping attributes (``_current_fx_name``) around every hook call, dozens
        # of times per step; nn.Module.__setattr__ checks each against parameters, buffers and
        # submodules. Plain values on names that are none of those can skip that.
        if not isinstance(value, (torch.nn.Module, torch.Tensor)) and name in _PLAIN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    @property
    def companions(self) -> list:
        """The frozen models of the objective's other runs (a reference, a reward model, a teacher)."""
        return self.__dict__.get("_companions", [])

    @companions.setter
    def companions(self, models: list) -> None:
        # Kept off the module registry: not trained, not wrapped, not in this run's checkpoints.
        self.__dict__["_companions"] = list(models)

    def on_fit_start(self) -> None:
        for model in self.companions:  # to the device the strategy put the trained model on
            model.to(self.device)

    def configure_model(self) -> None:
        # Lightning calls this in every process before the optimizer is built, and again for each
        # later fit/validate; a strategy that shards or splits the model provides a device mesh.
        if self.parallel is None or self._parallelised or self.device_mesh is None:
            return
        # Sharding replaces parameters with new (DTensor) ones; what plugins marked on the old ones
        # (``_no_weight_decay``) must reach configure_optimizers all the same.
        marks = {name: dict(p.__dict__) for name, p in self.model.named_parameters() if p.__dict__}
        self.parallel.configure_model(self.model, self.device_mesh)
        for name, p in self.model.named_parameters():
            for key, value in marks.get(name, {}).items():
                setattr(p, key, value)
        self._parallelised = True

    def forward(self, idx, cache=None):
        return self.model(idx, cache=cache)

    def training_step(self, windows, batch_idx: int) -> torch.Tensor:
        batch = self.make_batch(windows)
        self.last_batch = batch
        if self._plugin_steps:
            # Lightning zeroes the gradients between training_step and backward, so the plugin's
            # forward-and-backward waits for backward(); what is returned here only stands in.
            self._pending = batch
            return torch.zeros((), device=batch.input_ids.device)
        if self.activation_bytes is None:  # once: what autograd keeps for backward, per micro-batch
            saved = SavedBytes()
            with saved:
                out = compute_loss(self.model, self.objective, batch, forward=self.train_forward)
            self.activation_bytes = saved.total
        else:
            out = compute_loss(self.model, self.objective, batch, forward=self.train_forward)
        add_reports(self.train_reports, self.objective.take_reports())
        if self._peft_loss is not None:
            extra = self._peft_loss(self.model)
            out = out._replace(total=out.total + extra, aux=extra if out.aux is None else out.aux + extra)
        self._note_loss(out.loss.detach(), out.aux.detach() if out.aux is not None else None,
                        batch.n_scored() if self._counts_scored else None)
        return out.total

    def _note_loss(self, loss: torch.Tensor, aux: torch.Tensor | None, scored: torch.Tensor | None = None) -> None:
        """``last_loss``: the mean over the micro-batches of the optimizer step so far, which after its
        last micro-batch is the step's loss (what one batch of all their rows gives, as the gradient
        is); no host sync. With ``scored`` (only for an objective that can leave a whole batch
        unscored, ``drops_truncated``) the mean is over the micro-batches that scored something, and
        ``last_scored`` counts them (0: the step's loss means nothing, and is not logged)."""
        step = self.trainer.global_step
        if step != self._loss_step:
            self._loss_step, self._micro = step, 0
        self._micro += 1
        if scored is not None:
            # A micro-batch without a scored target returns a stand-in loss (0): it must not pull the mean.
            counts = (scored > 0).to(torch.float32)
            value = torch.where(counts > 0, loss.float(), 0.0)
            if self._micro == 1:
                self._loss_sum, self.last_scored = value, counts
            else:
                self._loss_sum, self.last_scored = self._loss_sum + value, self.last_scored + counts
            self.last_loss = (self._loss_sum / self.last_scored.clamp(min=1)).to(loss.dtype)
        elif self._micro == 1:
            self.last_loss = loss
        else:
            self.last_loss = self.last_loss + (loss - self.last_loss) / self._micro
        if self._micro == 1:
            self.last_aux = aux
        elif aux is not None and self.last_aux is not None:
            self.last_aux = self.last_aux + (aux - self.last_aux) / self._micro

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        if self._pending is None:
            return super().backward(loss, *args, **kwargs)
        batch, self._pending = self._pending, None
        precision = self.trainer.precision_plugin
        scale = 1.0 / self.trainer.accumulate_grad_batches
        scaler = getattr(precision, "scaler", None)
        if scaler is not None:  # 16-mixed: what Lightning would have multiplied the loss by
            scale *= scaler.get_scale()
        # The forward passes happen here, outside training_step's autocast: enter it again.
        with precision.forward_context():
            loss = self.parallel.forward_backward(self.model, batch, self.objective.loss, scale)
        self._note_loss(loss, None)  # under grad_accum, the step's loss is the micro-batches' mean

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        norm, self._grad_norm = self._grad_norm, None
        if gradient_clip_val and norm is not None and not self._parallelised:
            # The hooks had the norm computed already: clip with it rather than computing it again.
            torch.nn.utils.clip_grads_with_norm_(_with_grads(optimizer), float(gradient_clip_val), norm)
            return
        # A layout that spreads or shards the model computes the global norm itself.
        if gradient_clip_val and self.parallel is not None and gradient_clip_algorithm in (None, "norm"):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if self.parallel.clip_grad_norm(params, float(gradient_clip_val)) is not None:
                return
        if gradient_clip_val and getattr(optimizer, "_step_supports_amp_scaling", False):
            # A fused optimizer (AdamW's default on the CPU and CUDA) unscales inside its step, so
            # Lightning's mixed-precision plugins refuse to clip for it; its gradients are unscaled
            # by now (on_before_optimizer_step), and clipping them is the same arithmetic.
            clip = torch.nn.utils.clip_grad_norm_ if gradient_clip_algorithm in (None, "norm") \
                else torch.nn.utils.clip_grad_value_
            clip(_with_grads(optimizer), float(gradient_clip_val))
            return
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)

    def on_validation_epoch_start(self) -> None:
        self._val_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._val_count = torch.zeros((), dtype=torch.float64, device=self.device)
        extra = getattr(self.model, "extra_heads", ())
        self._val_extra_sum = torch.zeros(len(extra), dtype=torch.float64, device=self.device) if extra else None
        self._val_reports = {}

    def validation_step(self, windows, batch_idx: int) -> None:
        batch = self.make_batch(windows)
        extras = None
        if self._plugin_steps:
            loss = self.parallel.forward_loss(self.model, batch, self.objective.loss)
        else:
            out = compute_loss(self.model, self.objective, batch)
            loss, extras = out.loss, out.extras
        add_reports(self._val_reports, self.objective.take_reports())
        n = batch.n_scored()
        self._val_sum += loss.double() * n
        self._val_count += n
        if extras is not None:
            self._val_extra_sum += extras.double() * n

    def on_validation_epoch_end(self) -> None:
        total = self.trainer.strategy.reduce(self._val_sum, reduce_op="sum")
        count = self.trainer.strategy.reduce(self._val_count, reduce_op="sum")
        self.val_loss = (total / count.clamp(min=1)).item()
        if self._val_extra_sum is not None:
            extras = self.trainer.strategy.reduce(self._val_extra_sum, reduce_op="sum")
            self.val_extra_losses = (extras / count.clamp(min=1)).tolist()
        self.val_reports = reduce_reports(self._val_reports, self.trainer.strategy, self.device)

    def configure_optimizers(self):
        optimizer = self.optimizer_plugin.build(self.model.param_infos())
        if self.lr_factor != 1.0:  # train.lr_scaling: every group alike, so their ratios stay the plugin's
            for group in optimizer.param_groups:
                group["lr"] *= self.lr_factor
        base_lr = optimizer.param_groups[0]["lr"]
        min_lr = self.cfg.min_lr if self.cfg.min_lr is not None else base_lr / 10
        schedule = WarmupDecay(self.cfg.warmup_steps, self.cfg.decay_steps,
                               min_lr / base_lr, self.cfg.lr_schedule, self.cfg.decay_fraction)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer) -> None:
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
            # 16-mixed with a fused optimizer: Lightning leaves the unscaling to its step; done here,
            # monitors and clipping see the true gradients, and the step (told so) skips it.
            scaler.unscale_(optimizer)
        if not self.hooks.has("lmlab_before_optimizer_step"):
            return
        self._grad_norm = grad_norm(optimizer)
        self.hooks.collect("lmlab_before_optimizer_step", step=self.trainer.global_step, model=self.model,
                           optimizer=optimizer, grad_norm=self._grad_norm, loss=self.last_loss, control=self.control)
        if self.control is not None and self.control.take_skip():
            # An optimizer skips a parameter without a gradient: no update, no state change, no decay.
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            self._grad_norm = None

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # Dropout draws from the global generator: keep it so a resumed run continues identically.
        checkpoint["lmlab_rng"] = torch.get_rng_state()
        records = records_of(self.model)
        if records:  # fine-tuned from a compressed run: how to rebuild it
            checkpoint[COMPRESS_KEY] = records
        if self.peft is not None:  # the adapter's entries only; the base is in base.safetensors
            self.peft.prune(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "lmlab_rng" in checkpoint:
            torch.set_rng_state(checkpoint["lmlab_rng"])
        if self.peft is not None:
            self.peft.restore(checkpoint)


def add_reports(into: dict, reports: dict) -> None:
    """Add one loss call's Objective.report figures (name → (sum, count)) to a running total."""
    for name, (total, count) in reports.items():
        before = into.get(name)
        into[name] = (total, count) if before is None else (before[0] + total, before[1] + count)


def reduce_reports(reports: dict, strategy, device) -> dict[str, float]:
    """The mean of each reported figure over every process (names in sorted order: the same collectives
    in every process); emptied."""
    means = {}
    for name in sorted(reports):
        total, count = reports[name]
        pair = torch.stack([torch.as_tensor(total, dtype=torch.float64, device=device),
                            torch.as_tensor(float(count), dtype=torch.float64, device=device)])
        if strategy is not None and getattr(strategy, "world_size", 1) > 1:
            pair = strategy.reduce(pair, reduce_op="sum")
        means[name] = (pair[0] / pair[1].clamp(min=1)).item()
    reports.clear()
    return means


def grad_norm(optimizer) -> torch.Tensor | None:
    """The global L2 norm of the optimizer's gradients (float32, on their device); None when the
    parameters hold no gradients (DeepSpeed keeps them in its engine)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return None
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    full = getattr(norm, "full_tensor", None)  # a DTensor when the model is sharded
    return (full() if full is not None else norm).float()


def _with_grads(optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters that have a gradient this step."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
