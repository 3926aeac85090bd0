"""Running one variant end to end: tokens → model → Lightning fit → full validation → summary."""

import logging
import math
import os
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from lmlab import checkpoint, checks, objective_runs, provenance, signals
from lmlab.assemble import assemble
from lmlab.api import RunInfo
from lmlab.api.monitor import RunFailed
from lmlab.errors import UserError, warn
from lmlab.hooks import Hooks
from lmlab.train import allocator, memory
from lmlab.train.control import Control
from lmlab.train.memory import optimizer_state_bytes, state_bytes
from lmlab.train.replay import replay_corpus
from lmlab.rundir import atomic_write_bytes, write_json, write_toml
from lmlab.train.sweep import is_main_process


@dataclass
class RunResult:
    summary: dict  # as written to summary.json
    module: object  # the trained LMModule
    tokens: object  # the TokenData (tokenizer included)
    plugins: dict  # slot → plugin instance
    is_main: bool  # this process is the main (rank 0) one


def run_variant(variant, run_dir: Path, resume: bool = False, extra_hooks=(), checked=None) -> RunResult:
    """Train ``variant`` into ``run_dir``; the summary is also written to summary.json.

    ``extra_hooks``: further objects with ``@hookimpl`` methods (a notebook's probe, a benchmark).
    ``checked``: the variant's :func:`lmlab.checks.run` context when the caller checked it already.
    """
    started = time.perf_counter()
    attempt = {"recorded": False}  # whether this attempt's summary.json has been written
    control = Control(run_dir, variant, rank=_rank(), is_main=is_main_process())
    tasks = variant.eval.tasks if variant.eval is not None else []
    if tasks:  # unknown task names are refused before training, not after it
        from lmlab.harness import scores

        scores.check_tasks(scores.task_manager(tasks=tasks), tasks, key="eval.tasks")
    try:
        result = _run(variant, run_dir, resume, extra_hooks, started, attempt, checked, control)
        if tasks and result.is_main and result.summary.get("status") == "completed":
            result.summary["eval"] = _scored(variant, run_dir)
        return result
    except UserError:
        raise  # bad input, found before the run began: the message is the record, the folder untouched
    except BaseException as exc:
        failure = exc
        if control.failure is not None and not isinstance(exc, RunFailed):
            # A monitor ended the run from another thread (the watchdog), by interrupting this one.
            failure = RunFailed(control.failure)
        interrupted = isinstance(failure, (KeyboardInterrupt, SystemExit, signals.Terminated))
        if not attempt["recorded"] and is_main_process() and (run_dir.is_dir() or not interrupted):
            # Failed (or stopped) before training started, so the recorder wrote nothing: say so here.
            _write_early_summary(run_dir, failure, started, variant, attempt.get("monitors", {}))
        if failure is not exc:
            raise failure from exc
        raise


def _scored(variant, run_dir: Path) -> dict:
    """[eval]'s tasks scored on the finished run, as ``lmlab eval --tasks`` scores them: written into the
    run folder, summary.json and the tracker's record. A task that cannot be scored leaves the run
    completed, with a warning."""
    from lmlab.harness import scores
    from lmlab.trained import load_run

    o = variant.eval
    try:
        run = load_run(run_dir)
        results = scores.evaluate(run, o.tasks, num_fewshot=o.num_fewshot, limit=o.limit, batch_size=o.batch_size)
        scores.record(run_dir, results, run.plugins.get("tracker"))
    except UserError as exc:
        warn(f"{run_dir.name}: the [eval] tasks could not be scored: {exc}")
        return {}
    return scores.metrics(results)


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)) or 0)


def _run(variant, run_dir: Path, resume: bool, extra_hooks, started: float, attempt: dict,
         checked, control) -> RunResult:
    import lightning as L

    _quiet_lightning()
    memory.reset_peak()
    cfg = variant.train
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    allocator.tune_for_training()
    L.seed_everything(variant.seed, verbose=False)
    # What the manifest alone tells is wrong, before the data is read (done already by `lmlab run`).
    checked = checked if checked is not None else checks.run(variant)
    hooks = Hooks([*_instances(checked.plugins), *extra_hooks])
    hooks.call("lmlab_run_start", control=control)
    try:
        return _train(variant, run_dir, resume, started, attempt, checked, control, hooks)
    except BaseException as exc:
        if not attempt["recorded"]:  # failed before the summary was written: the monitors stop here
            status = "interrupted" if isinstance(exc, (KeyboardInterrupt, SystemExit, signals.Terminated)) \
                and control.failure is None else "failed"
            attempt["monitors"] = _run_end(hooks, status, control)  # for the early summary
        raise


def _instances(plugins: dict) -> list:
    return [p for value in plugins.values() for p in (value if isinstance(value, list) else [value])]


def _run_end(hooks, status: str, control) -> dict:
    # A monitor failing to close must not hide why the run ended, nor lose the others' figures.
    return hooks.collect_each("lmlab_run_end", lambda text: print(f"warning: {text}", file=sys.stderr),
                              status=status, control=control)


def _train(variant, run_dir: Path, resume: bool, started: float, attempt: dict, checked, control,
           hooks) -> RunResult:
    from lmlab.train.checkpoint_io import RunFolderCheckpointIO
    from lmlab.train.data_module import TokenDataModule
    from lmlab.train.module import LMModule
    from lmlab.train.recorder import RunRecorder

    cfg = variant.train
    # The newest readable checkpoint (a damaged last.ckpt falls back to best.ckpt, with a warning).
    ckpt_path = checkpoint.resume_point(run_dir) if resume else None
    # The plugins, the corpus and the tokenizer fitted on it, the vocabulary (the objective's special
    # tokens may grow it past the tokenizer's: mlm's [MASK]), the shape, and the model with its [init]
    # weights and adapter; a resumed run continues from its own checkpoint (Lightning loads it below).
    built = assemble(variant, data=True, plugins=dict(checked.plugins), train_dir=run_dir,
                     resuming=ckpt_path is not None)
    plugins, tokens, shape, model, init, peft = (built.plugins, built.tokens, built.shape, built.model, built.init,
                                                 built.adapter)
    for plugin in _instances(plugins):  # any the assembly added
        hooks.register(plugin)
    hooks.call("lmlab_model_built", model=model, manifest=variant.manifest, run=variant)
    model.set_checkpointing(cfg.checkpointing)
    # Other runs the objective works with (a frozen reference, a reward model, a teacher), loaded once.
    companions = objective_runs.prepare(variant, plugins["objective"], tokens.tokenizer, plugins.get("decoding"))

    resolved = {**variant.manifest, "model": {**variant.manifest["model"], "vocab_size": shape.vocab_size}}
    if plugins["objective"].needs_runs:
        resolved["objective"] = {**variant.manifest["objective"],
                                 **objective_runs.resolved(variant, plugins["objective"])}
    resume_step = checkpoint.step_of(ckpt_path) if ckpt_path else None
    used = provenance.plugins(variant)
    environment = provenance.environment()

    parallel = plugins["parallel"].trainer_kwargs()
    chosen = plugins["parallel"].resolved()  # API 1.15: what it chose for this machine
    if chosen:
        used["parallel"] = {**used["parallel"], "resolved": chosen}
    tracker = plugins["tracker"]
    datamodule = TokenDataModule(tokens, shape.block_size, cfg.batch_size, cfg.eval_batch_size, cfg.eval_steps,
                                 variant.seed, cfg.grad_accum, objective=plugins["objective"],
                                 replay=replay_corpus(variant, plugins.get("order")),
                                 order=plugins.get("order"))
    for split, (long, total) in datamodule.too_long.items():
        if long:
            control.note(f"{long:,} of the {total:,} {split} documents ({long / total:.0%}) are longer than "
                         f"model.block_size = {shape.block_size} tokens; objective {plugins['objective'].name!r} "
                         "leaves them out of the loss (raise model.block_size to keep them)")
    module = LMModule(model, plugins["objective"], plugins["optimizer"], cfg, hooks, compile=cfg.compile,
                      parallel=plugins["parallel"], peft=peft, control=control, lr_factor=variant.lr_factor)
    module.companions = companions
    control.module = module
    recorder = RunRecorder(run_dir, cfg, cfg.batch_size * cfg.grad_accum * shape.block_size,
                           None, hooks, resume_step=resume_step, control=control)
    trainer = _trainer(cfg, variant.grad_clip, run_dir, recorder, parallel, plugins["parallel"].trainer_precision(cfg))
    trainer.strategy.checkpoint_io = RunFolderCheckpointIO()  # staged in the run folder, not in $TMPDIR
    main = trainer.is_global_zero
    control.rank, control.is_main = trainer.global_rank, main
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_toml(run_dir / "manifest.toml", resolved)
        write_json(run_dir / "provenance.json", {"plugins": used, "environment": environment,
                                                  "manifest": variant.manifest,
                                                  **({"init": init} if init else {})})
        (run_dir / "error.log").unlink(missing_ok=True)  # from an earlier, failed attempt
        (run_dir / "tokenizer").mkdir(exist_ok=True)
        tokens.tokenizer.save(run_dir / "tokenizer")
        recorder.tracker = tracker
        tracker.start(RunInfo(run_dir=run_dir, group=variant.experiment, name=variant.name,
                              config=resolved, flat_config=variant.tracker_config(resolved),
                              plugins=used, resume=ckpt_path is not None, variant=variant.group,
                              environment=environment))
    if peft is not None:  # the frozen base, once per run, before any checkpoint refers to it
        peft.write_base(run_dir / "checkpoints", main)
    summary = {"status": "failed", "steps": resume_step or 0}
    plain = None
    try:
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        except SystemExit as exc:
            # Lightning turns Ctrl-C into sys.exit(1), and a SIGTERM that came before training started
            # into its SIGTERMException: give each its own exit status again.
            if signals.received():
                raise signals.Terminated() from exc
            if isinstance(exc.__context__, KeyboardInterrupt):
                raise KeyboardInterrupt from exc
            raise
        if trainer.interrupted:
            raise KeyboardInterrupt
        datamodule.full_validation = True
        trainer.limit_val_batches = 1.0
        trainer.validate(module, datamodule=datamodule, verbose=False, weights_only=True)
        recorder.final_validation(trainer, module.val_loss, module.val_reports)
        summary = _completed(trainer, module, recorder, compiled=cfg.compile)
        # Sharded or split by the parallel plugin: give the main process a plain copy (the closing
        # sample runs there alone, and a sharded forward would wait for the others forever; the
        # parameter count is the whole model's, not one shard's). Every process takes part.
        plain = _gathered(trainer, module, built.build_model, main)
    except (KeyboardInterrupt, SystemExit, signals.Terminated) as exc:
        if control.failure is None:
            summary = {"status": "interrupted", "steps": trainer.global_step, "signal": _signal_name(exc)}
            raise
        failure = RunFailed(control.failure)  # a monitor's thread ended the run by interrupting this one
        summary = _failed(failure, variant, run_dir, trainer, module, main)
        raise failure from exc
    except Exception as exc:
        summary = _failed(exc, variant, run_dir, trainer, module, main, recorder.ranks_at_failure)
        raise
    finally:
        recorder.close()
        summary.update({k: v for k, v in _run_end(hooks, summary["status"], control).items() if k not in summary})
        if control.skipped_steps:
            summary["skipped_steps"] = control.skipped_steps
        if control.rollbacks:
            summary["rollbacks"] = control.rollbacks
        counted = plain if plain is not None else model
        # A memory monitor resets the process's peak counters per window; its own running peak covers the run.
        monitored = summary.get("device_mem_peak_mb" if memory.on_cuda() else "host_rss_peak_mb") or 0.0
        summary.update(wall_s=time.perf_counter() - started, params=counted.num_params(),
                       trainable_params=counted.num_params(trainable_only=True),
                       peak_mem_mb=max(memory.peak_mb(), monitored),
                       plugins=used, environment=environment, **tokens.report(), **({"init": init} if init else {}))
        if main:
            write_json(run_dir / "summary.json", summary)
            attempt["recorded"] = True
            tracker.finish(summary, summary["status"])
    if plain is not None:
        module.model = plain
    if main:
        hooks.call("lmlab_fit_end", summary=summary)
    return RunResult(summary, module, tokens, plugins, main)


def _failed(exc: BaseException, variant, run_dir: Path, trainer, module, main: bool, late=None) -> dict:
    """The summary of a run that failed in training, with its diagnosis; error.log gets the traceback."""
    from lmlab.diagnose import diagnose

    facts = {"step": trainer.global_step, "device": str(trainer.strategy.root_device), "late_ranks": late,
             "activation_bytes": module.activation_bytes, "lr": module.control.lr if module.control else None}
    diagnosis = diagnose(exc, variant, run_dir, facts)
    if main:
        atomic_write_bytes(run_dir / "error.log", traceback.format_exc().encode())
    return {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "steps": trainer.global_step,
            "diagnosis": diagnosis.as_dict()}


def _trainer(cfg, grad_clip: float, run_dir: Path, recorder, parallel: dict, precision: dict):
    import lightning as L

    # Lightning's own logger, checkpointing, progress bar and summary are off: the recorder does
    # those jobs, cheaply per step and into the run folder's format.
    return L.Trainer(
        max_steps=cfg.max_steps, accumulate_grad_batches=cfg.grad_accum,
        gradient_clip_val=grad_clip or None, val_check_interval=cfg.eval_every * cfg.grad_accum,
        check_val_every_n_epoch=None, limit_val_batches=cfg.eval_steps, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(run_dir), callbacks=[recorder], **precision, **parallel)


def _gathered(trainer, module, rebuild, main: bool):
    """None when the model is whole in every process; otherwise (``Parallel.configure_model`` sharded
    or split it) every process takes part in gathering the full weights through the strategy, and
    the main one gets them in a fresh single-device model (what ``lmlab generate`` would load)."""
    if not module._parallelised:
        return None
    device = next(module.model.parameters()).device
    state = trainer.strategy.lightning_module_state_dict()  # a collective: the full state on rank 0
    if not main:
        return None
    plain = rebuild()
    plain.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
    return plain.to(device)


def _completed(trainer, module, recorder, compiled: bool) -> dict:
    from lmlab.train.recorder import Diverged

    if not math.isfinite(module.val_loss):
        raise Diverged(f"the validation loss is {module.val_loss} after {trainer.global_step} steps: training "
                       "diverged (lower optimizer.lr, or set train.grad_clip)")
    summary = {
        "status": "completed", "val_loss": module.val_loss,
        # A perplexity only where the loss is a cross-entropy: not for an objective that runs the model
        # itself (a reward model's pairwise loss, PPO's negative reward).
        "val_ppl": None if module.objective.runs_model() else math.exp(min(module.val_loss, 50.0)),
        "best_val_loss": min(recorder.best_val_loss, module.val_loss), "train_loss": recorder.train_loss,
        "tokens_per_s": recorder.median_tokens_per_s(), "steps": trainer.global_step,
        "world_size": trainer.world_size, "processes": recorder.processes,
        "first_step_s": recorder.first_step_s,
        "activation_mb": (module.activation_bytes or 0) / 2**20,
        "state_mb": state_bytes(module.model, trainer.optimizers) / 2**20,
        "optimizer_state_bytes": optimizer_state_bytes(trainer.optimizers),
    }
    # Objective.report's figures of the closing evaluation (a reward model's val_accuracy, DPO's margins).
    summary.update({f"val_{name}": value for name, value in module.val_reports.items()})
    if module.val_extra_losses is not None:  # each extra head's loss on the same split (model.extra_heads)
        model = module.model
        summary[f"val_{model.extra_losses_name}"] = dict(zip(model.extra_heads, module.val_extra_losses))
    if module.peft is not None:  # the adapter alone, as written to checkpoints/adapter.safetensors
        summary["adapter_bytes"] = module.peft.adapter_bytes
    if compiled and recorder.first_step_s is not None and summary["tokens_per_s"]:
        # Compilation happens inside the first step; what it took beyond a steady step is its cost.
        steady = recorder.tokens_per_step * trainer.world_size / summary["tokens_per_s"]
        summary["compile_s"] = max(0.0, recorder.first_step_s - steady)
    return summary


def _quiet_lightning() -> None:
    # Lightning's start-up banners (GPU available, tips) and deprecation chatter bury our own
    # output; LMLAB_VERBOSE=1 brings them back.
    if os.environ.get("LMLAB_VERBOSE"):
        return
    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")



def _write_early_summary(run_dir: Path, exc: BaseException, started: float, variant=None,
                         monitors: dict | None = None) -> None:
    from lmlab.diagnose import diagnose

    run_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(exc, (KeyboardInterrupt, SystemExit, signals.Terminated)):
        summary = {"status": "interrupted", "steps": 0, "signal": _signal_name(exc)}
    else:
        summary = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "steps": 0,
                   "diagnosis": diagnose(exc, variant, run_dir, {"stage": "before training"}).as_dict()}
        atomic_write_bytes(run_dir / "error.log", traceback.format_exc().encode())
    write_json(run_dir / "summary.json", {**(monitors or {}), **summary, "wall_s": time.perf_counter() - started})


def _signal_name(exc: BaseException) -> str | None:
    return {KeyboardInterrupt: "SIGINT", signals.Terminated: "SIGTERM"}.get(type(exc))



