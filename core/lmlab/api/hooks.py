"""Lifecycle hooks (pluggy) that any loaded plugin may implement.

Decorate a method of your plugin class with ``@hookimpl`` and name it after one of the specs below;
it may take any subset of the spec's arguments. Signatures are checked when the plugin is loaded.
All hooks run on every process of a distributed run unless they say otherwise.
"""

from typing import Any

import pluggy

PROJECT = "lmlab"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class LifecycleSpec:
    @hookspec
    def lmlab_model_built(self, model: Any, manifest: dict) -> None:
        """Called once per variant after the model is assembled and initialised, before training
        (and before ``torch.compile``). May modify the model in place."""

    @hookspec
    def lmlab_before_optimizer_step(self, step: int, model: Any, optimizer: Any) -> dict | None:
        """Called before each optimizer step, after gradients are final (accumulated, unscaled).
        May return metrics to log at this step (e.g. a gradient norm)."""

    @hookspec
    def lmlab_train_batch_end(self, step: int, loss: Any, model: Any, log: bool) -> dict | None:
        """Called after each optimizer step with the step's loss tensor (not synced to the host:
        calling ``.item()`` here costs a device sync). ``log`` is True on the steps whose metrics
        are written (every ``[train] log_every``): return metrics (floats) then, and None on the
        others, to keep the host syncs to logging steps. (``log``: API 1.1.)"""

    @hookspec
    def lmlab_validation_end(self, step: int, metrics: dict) -> None:
        """Called after each evaluation with its metrics (``val_loss``, ...)."""

    @hookspec
    def lmlab_checkpoint_saved(self, path: str, step: int) -> None:
        """Called on the main process after a checkpoint is completely written."""

    @hookspec
    def lmlab_fit_end(self, summary: dict) -> None:
        """Called on the main process once the variant's ``summary.json`` is written."""
