"""The optimizer slot: how the parameters are updated.

An optimizer plugin makes one ``torch.optim.Optimizer``; the core and Lightning own everything around
its ``step``: the gradients (forward and backward passes, accumulation over ``train.grad_accum``
micro-batches, loss scaling under ``16-mixed``), the clipping of their global norm, the learning-rate
schedule and the checkpointing of the optimizer's state. What the optimizer returned by
[Optimizer.build][lmlab.api.optimizer.Optimizer.build] must do is written there.
"""

from dataclasses import dataclass

import torch

from lmlab.api.options import Field, Options
from lmlab.api.plugin import Plugin


@dataclass
class ParamInfo:
    """One trainable parameter as [Optimizer.build][lmlab.api.optimizer.Optimizer.build] receives it.

    The core lists every parameter of the model that requires gradients (with a PEFT adapter, only
    the adapter's), once each, in ``model.named_parameters()`` order, so a tied head and embedding
    weight appears once, as ``tok_emb.weight``.
    """

    name: str
    """The parameter's full name in ``model.named_parameters()`` (``blocks.0.attn.q_proj.weight``)."""
    param: torch.nn.Parameter
    """The parameter itself, as the optimizer will update it: in the dtype the precision keeps
    weights in (float32 under ``32-true`` and the ``*-mixed`` precisions); a DTensor when the
    parallel plugin sharded the model
    ([Parallel.configure_model][lmlab.api.parallel.Parallel.configure_model])."""
    decay: bool
    """Whether weight decay applies, decided by the core: True exactly for parameters of two or more
    dimensions that are not the weight of an ``nn.Embedding`` (the token embedding, and the head when
    it is tied to it, a learned position table) and that a plugin did not mark with the attribute
    ``_no_weight_decay = True`` (Mamba's ``A_log``). Norm gains, biases and every other vector or
    scalar are False. An untied head is a matrix, and decays."""


class OptimizerOptions(Options):
    """Options every optimizer has: the peak learning rate. A plugin's options subclass these."""

    lr: float = Field(1e-3, gt=0, help="peak learning rate (the [train] schedule scales it)")


class Optimizer(Plugin):
    """How the parameters are updated: [build][lmlab.api.optimizer.Optimizer.build] makes the
    ``torch.optim.Optimizer`` of a run from the model's trainable parameters (a list of
    [ParamInfo][lmlab.api.optimizer.ParamInfo]).

    What the core does around it, so that a plugin does none of it again:

    - **Weight decay grouping.** The core decides which parameters decay
      ([ParamInfo.decay][lmlab.api.optimizer.ParamInfo.decay]); the plugin decides how much, and puts
      the parameters with ``decay`` False into a param group with ``weight_decay`` 0 (``adamw``: one
      group of each kind, empty groups left out, as torch refuses them).
    - **Gradient clipping.** With ``train.grad_clip`` > 0 (default 1.0), the global L2 norm of the
      gradients of every parameter in ``param_groups`` is clipped to it before each step (by
      ``torch.nn.utils.clip_grad_norm_``, or by
      [Parallel.clip_grad_norm][lmlab.api.parallel.Parallel.clip_grad_norm] for a sharded or split
      model; DeepSpeed's engine clips by the same option itself), after the gradients are
      accumulated and unscaled and after the ``lmlab_before_optimizer_step`` hooks. The optimizer
      must not clip again.
    - **Learning-rate schedule.** Right after ``build``, the core reads the peak learning rate from
      ``param_groups[0]["lr"]`` (``train.min_lr`` defaults to a tenth of it) and wraps the optimizer
      in a ``torch.optim.lr_scheduler.LambdaLR``: before every step it writes each group's
      ``"lr"`` as that group's learning rate at build time (kept under ``"initial_lr"``) times the
      schedule's factor for the step (linear warmup over ``train.warmup_steps``, then cosine, linear
      or no decay to ``train.min_lr`` at ``train.decay_steps``).
    - **Checkpoints.** Lightning saves ``state_dict()`` in every checkpoint and, when a run resumes,
      calls ``load_state_dict`` on a freshly built optimizer. The run's summary counts the tensors
      of ``optimizer.state`` as optimizer memory, and ``lmlab plan`` builds the optimizer on fake
      parameters and steps it once to measure that state.
    """

    slot = "optimizer"
    Options = OptimizerOptions

    def build(self, params: list[ParamInfo]) -> torch.optim.Optimizer:
        """Make the optimizer of the trainable parameters ``params``.

        Called once per training run in every process, by Lightning's ``configure_optimizers``:
        after the model is built, initialised, given its starting weights and PEFT adapter and (under
        a strategy with a device mesh) sharded by the parallel plugin, and before a resumed run's
        optimizer state is loaded into the result. ``lmlab plan`` also calls it, on parameters that
        hold no memory, and calls ``step()`` once without a closure.

        The returned optimizer must honour this contract:

        - Its param groups hold every parameter of ``params`` exactly once, each group's ``"lr"``
          set to the peak learning rate (``options.lr``, or a multiple of it). Extra keys the
          scheduler adds to a group (``"initial_lr"``) must be tolerated.
        - ``step(closure=None)`` reads each group's ``group["lr"]`` afresh at every call and never
          caches a learning rate (in ``build``, in its state or in a fused kernel's arguments): the
          schedule rewrites it before each step.
        - When ``closure`` is given, ``step`` calls it exactly once, before reading any gradient,
          with gradients enabled (``with torch.enable_grad(): loss = closure()``), and returns the
          loss it returns. Lightning's closure runs the step's last micro-batch (forward, backward;
          the earlier micro-batches of a ``train.grad_accum`` step have already added their
          gradients), the ``lmlab_before_optimizer_step`` hooks and the gradient clipping; a step
          that skips it trains on no gradients at all, and Lightning fails the run.
        - When ``closure`` is None, the gradients are already final: under ``16-mixed`` Lightning
          runs the closure itself and the gradient scaler calls ``step()`` (skipping it when a
          gradient is not finite); under DeepSpeed its engine calls it.
        - The update runs without autograd recording it (``torch.no_grad()``, as torch's own
          optimizers do) and works on DTensor parameters when the parallel plugin shards the model.
        - Per-parameter state lives in ``self.state`` (``torch.optim.Optimizer``'s), so that it is
          checkpointed and counted.

        Args:
            params: The model's trainable parameters, with whether each decays.

        Returns:
            A ``torch.optim.Optimizer`` over exactly those parameters.
        """
        raise NotImplementedError

    def update_rule(self) -> str | None:
        """The standard update that the optimizer from [build][lmlab.api.optimizer.Optimizer.build]
        applies exactly, so that a parallel plugin with its own implementation of that update may
        step the same param groups with it instead (API 1.16): DeepSpeed's vectorised CPU Adam under
        ZeRO-Offload (``parallel.cpu_adam``) does so only for an optimizer that declares ``"adamw"``.

        ``"adamw"``: ``torch.optim.AdamW``'s update (Adam with bias correction and decoupled weight
        decay; no amsgrad, not maximizing), reading each param group's ``"lr"``, ``"betas"``,
        ``"eps"`` and ``"weight_decay"`` at every step. None (the default): no other implementation
        stands in for this plugin's optimizer. Called during the checks, in every process; it must
        be cheap and decide from the options alone.
        """
        return None
