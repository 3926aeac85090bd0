"""The callback that records a run: metrics.jsonl, the tracker, progress, hooks and checkpoints.

Everything per step is cheap: the loss is synced to the host only every ``log_every`` steps, the
progress line is redrawn at most twice a second, and checkpoints are written every
``checkpoint_every`` steps, to a temporary file inside the run folder that is read back and checked
before it replaces ``last.ckpt`` (a damaged write never costs the previous checkpoint).

A SIGTERM during training (:mod:`lmlab.signals`) ends the run at the end of the current optimizer
step, after a checkpoint of that step: the processes of a distributed run agree on it at every step,
since the save is collective under sharded strategies.
"""

import math
import os
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch

from lmlab import checkpoint, signals
from lmlab.api.monitor import StepTiming
from lmlab.collective_timeout import heartbeat, late_ranks
from lmlab.train.checkpoint_io import replace
from lmlab.rundir import MetricsLog


class Diverged(RuntimeError):
    """The loss became infinite or NaN: the run fails, and its summary says so."""


def _finite_weights(model) -> bool:
    """Whether every floating-point parameter is finite (this process's shard of a sharded one): one
    pass over the weights, cheap beside writing them."""
    checks = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()
              for p in model.parameters() if p.is_floating_point()]
    return bool(torch.stack(checks).all()) if checks else True


class RunRecorder(L.Callback):
    def __init__(self, run_dir: Path, cfg, tokens_per_step: int, tracker, hooks, resume_step=None, control=None):
        self.run_dir, self.cfg, self.tokens_per_step = run_dir, cfg, tokens_per_step
        self.control = control
        # Step timing for the hooks (StepTiming): when the last batch ended, and the time since spent
        # outside training steps (waiting for batches, the loop's bookkeeping).
        self._batch_end = self._step_end = 0.0
        self._wait = 0.0
        self._heartbeat = False
        self.ranks_at_failure = None  # late_ranks() when training failed (multi-process runs)
        self.tracker, self.hooks = tracker, hooks
        self.resume_step = resume_step
        self.ckpt_dir = run_dir / "checkpoints"
        self.best_val_loss = math.inf
        self.throughput: list[float] = []
        self.train_loss: float | None = None
        self.metrics: MetricsLog | None = None
        self._window_start = self._last_draw = 0.0
        self._window_step = 0
        self.first_step_s: float | None = None  # wall time of the first step (includes compilation)
        self._tty = sys.stderr.isatty()
        self._started = time.monotonic()
        self._tmp_tag = str(os.getpid())  # the main process's, so that every rank names one file
        self.processes: int | None = None  # distinct processes that trained

    # Lightning saves and restores this with the checkpoint.
    def state_dict(self) -> dict:
        return {"best_val_loss": self.best_val_loss}

    def load_state_dict(self, state: dict) -> None:
        self.best_val_loss = state.get("best_val_loss", math.inf)

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", keep_until_step=self.resume_step)
        self._window_start, self._window_step = time.perf_counter(), trainer.global_step
        self._batch_end = self._step_end = self._train_start = self._window_start
        self._seen_step = trainer.global_step
        self._heartbeat = trainer.world_size > 1
        self._tmp_tag = trainer.strategy.broadcast(self._tmp_tag)
        # How many processes really took part (a collective every one of them joins), for the summary:
        # a parallel run that quietly trained on one process must not pass for a parallel one.
        pid = torch.tensor([os.getpid()], device=trainer.strategy.root_device)
        self.processes = len(set(trainer.strategy.all_gather(pid).flatten().tolist()))
        # Lightning has registered its SIGTERM handler by now, which would stop the loop without a
        # checkpoint (and in the middle of an accumulation): note the signal, stop at a step's end.
        signals.defer()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._wait += time.perf_counter() - self._batch_end
        if self._heartbeat:  # which step each rank reached, for naming a late one if a collective times out
            heartbeat(self.run_dir, trainer.global_rank, trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = self._batch_end = time.perf_counter()
        step = trainer.global_step
        if step == self._seen_step:
            return  # still accumulating: no optimizer step happened
        self._seen_step = step
        if self.first_step_s is None:
            self.first_step_s = now - self._window_start
        log = step % self.cfg.log_every == 0 or step == trainer.max_steps
        extra = {}
        if self.hooks.has("lmlab_train_batch_end"):
            timing = StepTiming(step_s=now - self._step_end, data_wait_s=self._wait,
                                tokens=self.tokens_per_step * trainer.world_size)
            extra = self.hooks.collect("lmlab_train_batch_end", step=step, loss=pl_module.last_loss,
                                       model=pl_module.model, log=log, timing=timing, control=self.control)
        self._step_end, self._wait = now, 0.0
        if log:
            self._log_train(trainer, pl_module, step, extra)
        elif extra and trainer.is_global_zero:
            self._emit({"step": step, **extra})
        stop = self._termination_requested(trainer)
        if step % self.cfg.checkpoint_every == 0 or step == trainer.max_steps or stop:
            self.save_last(trainer)
            self._batch_end = self._step_end = time.perf_counter()  # writing it is no step's data wait
        if stop:
            if trainer.is_global_zero:
                self._say(f"SIGTERM: stopped after step {step}, its checkpoint written; running the same command "
                          "again resumes from it")
            # Raised here rather than by setting should_stop, which would run an evaluation first.
            raise signals.Terminated()
        self._draw(trainer, step)

    def _termination_requested(self, trainer) -> bool:
        asked = signals.received()
        if trainer.world_size > 1:  # every process stops at the same step, or the collective save hangs
            flag = torch.tensor(float(asked), device=trainer.strategy.root_device)
            asked = bool(trainer.strategy.reduce(flag, reduce_op="sum").item() > 0)
        return asked

    def _log_train(self, trainer, pl_module, step: int, extra: dict) -> None:
        now = time.perf_counter()
        steps = step - self._window_step
        tokens_per_s = steps * self.tokens_per_step * trainer.world_size / max(now - self._window_start, 1e-9)
        self._window_start, self._window_step = now, step
        self.throughput.append(tokens_per_s)
        loss, scored = pl_module.last_loss, getattr(pl_module, "last_scored", None)
        # Every rank reaches these collectives at the same step, so they cannot deadlock.
        if scored is None:
            if trainer.world_size > 1:  # the loss of the whole global batch, as one device would report it
                loss = trainer.strategy.reduce(loss, reduce_op="mean")
            value, scored = loss.item(), 1  # the one host sync per log interval
        else:
            if trainer.world_size > 1:  # weighted by the micro-batches each rank scored
                both = trainer.strategy.reduce(torch.stack([loss.float() * scored, scored.float()]), reduce_op="sum")
                loss, scored = both[0] / both[1].clamp(min=1), both[1]
            value, scored = torch.stack([loss.float(), scored.float()]).tolist()  # the one host sync
        if scored == 0:
            # Nothing in this step's batch was scored (every preference pair too long for a row, say):
            # its loss is a stand-in, not a point of the curve nor the summary's train_loss.
            value = None
        else:
            self.train_loss = value
        reports = {}
        if pl_module.train_reports:  # Objective.report's figures over the interval, every process together
            from lmlab.train.module import reduce_reports

            reports = {f"train_{k}": v for k, v in reduce_reports(pl_module.train_reports, trainer.strategy,
                                                                  loss.device).items()}
        skipped = self.control is not None and self.control.last_skipped == step
        if value is not None and not math.isfinite(value) and self.cfg.precision != "16-mixed" and not skipped:
            # Under 16-mixed an overflowing step is skipped by the loss scaler and training goes on.
            raise Diverged(f"the training loss is {value} at step {step}: training diverged (lower "
                           "optimizer.lr, or set train.grad_clip)")
        if trainer.is_global_zero:
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            # elapsed_s: this process's training time at the step (a slope over these is a step's
            # cost free of start-up, which bench/train_speed.py reads).
            record = {"step": step, **({"train_loss": value} if value is not None else {}), "lr": lr,
                      "tokens_per_s": tokens_per_s, "elapsed_s": round(now - self._train_start, 5)}
            if skipped:  # a monitor left this step out (its loss was not finite): the weights did not change
                record["skipped"] = True
            if pl_module.last_aux is not None:
                record["aux_loss"] = pl_module.last_aux.item()
            self._emit({**record, **reports, **extra})

    def on_exception(self, trainer, pl_module, exception) -> None:
        # Lightning calls this before it tears the process group down, which can wait for the late
        # rank to arrive: which ranks had reached which step is read now, not after.
        if self._heartbeat:
            self.ranks_at_failure = late_ranks(self.run_dir)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or pl_module.val_loss is None or trainer.state.fn != "fit":
            return
        step, val_loss = trainer.global_step, pl_module.val_loss
        self._batch_end = self._step_end = time.perf_counter()  # the evaluation is no step's time
        metrics = {"step": step, "val_loss": val_loss,
                   **{f"val_{k}": v for k, v in getattr(pl_module, "val_reports", {}).items()}}
        self.hooks.call("lmlab_validation_end", step=step, metrics=dict(metrics))
        if trainer.is_global_zero:
            self._emit(metrics)
            train = f" | train_loss {self.train_loss:.4f}" if self.train_loss is not None else ""
            rate = f" | {self.throughput[-1]:,.0f} tokens/s" if self.throughput else ""
            self._say(f"step {step}/{trainer.max_steps}{train} | val_loss {val_loss:.4f}{rate}")
        if val_loss < self.best_val_loss:
            self.best_val_loss = val_loss
            self._save(trainer, "best.ckpt")

    def final_validation(self, trainer, val_loss: float, reports: dict | None = None) -> None:
        """The closing evaluation over the whole validation split goes into metrics.jsonl as well,
        marked ``final``, so the file alone holds every number ``summary.json`` reports from it."""
        if trainer.is_global_zero and self.metrics is not None:
            self.metrics.write({"step": trainer.global_step, "val_loss": val_loss,
                                **{f"val_{k}": v for k, v in (reports or {}).items()}, "final": True})

    def save_last(self, trainer) -> None:
        if not _finite_weights(trainer.lightning_module.model):
            # Never a checkpoint of a non-finite state: it would replace the last good one.
            raise Diverged(f"the weights hold non-finite values at step {trainer.global_step}: training diverged "
                           "(lower optimizer.lr, or set train.grad_clip); the last checkpoint is kept")
        self._save(trainer, "last.ckpt")
        peft = getattr(trainer.lightning_module, "peft", None)
        if peft is not None and trainer.is_global_zero:  # the adapter on its own, beside the checkpoint
            peft.write_adapter(self.ckpt_dir, trainer.global_step)

    def _save(self, trainer, name: str) -> None:
        # Every rank calls save_checkpoint (sharded strategies write from all of them); the main
        # process checks the finished file and renames it into place, which is atomic on POSIX.
        path = self.ckpt_dir / name
        tmp = self.ckpt_dir / f".{name}.{self._tmp_tag}.tmp"
        trainer.save_checkpoint(tmp, weights_only=False)  # full state: resumable
        if trainer.is_global_zero:
            problem = checkpoint.problem(tmp)
            if problem is not None:
                tmp.unlink(missing_ok=True)
                raise OSError(f"the checkpoint just written to {tmp} does not read back ({problem}); the previous "
                              f"{name} is kept")
            replace(tmp, path)
            self.hooks.call("lmlab_checkpoint_saved", path=str(path), step=trainer.global_step)
        trainer.strategy.barrier("lmlab-checkpoint")

    def _emit(self, record: dict) -> None:
        self.metrics.write(record)
        if self.tracker is not None:
            self.tracker.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def _draw(self, trainer, step: int) -> None:
        if not (self._tty and trainer.is_global_zero):
            return
        now = time.monotonic()
        if now - self._last_draw < 0.5 and step != trainer.max_steps:
            return
        self._last_draw = now
        rate = self.throughput[-1] if self.throughput else 0.0
        loss = f"{self.train_loss:.4f}" if self.train_loss is not None else "-"
        done = step / trainer.max_steps
        eta = (now - self._started) * (1 - done) / max(done, 1e-9)
        bar = "#" * int(24 * done)
        sys.stderr.write(f"\r[{bar:<24}] {step}/{trainer.max_steps} loss {loss} "
                         f"{rate / 1000:.1f}k tok/s eta {eta:4.0f}s ")
        sys.stderr.flush()

    def _say(self, text: str) -> None:
        if self._tty:
            sys.stderr.write("\r\033[K")
        print(text, file=sys.stderr, flush=True)

    def median_tokens_per_s(self) -> float | None:
        # The first window includes start-up (and compilation): leave it out when there are others.
        values = self.throughput[1:] or self.throughput
        return statistics.median(values) if values else None

    def close(self) -> None:
        if self._tty:
            sys.stderr.write("\n")
        if self.metrics is not None:
            self.metrics.close()
