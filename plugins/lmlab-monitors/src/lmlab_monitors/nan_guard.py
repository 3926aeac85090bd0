"""nan-guard: a non-finite loss or gradient is caught at the step it appears, before the optimizer
applies it, and the first module whose output (or gradient) went non-finite is named.

Then, as configured: ``stop`` ends the run as failed with a ``non-finite`` diagnosis; ``skip``
leaves the step out (the weights and optimizer state stay as they were) and training goes on, and
after ``rollback_after`` bad steps in a row restores the last checkpoint with the learning rate
multiplied by ``lr_factor``, as Megatron-LM and llm-foundry do by hand (before the first checkpoint,
skipping needs none: the weights stay as the last good step left them, and only the rate is lowered). A
checkpoint is never
written from a non-finite state: skipped steps leave the weights finite, and the core refuses to
save weights that are not.

Cost: one scalar read per step (the loss and the global gradient norm the core computes anyway,
checked together on the device), a device sync on GPUs; the search for the module (a rerun of the
step's last micro-batch with hooks on every module) happens only when a step goes bad.
"""

from typing import Literal

import torch

from lmlab.api import Diagnosis, Field, Monitor, Options, RunFailed, UserError, hookimpl


class NanGuardOptions(Options):
    action: Literal["stop", "skip"] = Field(
        "stop", help="on a non-finite step: stop (the run fails, with its diagnosis) or skip the step")
    rollback_after: int = Field(
        3, ge=0, help="skip: after this many non-finite steps in a row, roll back to the last checkpoint "
                      "(0: never)")
    lr_factor: float = Field(0.5, gt=0, lt=1, help="skip: what a rollback multiplies the learning rates by")
    max_rollbacks: int = Field(3, ge=1, help="skip: roll back at most this often, then stop")
    locate: bool = Field(True, help="name the first module whose output or gradient went non-finite "
                                    "(one extra forward and backward of the bad step)")


class NanGuard(Monitor):
    """Stops, or skips and rolls back, at the first non-finite loss or gradient, naming the module."""

    Options = NanGuardOptions
    api = ">=1.20,<2"  # CheckContext.run; lmlab.api.monitor (1.7), nonfinite_recovery (1.18)

    def __init__(self, options=None):
        super().__init__(options)
        self.bad_steps = 0  # non-finite steps in the whole run
        self.in_a_row = 0
        self.rollbacks = 0
        self.first: dict | None = None  # the first bad step: {"step", "module"}

    @classmethod
    def nonfinite_recovery(cls):
        return "skip non-finite steps and roll back after repeated ones instead of failing", {"action": "skip"}

    def check(self, context) -> None:
        o = self.options
        parallel = context.plugins.get("parallel")
        if o.action == "skip" and o.rollback_after and parallel is not None and not parallel.holds_whole_state:
            raise UserError(f"rolling back restores whole weights in place, which a sharded or split model "
                            f"(parallel {parallel.name!r}) cannot; set rollback_after = 0, or action = \"stop\" and "
                            "resume", key="monitor.nan-guard.rollback_after")

    @hookimpl
    def lmlab_before_optimizer_step(self, step, grad_norm, loss, control):
        ok = torch.isfinite(loss) if loss is not None else torch.ones((), dtype=torch.bool)
        if grad_norm is not None:
            ok = ok & torch.isfinite(grad_norm.to(ok.device))
        if bool(ok):  # the one host read per step
            self.in_a_row = 0
            return None
        self._bad(step + 1, loss, grad_norm, control)
        return None

    def _bad(self, step: int, loss, grad_norm, control) -> None:
        self.bad_steps += 1
        self.in_a_row += 1
        what = _what(loss, grad_norm)
        module = control.locate_nonfinite() if self.options.locate and self.in_a_row == 1 else None
        if self.first is None:
            self.first = {"step": step, "what": what, "module": module}
        where = f", first at {module}" if module else ""
        reason = f"step {step}: {what}{where}"
        evidence = [f"step {step}: {what}"] + ([f"first non-finite: {module}"] if module else [])
        if module is None and self.options.locate and self.in_a_row == 1 and loss is not None \
                and bool(torch.isfinite(loss)):
            evidence.append("every output and gradient reruns finite: the gradients are finite but so large "
                            "that their norm overflows float32")
        if self.options.action == "stop":
            raise RunFailed(Diagnosis("non-finite", f"{what} at step {step}{where}", evidence=evidence))
        control.skip_step(reason)
        control.note(f"{reason}; the step is skipped ({self.in_a_row} in a row)")
        if self.options.rollback_after and self.in_a_row >= self.options.rollback_after:
            if self.rollbacks >= self.options.max_rollbacks:
                raise RunFailed(Diagnosis("non-finite", f"{what} at step {step} after {self.rollbacks} rollbacks",
                                          evidence=[*evidence, f"{self.bad_steps} non-finite steps in all"]))
            self.rollbacks += 1
            control.rollback(self.options.lr_factor, f"{self.in_a_row} non-finite steps in a row")
            self.in_a_row = 0

    @hookimpl
    def lmlab_run_end(self):
        out = {"nonfinite_steps": self.bad_steps}
        if self.first is not None:
            out["first_nonfinite"] = self.first
        return out


def _what(loss, grad_norm) -> str:
    loss_bad = loss is not None and not bool(torch.isfinite(loss))
    if loss_bad:
        return f"the loss is {loss.item()}"
    return f"the gradient norm is {grad_norm.item()}"
