"""The monitor slot: plugins that watch a run through the lifecycle hooks and say what they see
(API 1.7).

A monitor logs metrics (return them from ``lmlab_train_batch_end`` on logging steps), adds keys to
``summary.json`` (``lmlab_run_end``), and may act on the run through the
[RunControl][lmlab.api.monitor.RunControl] its hooks receive: skip an optimizer step, roll back to
the last checkpoint, or end the run with a [Diagnosis][lmlab.api.monitor.Diagnosis] that says what
went wrong and how to fix it. The slot is many-valued: ``[monitor] use = ["grad-norm", "nan-guard"]``
with each one's options under ``[monitor.<name>]``.

Per-step hooks run in the training loop: a monitor keeps to device tensors on steps that are not
logged (a ``.item()`` is a host sync) and does nothing costly until it has something to report.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmlab.api.plugin import Plugin

if TYPE_CHECKING:
    from lmlab.api.run import RunSettings

#: The failure kinds the core and the first-party monitors diagnose; a plugin may use others.
FAILURE_KINDS = ("out-of-memory", "collective-timeout", "non-finite", "hang", "error")


@dataclass(frozen=True)
class Fix:
    """One change that would address a failure: a manifest key and the value to set, or (when
    ``key`` is None) something to do outside the manifest (an environment variable, a command)."""

    text: str
    """What to do and why, in one sentence (``"recompute each block in backward: saves 310 MB"``)."""
    key: str | None = None
    """The dotted manifest key to change (``"train.batch_size"``), or None."""
    value: Any = None
    """The value to set it to (``--set key=value`` form when printed)."""
    also: dict[str, Any] = field(default_factory=dict)
    """Further keys to set together with ``key`` (API 1.16): a fix that is only right as a whole, such
    as a smaller ``train.batch_size`` with the ``train.grad_accum`` that keeps the batch per step, or
    ``parallel.use`` with the plugin's own option (``parallel.stage``). Printed as one ``--set`` each."""

    def as_dict(self) -> dict:
        """The fix as ``summary.json`` records it: ``{"text", "key", "value"}``, and ``"also"`` when
        it sets more than one key."""
        record = {"text": self.text, "key": self.key, "value": self.value}
        return {**record, "also": dict(self.also)} if self.also else record


@dataclass
class Diagnosis:
    """Why a run failed, as ``summary.json`` records it under ``diagnosis`` and ``lmlab doctor``
    prints it."""

    kind: str
    """One of [FAILURE_KINDS][lmlab.api.monitor.FAILURE_KINDS] (or a plugin's own)."""
    cause: str
    """The cause in one sentence."""
    evidence: list[str] = field(default_factory=list)
    """What was observed that points to it (the module that went non-finite first, the late rank,
    the stack a hung thread was in), one line each."""
    fixes: list[Fix] = field(default_factory=list)
    """Changes that would address it, the likeliest first."""

    def as_dict(self) -> dict:
        """The diagnosis as ``summary.json`` records it (JSON values only)."""
        return {"kind": self.kind, "cause": self.cause, "evidence": list(self.evidence),
                "fixes": [f.as_dict() for f in self.fixes]}

    @classmethod
    def from_dict(cls, data: dict) -> "Diagnosis":
        """The diagnosis that [as_dict][lmlab.api.monitor.Diagnosis.as_dict] wrote (a run's summary)."""
        return cls(kind=data["kind"], cause=data["cause"], evidence=list(data.get("evidence", [])),
                   fixes=[Fix(**f) for f in data.get("fixes", [])])


class RunFailed(RuntimeError):
    """Raised by a hook (or the core) to end the run as failed with ``diagnosis``: the summary's
    status is ``failed``, its ``diagnosis`` this one, and ``lmlab run`` exits 1."""

    def __init__(self, diagnosis: Diagnosis):
        super().__init__(diagnosis.cause)
        self.diagnosis = diagnosis


@dataclass
class StepTiming:
    """Wall-clock times of one optimizer step, measured by the core, for ``lmlab_train_batch_end``."""

    step_s: float
    """From the end of the previous optimizer step to the end of this one."""
    data_wait_s: float
    """The part of ``step_s`` spent outside the training step: waiting for batches (summed over the
    step's micro-batches) and the loop's own bookkeeping."""
    tokens: int
    """Tokens this step trained on, over every process (``batch_size × grad_accum × block_size ×
    data-parallel replicas``)."""


class RunControl:
    """What a hook may do to the run it watches; one per run, the same object in every hook call.

    The core implements it; a plugin only calls it. Actions taken in ``lmlab_before_optimizer_step``
    apply to that step.
    """

    run_dir: Path
    """The variant's run folder (made by the core when training starts: a monitor that writes there
    earlier creates it)."""
    run: "RunSettings"
    """The variant, typed (API 1.20): ``control.run.train.max_steps``, ``control.run.uses("parallel")``."""
    manifest: dict
    """The variant's resolved manifest as nested JSON values: kept for plugins written before API
    1.20, until 2.0; read ``run`` instead."""
    is_main: bool
    """Whether this is the main (rank 0) process."""
    rank: int
    """This process's global rank (0 in a single-process run)."""

    @property
    def lr(self) -> float:
        """The learning rate of the optimizer's first param group now (after the schedule)."""
        raise NotImplementedError

    @property
    def grad_clip(self) -> float:
        """The gradient-norm clip in force (0: off), ``train.grad_clip = "auto"`` resolved."""
        raise NotImplementedError

    def skip_step(self, reason: str) -> None:
        """Leave this optimizer step out: the parameters and the optimizer's state stay as they were
        (every gradient is dropped before the step); the step counter and the schedule move on."""
        raise NotImplementedError

    def rollback(self, lr_factor: float, reason: str) -> int:
        """Restore the weights and optimizer state of the newest checkpoint and multiply every
        learning rate by ``lr_factor`` from now on; training goes on from the current step (the data
        does not rewind). Returns the checkpoint's step. With no checkpoint yet (API 1.16) the current
        weights stay, when finite (skipped steps leave them as the last good step made them), and only
        the learning rates are lowered; returns the current step. Raises
        [RunFailed][lmlab.api.monitor.RunFailed] (kind non-finite) when neither is finite, or a sharded
        layout cannot roll back."""
        raise NotImplementedError

    def locate_nonfinite(self) -> str | None:
        """Run this step's last micro-batch again, forward and backward, and return the name of the
        first module (in execution order) whose output, or else whose gradient, holds a non-finite
        value, with which (``"blocks.1.ffn (forward output)"``); None when it reruns finite. Costs
        one extra forward and backward; the step's gradients are left as they were."""
        raise NotImplementedError

    def fail(self, diagnosis: Diagnosis) -> None:
        """End the run as failed with ``diagnosis`` from any thread (a watchdog's): the main thread
        is interrupted where it waits, and the run's summary records the diagnosis."""
        raise NotImplementedError

    def note(self, text: str) -> None:
        """Print a warning line under the run's progress (main process only) and keep it for
        ``lmlab doctor`` in the run folder's ``warnings.log``."""
        raise NotImplementedError


class Monitor(Plugin):
    """Base class of the monitor slot: a plugin that acts only through hooks. Its options live under
    ``[monitor.<name>]``; override ``check`` to refuse options that cannot work with the variant."""

    slot = "monitor"

    @classmethod
    def nonfinite_recovery(cls) -> tuple[str, dict[str, Any]] | None:
        """How this monitor keeps a run going through a non-finite loss or gradient instead of letting
        it fail (API 1.18), for the fixes of a non-finite diagnosis: ``(what it does, options)``, the
        options being this plugin's own that make it do so (``("skip non-finite steps and roll back
        after repeated ones instead of failing", {"action": "skip"})``). A run that used no monitor
        declaring one is told to add the first installed one (by name), as ``--set monitor.use=[...,
        NAME]`` with ``--set monitor.NAME.OPTION=VALUE`` for each option. Default: None, the monitor
        does not recover."""
        return None
