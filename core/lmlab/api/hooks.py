"""Lifecycle hooks (pluggy) that any loaded plugin may implement.

Decorate a method of your plugin class with ``@hookimpl`` and name it after one of the specs below;
it may take any subset of the spec's arguments. Signatures are checked when the plugin is loaded.
All hooks run on every process of a distributed run unless they say otherwise.
"""

from typing import Any

import pluggy

PROJECT = "lmlab"
"""The pluggy project name that lmlab's hook markers and plugin manager share."""
hookspec = pluggy.HookspecMarker(PROJECT)
"""pluggy's marker of lmlab's hook specifications (those of
[LifecycleSpec][lmlab.api.hooks.LifecycleSpec]); plugins do not need it."""
hookimpl = pluggy.HookimplMarker(PROJECT)
"""The decorator that marks a plugin method as a hook implementation: ``@hookimpl`` above
``def lmlab_train_batch_end(self, step, loss, log): ...``."""


class LifecycleSpec:
    """The hooks a plugin of any slot may implement, by name, with any subset of the arguments.

    Every instance of the run's plugins is registered (all slots, every plugin of a many-valued
    slot); a hook nobody implements costs nothing per step. Metrics returned by several
    implementations are merged into one dict.
    """

    @hookspec
    def lmlab_run_start(self, control: Any) -> None:
        """Called once per variant in every process when its run begins: after the checks, before
        the data is read and the model is built (API 1.7). A monitor that watches the whole run (a
        watchdog) starts here.

        Args:
            control: The run's [RunControl][lmlab.api.monitor.RunControl].
        """

    @hookspec
    def lmlab_model_built(self, model: Any, manifest: dict, run: Any) -> None:
        """Called once per variant in every process after the model is assembled, initialised, given
        its starting weights (``[init]``) and its PEFT adapter, before training (and before
        ``torch.compile`` and any sharding by the parallel plugin). May modify the model in place.

        Args:
            model: The assembled language model, on the CPU, in training mode.
            manifest: The variant's resolved manifest, as nested JSON values (read ``run`` instead).
            run: The variant, typed: a [RunSettings][lmlab.api.run.RunSettings] (API 1.20).
        """

    @hookspec
    def lmlab_before_optimizer_step(self, step: int, model: Any, optimizer: Any, grad_norm: Any,
                                    loss: Any, control: Any) -> dict | None:
        """Called in every process before each optimizer step, after gradients are final
        (accumulated, unscaled) and before they are clipped.

        What it returns is not logged: the core discards it (log from ``lmlab_train_batch_end``).

        Args:
            step: Optimizer steps completed so far (0 before the first).
            model: The language model (its parameters hold the gradients).
            optimizer: The optimizer about to step.
            grad_norm: 0-dim float32 tensor on the device, the global L2 norm of every gradient
                before clipping, computed once by the core (clipping reuses it); None where the
                gradients are not the parameters' own (DeepSpeed keeps them in its engine). API 1.7.
            loss: 0-dim tensor, the step's loss (as ``lmlab_train_batch_end`` gets it). API 1.7.
            control: The run's [RunControl][lmlab.api.monitor.RunControl]: ``skip_step`` here leaves
                this step out. API 1.7.
        """

    @hookspec
    def lmlab_train_batch_end(self, step: int, loss: Any, model: Any, log: bool, timing: Any,
                              control: Any) -> dict | None:
        """Called after each optimizer step with the step's loss tensor (not synced to the host:
        calling ``.item()`` here costs a device sync). ``log`` is True on the steps whose metrics
        are written (every ``[train] log_every``): return metrics (floats) then, and None on the
        others, to keep the host syncs to logging steps. (``log``: API 1.1.)

        Called in every process; the metrics the main process returns go to ``metrics.jsonl`` and
        the tracker, those of other processes nowhere.

        Args:
            step: Optimizer steps completed (1 after the first).
            loss: 0-dim tensor, this process's loss of the step (the mean over its micro-batches).
            model: The language model.
            log: Whether this step's metrics are written.
            timing: The step's [StepTiming][lmlab.api.monitor.StepTiming] (API 1.7).
            control: The run's [RunControl][lmlab.api.monitor.RunControl] (API 1.7).
        """

    @hookspec
    def lmlab_validation_end(self, step: int, metrics: dict) -> None:
        """Called in every process after each evaluation during training (not after the closing
        evaluation over the whole validation split), with its metrics: ``{"step": ...,
        "val_loss": ...}``."""

    @hookspec
    def lmlab_checkpoint_saved(self, path: str, step: int) -> None:
        """Called on the main process after a checkpoint (``last.ckpt`` or ``best.ckpt``) is
        completely written and in place, with its path and step."""

    @hookspec
    def lmlab_run_end(self, status: str, control: Any) -> dict | None:
        """Called once per variant in every process when its run ends, whether ``completed``,
        ``failed`` or ``interrupted`` (``status``), before ``summary.json`` is written (API 1.7).
        Stop what ``lmlab_run_start`` started here. What the main process returns (JSON values) is
        added to the summary; keys the core writes itself are not overwritten.

        Args:
            status: How the run ended.
            control: The run's [RunControl][lmlab.api.monitor.RunControl].
        """

    @hookspec
    def lmlab_fit_end(self, summary: dict) -> None:
        """Called on the main process once the variant's run has completed and its ``summary.json``
        is written, with what that holds (not for a failed or interrupted run)."""
