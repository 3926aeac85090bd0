"""The gradient's global L2 norm, per-block norms, and a warning when it leaves a sane band.

The norm of the whole gradient before clipping is the first thing to look at when a run misbehaves
(Pascanu, Mikolov & Bengio 2013, "On the difficulty of training recurrent neural networks",
https://arxiv.org/abs/1211.5063, who introduced clipping by it): a norm that stays near zero means
nothing is learnt (a learning rate far too small, or parameters that receive no gradient); one that
sits orders of magnitude above its usual level means steps far too large, or a batch that is not
what it should be. The band ``[low, high]`` is deliberately wide (0.01 to 100 by default): a
transformer's pre-clip norm typically lives between about 0.1 and 10, and a warning should mean
something.

The norm itself is computed once by the core (``grad_norm`` in ``lmlab_before_optimizer_step``,
which clipping reuses): this monitor only compares it with the band on the device, every step, and
reads it on the host on logging steps. On the step before a logging one it also computes the norm
of each block's gradients (``blocks.N``, ``tok_emb``, ``head``, ``norm_f``, ...): the gradients are
gone by the time ``lmlab_train_batch_end`` runs, after the optimizer step.
"""

import math
import re
import statistics

import torch
from pydantic import model_validator

from lmlab.api import Field, Monitor, Options, UserError, hookimpl

LOW_MEANING = "the learning rate is probably too small (or the model is not learning: frozen parameters?)"
HIGH_MEANING = "the learning rate is too large or a batch is bad (check the data)"

# Prefixes that wrappers put in front of the model's own parameter names (torch.compile, DDP-style
# wrappers): the groups are named as the model names its modules.
_WRAPPERS = re.compile(r"^(?:_orig_mod\.|module\.|_fsdp_wrapped_module\.|_checkpoint_wrapped_module\.)+")


class GradNormOptions(Options):
    low: float = Field(0.01, gt=0, help="warn when the norm stays below this for `patience` steps in a row")
    high: float = Field(100.0, gt=0, help="warn when the norm stays above this for `patience` steps in a row")
    patience: int = Field(50, ge=1, help="steps in a row outside [low, high] before the warning")
    per_layer: bool = Field(True, help="log the norms of the blocks with the largest gradients too "
                                       "(grad_norm/<block>), computed on logging steps only")
    top_k: int = Field(3, ge=1, help="how many of the largest per-block norms to log")

    @model_validator(mode="after")
    def _band(self):
        if self.high <= self.low:
            raise UserError(f"must be above low ({self.low:g}); got {self.high:g}", key="monitor.grad-norm.high")
        return self


def group_of(name: str) -> str:
    """The block a parameter belongs to: ``blocks.3.attn.q.weight`` → ``blocks.3``, ``head.weight``
    → ``head``; a module list's index stays with its name, so each layer is a group."""
    parts = _WRAPPERS.sub("", name).split(".")
    if len(parts) > 2 and parts[1].isdigit():
        return ".".join(parts[:2])
    return parts[0] if len(parts) > 1 else "params"


def block_norms(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The L2 norm of each block's gradients, as 0-dim float32 tensors on their device (no sync)."""
    squares: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        norm = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
        full = getattr(norm, "full_tensor", None)  # a DTensor's shard: its norm needs the other shards'
        norm = full() if full is not None else norm
        squares.setdefault(group_of(name), []).append(norm.square())
    return {group: torch.stack(parts).sum().sqrt() for group, parts in squares.items()}


class GradNorm(Monitor):
    """``grad-norm``: logs the pre-clip gradient norm and warns when it stays outside its band."""

    Options = GradNormOptions
    api = ">=1.20,<2"  # RunControl.run; lmlab.api.monitor (1.7)

    def __init__(self, options=None):
        super().__init__(options)
        self._counts: torch.Tensor | None = None  # steps in a row (below low, above high), on the device
        self._crossings: torch.Tensor | None = None  # episodes that reached `patience`, (low, high)
        self._warned = [0, 0]  # crossings already warned about
        self._pending: tuple[int, torch.Tensor, dict[str, torch.Tensor]] | None = None
        self.observed: list[float] = []  # the norm on each logging step, for the summary
        self.outside = 0  # logging steps whose norm was outside the band (or not finite)
        self._log_every, self._max_steps = 1, 0

    @hookimpl
    def lmlab_run_start(self, control):
        self._log_every, self._max_steps = control.run.train.log_every, control.run.train.max_steps

    def logs_at(self, step: int) -> bool:
        """Whether ``lmlab_train_batch_end`` logs at ``step`` (the core's rule)."""
        return step % self._log_every == 0 or step == self._max_steps

    @hookimpl
    def lmlab_before_optimizer_step(self, step, model, grad_norm):
        if grad_norm is None:
            return None  # the gradients live in an engine (DeepSpeed): there is nothing to read
        o = self.options
        norm = grad_norm.detach().float()
        if self._counts is None:
            self._counts = torch.zeros(2, dtype=torch.int64, device=norm.device)
            self._crossings = torch.zeros(2, dtype=torch.int64, device=norm.device)
        # Device-side bookkeeping only, a few tiny kernels: a run of out-of-band steps grows by one or
        # drops to zero, and passes `patience` exactly once, so counting the steps where it equals
        # `patience` counts the episodes that lasted long enough, however far apart the log steps are.
        # A NaN norm is in neither half of the band: it ends both runs (nan-guard's business).
        outside = torch.stack((norm < o.low, norm > o.high))
        self._counts.add_(1).mul_(outside)
        self._crossings.add_(self._counts == o.patience)
        if self.logs_at(step + 1):
            per_block = block_norms(model) if o.per_layer else {}
            self._pending = (step + 1, norm.clone(), per_block)
        return None

    @hookimpl
    def lmlab_train_batch_end(self, step, log, control):
        if not log or self._pending is None:
            return None
        at, norm, per_block = self._pending
        self._pending = None
        if at != step:  # before_optimizer_step did not run for this step (a skipped optimizer step)
            return None
        names = list(per_block)
        # One host sync for everything this logging step needs.
        values = torch.cat((norm.reshape(1).double(), self._crossings.double(),
                            *(per_block[n].reshape(1).double() for n in names))).tolist()
        value, crossings, blocks = values[0], values[1:3], dict(zip(names, values[3:]))
        self._record(value)
        self._warn(step, value, [int(c) for c in crossings], control)
        metrics = {"grad_norm": value}
        for name in sorted(blocks, key=lambda n: -blocks[n] if math.isfinite(blocks[n]) else -math.inf)[:self.options.top_k]:
            metrics[f"grad_norm/{name}"] = blocks[name]
        return metrics

    def _record(self, value: float) -> None:
        o = self.options
        if not math.isfinite(value):
            self.outside += 1  # counted as outside, kept out of the median and maximum
            self.observed.append(math.nan)
            return
        self.observed.append(value)
        if value < o.low or value > o.high:
            self.outside += 1

    def _warn(self, step: int, value: float, crossings: list[int], control) -> None:
        o = self.options
        for side, (bound, meaning) in enumerate(((f"below {o.low:g}", LOW_MEANING), (f"above {o.high:g}", HIGH_MEANING))):
            if crossings[side] > self._warned[side]:
                self._warned[side] = crossings[side]
                control.note(f"step {step}: the gradient norm stayed {bound} for {o.patience} steps in a row "
                             f"(now {value:.4g}): {meaning}")

    @hookimpl
    def lmlab_run_end(self):
        finite = [v for v in self.observed if math.isfinite(v)]
        if not self.observed:
            return {}
        summary = {"grad_norm_outside_band": self.outside / len(self.observed)}
        if finite:
            summary.update(grad_norm_median=statistics.median(finite), grad_norm_max=max(finite))
        return summary
