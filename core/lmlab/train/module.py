"""The LightningModule and DataModule around an assembled LanguageModel."""

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from lmlab.api import UserError
from lmlab.compress.restore import KEY as COMPRESS_KEY
from lmlab.compress.restore import records_of
from lmlab.model import compute_loss
from lmlab.train import curriculum
from lmlab.train.batches import (FixedDocuments, FixedWindowBatches, FixedWindows, RandomDocuments, RandomWindows,
                                 document_spans)
from lmlab.train.memory import SavedBytes
from lmlab.train.replay import Replayed
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
        # Early exit (model.exit_layers): the exit heads' losses join the head's with this weight.
        self.exit_weight = getattr(train_cfg, "exit_loss_weight", 1.0)
        if getattr(train_cfg, "train_only", None) == "exit_heads":
            train_exit_heads_only(model, peft)
        # A pipeline schedule runs forward and backward itself (Parallel.forward_backward).
        self._plugin_steps = bool(getattr(parallel, "runs_forward_backward", False))
        self._pending = None  # the batch whose forward and backward wait for backward()
        self._parallelised = False
        # The training step runs the compiled model; evaluation and decoding run the eager one (their
        # shapes vary, and each new shape would cost a recompilation). Kept off the module registry
        # so parameter names and checkpoints stay those of the eager model.
        object.__setattr__(self, "train_forward", torch.compile(model) if compile else model)
        self.objective = objective
        # Dispatched once: an objective that asks for Windows (labels, padding, randomness) gets them;
        # others get the plain (B, T+1) tensors, with nothing added per step.
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
        self.last_aux: torch.Tensor | None = None  # its auxiliary loss (e.g. MoE load balancing)
        self._loss_step, self._micro = -1, 0  # the optimizer step last_loss averages over, micro-batches so far
        self.val_loss: float | None = None
        self.val_exit_losses: list[float] | None = None  # each exit head's, as val_loss (model.exit_layers)
        self.activation_bytes: int | None = None
        self._val_sum = self._val_count = self._val_exit_sum = None

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
                out = compute_loss(self.model, self.objective, batch, forward=self.train_forward,
                                   exit_weight=self.exit_weight)
            self.activation_bytes = saved.total
        else:
            out = compute_loss(self.model, self.objective, batch, forward=self.train_forward,
                               exit_weight=self.exit_weight)
        add_reports(self.train_reports, self.objective.take_reports())
        if self._peft_loss is not None:
            extra = self._peft_loss(self.model)
            out = out._replace(total=out.total + extra, aux=extra if out.aux is None else out.aux + extra)
        self._note_loss(out.loss.detach(), out.aux.detach() if out.aux is not None else None)
        return out.total

    def _note_loss(self, loss: torch.Tensor, aux: torch.Tensor | None) -> None:
        """``last_loss``: the mean over the micro-batches of the optimizer step so far, which after its
        last micro-batch is the step's loss (what one batch of all their rows gives, as the gradient
        is); no host sync."""
        step = self.trainer.global_step
        if step != self._loss_step:
            self._loss_step, self._micro = step, 0
        self._micro += 1
        if self._micro == 1:
            self.last_loss, self.last_aux = loss, aux
            return
        self.last_loss = self.last_loss + (loss - self.last_loss) / self._micro
        if aux is not None and self.last_aux is not None:
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
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, float(gradient_clip_val), norm)
            return
        # A layout that spreads or shards the model computes the global norm itself.
        if gradient_clip_val and self.parallel is not None and gradient_clip_algorithm in (None, "norm"):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if self.parallel.clip_grad_norm(params, float(gradient_clip_val)) is not None:
                return
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)

    def on_validation_epoch_start(self) -> None:
        self._val_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._val_count = torch.zeros((), dtype=torch.float64, device=self.device)
        exits = getattr(self.model, "exit_heads", None)
        self._val_exit_sum = None if exits is None else torch.zeros(len(exits), dtype=torch.float64,
                                                                    device=self.device)
        self._val_reports = {}

    def validation_step(self, windows, batch_idx: int) -> None:
        batch = self.make_batch(windows)
        exits = None
        if self._plugin_steps:
            loss = self.parallel.forward_loss(self.model, batch, self.objective.loss)
        else:
            out = compute_loss(self.model, self.objective, batch)
            loss, exits = out.loss, out.exits
        add_reports(self._val_reports, self.objective.take_reports())
        n = batch.n_scored()
        self._val_sum += loss.double() * n
        self._val_count += n
        if exits is not None:
            self._val_exit_sum += exits.double() * n

    def on_validation_epoch_end(self) -> None:
        total = self.trainer.strategy.reduce(self._val_sum, reduce_op="sum")
        count = self.trainer.strategy.reduce(self._val_count, reduce_op="sum")
        self.val_loss = (total / count.clamp(min=1)).item()
        if self._val_exit_sum is not None:
            exits = self.trainer.strategy.reduce(self._val_exit_sum, reduce_op="sum")
            self.val_exit_losses = (exits / count.clamp(min=1)).tolist()
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


def train_exit_heads_only(model, peft=None) -> None:
    """``train.train_only = "exit_heads"``: freeze every weight but the exit heads' (early exit on a
    trained model, as BranchyNet's branches may be trained on a fixed network; Teerapittayanon et al.
    2016). The tied output head stays frozen with the embedding, so the model's own predictions do
    not move."""
    if getattr(model, "exit_heads", None) is None:
        raise UserError("exit_heads needs exit heads to train: set model.exit_layers (blocks after which an exit "
                        "head sits)", key="train.train_only")
    if peft is not None:
        raise UserError("exit_heads trains the exit heads alone; a [peft] adapter would be another set of trained "
                        "weights: use one or the other", key="train.train_only")
    model.requires_grad_(False)
    model.exit_heads.requires_grad_(True)


def grad_norm(optimizer) -> torch.Tensor | None:
    """The global L2 norm of the optimizer's gradients (float32, on their device); None when the
    parameters hold no gradients (DeepSpeed keeps them in its engine)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return None
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    full = getattr(norm, "full_tensor", None)  # a DTensor when the model is sharded
    return (full() if full is not None else norm).float()


def check_windows_fit(tokens, block_size: int) -> None:
    """Each split holds at least one window of block_size + 1 tokens (training draws from a range
    one longer), or the run is refused before it starts."""
    for split, needs in (("train", block_size + 2), ("val", block_size + 1)):
        held = len(getattr(tokens, split))
        if held < needs:
            raise UserError(f"the {split} split of the data holds {held:,} tokens, fewer than a window of "
                            f"block_size + 1 = {block_size + 1} needs; use more data or a smaller model.block_size",
                            key="model.block_size")


class TokenDataModule(L.LightningDataModule):
    """Batches of the prepared tokens, drawn as the objective asks (see :mod:`lmlab.train.batches`).

    With an ``objective`` that asks for Windows, its ``token_labels`` are set up here, once per split
    (which is where a corpus that cannot serve it is refused), and batches are Windows of random or
    fixed windows, or of padded documents; otherwise plain (B, T+1) tensors.
    """

    def __init__(self, tokens, block_size: int, batch_size: int, eval_batch_size: int, eval_steps: int,
                 seed: int, grad_accum: int, objective=None, replay=None, replay_fraction: float = 0.0,
                 data_options=None):
        super().__init__()
        self.replay, self.replay_fraction = replay, replay_fraction  # lmlab.train.replay
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.eval_batch_size, self.eval_steps, self.seed = eval_batch_size, eval_steps, seed
        self.grad_accum = grad_accum
        self.full_validation = False
        self.rich = objective is not None and objective.wants_windows()
        self.sampling = getattr(objective, "sampling", "windows")
        if self.sampling not in ("windows", "documents"):
            raise ValueError(f"objective {objective.name!r}: sampling must be 'windows' or 'documents', "
                             f"not {self.sampling!r}")
        if self.sampling == "documents" and not self.rich:
            raise TypeError(f"objective {objective.name!r} samples padded documents, so it must override "
                            "make_batch_from (only Windows say where the padding is)")
        if self.sampling == "windows":
            check_windows_fit(tokens, block_size)
        self.labels = {split: objective.token_labels(tokens.split(split)) if self.rich else None
                       for split in ("train", "val")}
        self.curriculum, self.train_documents, self.weights = None, None, None
        weights = tokens.document_weights("train") if hasattr(tokens, "document_weights") else None
        if getattr(data_options, "curriculum", "none") != "none" or weights is not None:
            document_starts = tokens.document_starts("train")
            starts, ends = document_spans(tokens.train, document_starts)
            keep = np.diff(np.append(np.asarray(document_starts, dtype=np.int64), len(tokens.train))) > 0
            self.curriculum = curriculum.build(data_options, tokens, objective, starts, ends, keep)
            self.train_documents = (starts, ends)
            if weights is not None:
                self.weights = weights[keep]
                if not self.weights.sum() > 0:
                    raise UserError("the filters weighed every training document 0: training has nothing to draw",
                                    key="filter.use")

    def train_dataloader(self) -> DataLoader:
        # Called after a checkpoint is restored, so global_step already says where to continue.
        start = self.trainer.global_step * self.grad_accum
        # Data-parallel replicas, which are not all ranks under tensor or pipeline parallelism: ranks
        # that hold parts of one replica must see the same batch.
        sharding = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        replicas = {"replica": sharding.get("rank", 0), "replicas": sharding.get("num_replicas", 1), "start": start,
                    "accum": self.grad_accum}
        if self.sampling == "documents":
            windows = RandomDocuments(self.tokens.train, self.tokens.document_starts("train"), self.block_size,
                                      self.batch_size, self.seed, labels=self.labels["train"],
                                      curriculum=self.curriculum, weights=self.weights, **replicas)
        else:
            windows = RandomWindows(self.tokens.train, self.block_size, self.batch_size, self.seed,
                                    rich=self.rich, labels=self.labels["train"], curriculum=self.curriculum,
                                    documents=self.train_documents, weights=self.weights, **replicas)
        if self.replay is not None:
            windows = Replayed(windows, self.replay, self.replay_fraction, self.block_size, self.batch_size,
                               self.seed, **replicas)
        # Own generators: iterating a DataLoader draws a seed from its generator, and drawing it from
        # the global one would shift every later dropout mask when a resumed run re-creates it.
        return DataLoader(windows, batch_size=None, generator=torch.Generator())

    def val_dataloader(self) -> DataLoader:
        limit = None if self.full_validation else self.eval_steps * self.eval_batch_size
        if not self.rich:
            windows = FixedWindows(self.tokens.val, self.block_size, limit)
            return DataLoader(windows, batch_size=self.eval_batch_size, shuffle=False, generator=torch.Generator())
        if self.sampling == "documents":
            batches = FixedDocuments(self.tokens.val, self.tokens.document_starts("val"), self.block_size,
                                     self.eval_batch_size, self.seed, limit, labels=self.labels["val"])
        else:
            batches = FixedWindowBatches(self.tokens.val, self.block_size, self.eval_batch_size, self.seed, limit,
                                         labels=self.labels["val"])
        return DataLoader(batches, batch_size=None, shuffle=False, generator=torch.Generator())
