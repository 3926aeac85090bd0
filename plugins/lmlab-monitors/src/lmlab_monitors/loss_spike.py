"""Loss spikes (z-scores against a rolling window) and a warning when the loss is persistently noisy.

Loss spikes, sudden jumps of the training loss that training may or may not recover from, are the
common symptom of an unstable large-model run (Chowdhery et al. 2022, "PaLM: Scaling Language
Modeling with Pathways", https://arxiv.org/abs/2204.02311, section 5.1: "we observed spikes in the
loss roughly 20 times during training"; Wortsman et al. 2023, "Small-scale proxies for large-scale
Transformer training instabilities", https://arxiv.org/abs/2309.14322, on their causes). This monitor
counts them and says when they happen.

What is computed, exactly. ``H`` is the history: the last ``window`` finite losses, oldest first.
For each new step's loss ``x`` in step order: when ``H`` holds at least ``min_history`` losses,
``μ`` is their mean and ``σ`` their sample standard deviation (``statistics.stdev``, divisor
``n − 1``), and ``z = (x − μ) / σ``; the step is a spike when ``z > z`` (the option; only rises
count, a sudden drop harms nothing). Then ``x`` joins ``H``, spike or not, and the oldest loss
leaves when ``H`` is full. A loss that is not finite is skipped: it neither is judged nor enters
``H`` (``nan-guard`` handles those). ``loss_std`` is the sample standard deviation of ``H`` at the
logging step.

``H`` includes the loss's own downward trend, so while the loss falls quickly σ is wider and a
spike has to be larger to count. For the same reason the instability warning does not judge
``loss_std``, which a falling loss inflates (a loss going from 4 to 2 over a window has a standard
deviation near 0.6 with no noise at all), but the standard deviation of ``H`` around its
least-squares line, once ``H`` is full.

Per step, the loss is copied into a device buffer (one small kernel, no host sync); on logging steps
the buffer comes to the host in one transfer and the statistics are computed there, in Python.
"""

import math
from collections import deque

import torch

from pydantic import model_validator

from lmlab.api import Field, Monitor, Options, UserError, hookimpl

MAX_SPIKE_NOTES = 10  # after these, spikes are counted but no longer printed one by one


class LossSpikeOptions(Options):
    window: int = Field(100, ge=2, help="losses in the rolling window the statistics are taken over")
    z: float = Field(4.0, gt=0, help="a loss more than this many standard deviations above the window's "
                                     "mean is a spike")
    min_history: int = Field(20, ge=2, help="losses the window must hold before a spike can be flagged")
    unstable_std: float = Field(0.5, ge=0, help="warn once when the losses of a full window scatter more "
                                                "than this (standard deviation around their trend; 0: off)")

    @model_validator(mode="after")
    def _history_fits_the_window(self):
        # The window never holds more than `window` losses: a larger minimum would flag nothing, ever.
        if self.min_history > self.window:
            raise UserError(f"must be at most window ({self.window}), which is all the history there is; got "
                            f"{self.min_history}", key="monitor.loss-spike.min_history")
        return self


class LossSpike(Monitor):
    """``loss-spike``: counts loss spikes and warns about each, and about persistent noise."""

    Options = LossSpikeOptions
    api = ">=1.20,<2"  # RunControl.run; lmlab.api.monitor (1.7)

    def __init__(self, options=None):
        super().__init__(options)
        self.history: deque[float] = deque(maxlen=self.options.window)
        self.spikes: list[dict] = []  # {"step", "loss", "z"} of each spike
        self.loss_std: float | None = None
        self._buffer: torch.Tensor | None = None  # this window's losses, on the device
        self._steps: list[int] = []  # the step of each filled slot of _buffer
        self._capacity = 0
        self._warned_unstable = False

    @hookimpl
    def lmlab_run_start(self, control):
        # Room for the losses between two logging steps, so the buffer never waits for a sync.
        self._capacity = control.run.train.log_every

    @hookimpl
    def lmlab_train_batch_end(self, step, loss, log, control):
        if loss is None:
            return None
        if self._buffer is None:
            self._buffer = torch.empty(max(self._capacity, 1), dtype=torch.float32, device=loss.device)
        if len(self._steps) == len(self._buffer):
            self._flush(control)  # more steps than expected between logging steps: sync early
        self._buffer[len(self._steps)] = loss.detach()
        self._steps.append(step)
        if not log:
            return None
        self._flush(control)
        metrics = {"loss_spikes": len(self.spikes)}
        if self.loss_std is not None:
            metrics["loss_std"] = self.loss_std
        return metrics

    def _flush(self, control) -> None:
        if not self._steps:
            return
        losses = self._buffer[:len(self._steps)].tolist()  # the one host sync
        steps, self._steps = self._steps, []
        for step, loss in zip(steps, losses):
            self.observe(step, loss, control)
        if len(self.history) >= 2:
            self.loss_std = _stdev(self.history)
        self._check_unstable(steps[-1], control)

    def observe(self, step: int, loss: float, control) -> float | None:
        """Judges one loss against the history and adds it; returns its z-score (None when there was
        no judging: too little history, no spread, or a loss that is not finite)."""
        if not math.isfinite(loss):
            return None
        o = self.options
        z = None
        if len(self.history) >= o.min_history:
            mean, std = _mean(self.history), _stdev(self.history)
            if std > 0:
                z = (loss - mean) / std
                if z > o.z:
                    self.spikes.append({"step": step, "loss": loss, "z": z})
                    if len(self.spikes) <= MAX_SPIKE_NOTES:
                        more = " (further spikes are counted, not printed)" if len(self.spikes) == MAX_SPIKE_NOTES else ""
                        control.note(f"step {step}: loss spike {loss:.4g}, z = {z:.1f} over the previous "
                                     f"{len(self.history)} losses (mean {mean:.4g}, std {std:.3g}){more}")
        self.history.append(loss)
        return z

    def _check_unstable(self, step: int, control) -> None:
        o = self.options
        if self._warned_unstable or not o.unstable_std or len(self.history) < o.window:
            return
        scatter = detrended_std(self.history)
        if scatter > o.unstable_std:
            self._warned_unstable = True
            control.note(f"step {step}: training is unstable: std of the last {len(self.history)} losses is "
                         f"{scatter:.3g} around their trend (> {o.unstable_std:g}); lower the learning rate "
                         "or raise warmup")

    @hookimpl
    def lmlab_run_end(self, control):
        try:  # losses since the last logging step (a run that failed between two); never fail the summary
            self._flush(control)
        except Exception:  # noqa: BLE001 - a broken device cannot give them back; the summary goes on
            self._steps = []
        return {"loss_std_last": self.loss_std, "loss_spikes": len(self.spikes)}


def _mean(values) -> float:
    return math.fsum(values) / len(values)


def _stdev(values) -> float:
    """Sample standard deviation (divisor n − 1), as ``statistics.stdev`` but without its exact
    fractions, which cost milliseconds per call."""
    mean = _mean(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


def detrended_std(values) -> float:
    """Standard deviation of ``values`` around their least-squares line against their index
    (divisor n − 2, the residual's degrees of freedom)."""
    n = len(values)
    if n < 3:
        return 0.0
    x_mean, y_mean = (n - 1) / 2, _mean(values)
    sxx = math.fsum((i - x_mean) ** 2 for i in range(n))
    slope = math.fsum((i - x_mean) * (v - y_mean) for i, v in enumerate(values)) / sxx
    residuals = ((v - y_mean - slope * (i - x_mean)) for i, v in enumerate(values))
    return math.sqrt(math.fsum(r * r for r in residuals) / (n - 2))
