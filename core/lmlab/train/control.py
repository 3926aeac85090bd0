"""The run's RunControl (``lmlab.api.monitor``): what monitors may do to a run, carried out on the
LightningModule and its trainer."""

import _thread
import math
import signal
import sys
import threading
from pathlib import Path

import torch

from lmlab.api.monitor import Diagnosis, Fix, RunControl, RunFailed
from lmlab.diagnose import nonfinite_fixes


class Control(RunControl):
    def __init__(self, run_dir: Path, run, rank: int = 0, is_main: bool = True):
        self.run_dir, self.run, self.rank, self.is_main = run_dir, run, rank, is_main
        self.manifest = run.manifest  # API < 1.20
        self._grad_clip = run.grad_clip
        self.module = None  # the LMModule, once the run has one
        self.failure: Diagnosis | None = None  # set by fail(): the run ends failed with it
        self.skipping = False  # this step is to be left out
        self.skipped_steps = 0
        self.last_skipped: int | None = None  # the optimizer step (1-based) most recently left out
        self.rollbacks: list[dict] = []
        self._lock = threading.Lock()

    @property
    def lr(self) -> float:
        trainer = self._trainer()
        return float(trainer.optimizers[0].param_groups[0]["lr"]) if trainer and trainer.optimizers else math.nan

    @property
    def grad_clip(self) -> float:
        return self._grad_clip

    def skip_step(self, reason: str) -> None:
        self.skipping = True

    def take_skip(self) -> bool:
        """Whether this step is to be skipped; resets the request for the next one."""
        skip, self.skipping = self.skipping, False
        if skip:
            self.skipped_steps += 1
            trainer = self._trainer()
            self.last_skipped = trainer.global_step + 1 if trainer is not None else None
        return skip

    def rollback(self, lr_factor: float, reason: str) -> int:
        from lmlab import checkpoint

        trainer, module = self._trainer(), self.module
        if module.parallel is not None and not module.parallel.holds_whole_state:
            raise RunFailed(Diagnosis("non-finite", f"{reason}, and parallel plugin {module.parallel.name!r} shards or "
                                      "splits the model, which cannot be rolled back in place",
                                      fixes=[Fix("stop instead, and resume from the last checkpoint with a lower "
                                                 "learning rate")]))
        ckpt_dir = self.run_dir / "checkpoints"
        for name in ("last.ckpt", "best.ckpt"):
            path = ckpt_dir / name
            if path.is_file() and checkpoint.problem(path) is None:
                state = torch.load(path, map_location="cpu", weights_only=True)
                weights = {k.removeprefix("model."): v for k, v in state["state_dict"].items()
                           if k.startswith("model.")}
                if all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point()):
                    break
        else:
            state = None
        optimizer = trainer.optimizers[0]
        if state is not None:
            module.model.load_state_dict(weights, strict=module.peft is None)
            optimizer.load_state_dict(state["optimizer_states"][0])
        elif not all(torch.isfinite(p).all() for p in module.model.parameters() if p.is_floating_point()):
            raise RunFailed(Diagnosis("non-finite", f"{reason}, and there is no finite checkpoint to roll back to "
                                      "yet", fixes=nonfinite_fixes(self.run, self.lr)))
        # else: no checkpoint yet, but the skipped steps left the weights as the last good step made
        # them, which is the newest finite state there is: it stays, and only the rate is lowered.
        # Lower the schedule's peak (LambdaLR multiplies each group's initial_lr by the factor), so the
        # lower rate holds from here on and is saved with the scheduler in later checkpoints.
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            scheduler.base_lrs = [lr * lr_factor for lr in scheduler.base_lrs]
            for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
                group["initial_lr"] = base
                group["lr"] = base * scheduler.lr_lambdas[0](scheduler.last_epoch)
        for p in module.model.parameters():
            p.grad = None
        step = int(state.get("global_step", 0)) if state is not None else trainer.global_step
        self.rollbacks.append({"at_step": trainer.global_step + 1, "to_step": step, "lr_factor": lr_factor,
                               "reason": reason})
        where = (f"rolled back to the checkpoint of step {step}" if state is not None else
                 f"no checkpoint yet: kept the weights of step {step}, which the skipped steps left as they were")
        self.note(f"step {trainer.global_step + 1}: {reason}; {where}, learning rates × {lr_factor:g} from now on")
        return step

    def locate_nonfinite(self) -> str | None:
        from lmlab.train.nonfinite import locate

        module = self.module
        if module is None or module.last_batch is None:
            return None
        trainer = self._trainer()
        context = trainer.precision_plugin.forward_context() if trainer is not None else None
        return locate(module.model, module.objective, module.last_batch, context)

    def fail(self, diagnosis: Diagnosis) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = diagnosis
        if threading.current_thread() is threading.main_thread():
            raise RunFailed(diagnosis)
        # A real SIGINT, not interrupt_main(): a signal also breaks a blocking wait (a socket read, a
        # lock) with EINTR, where the main thread then raises KeyboardInterrupt; the runner reads failure.
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        else:
            _thread.interrupt_main()

    def note(self, text: str) -> None:
        if not self.is_main:
            return
        print(f"warning: {text}", file=sys.stderr, flush=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / "warnings.log", "a") as f:
            f.write(text + "\n")

    def _trainer(self):
        module = self.module
        return getattr(module, "_trainer", None) if module is not None else None

