"""The tracker slot: where metrics go besides the run folder (W&B, ...)."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from lmlab.api.plugin import Plugin


@dataclass
class RunInfo:
    """One variant's identity, as [Tracker.start][lmlab.api.tracker.Tracker.start] receives it."""

    run_dir: Path
    """The variant's run folder (it exists; a tracker may keep files there, e.g. a remote run id)."""
    group: str
    """The manifest's name (the experiment), shared by every variant of a sweep."""
    name: str
    """The variant's name (its folder's name)."""
    config: dict[str, Any]
    """The resolved manifest, nested, as written to the run folder's ``manifest.toml``."""
    flat_config: dict[str, Any]
    """The same with dotted keys, lists joined into strings, ``None`` for keys only other variants
    of the sweep have, and ``variant``: what a tracker groups and filters runs by."""
    plugins: dict[str, Any] = field(default_factory=dict)
    """Slot → {name, distribution, version} of each plugin the variant uses."""
    resume: bool = False
    """True when this continues an interrupted run: the tracker should continue the same remote run
    (keep its id under ``run_dir``)."""
    variant: str = ""
    """The name without its seed: what a variant's seeds share (since API 1.2)."""
    environment: dict[str, Any] = field(default_factory=dict)
    """lmlab's version and git revision, torch's and Lightning's versions and the device (since
    API 1.2)."""


class Tracker(Plugin):
    """Where a run's metrics go besides the run folder's ``metrics.jsonl`` and ``summary.json``.

    Every method is called on the main process only (global rank 0 of a distributed run), in this
    order for each variant that starts training: [start][lmlab.api.tracker.Tracker.start] once,
    [log][lmlab.api.tracker.Tracker.log] as metrics come, [finish][lmlab.api.tracker.Tracker.finish]
    once, whatever the outcome. A variant that fails before its run folder is set up (bad data, a
    refused check) gets none of them. Each variant of a sweep has its own instance.
    """

    slot = "tracker"
    run_files: ClassVar[tuple[str, ...]] = ()
    """Names of the files and folders this tracker keeps in a run's folder (API 1.18), e.g. its local
    copy of the remote run. They are removed with the run's own files when a run starts over
    (``lmlab run --overwrite``, or an attempt that left no checkpoint), so that the new run is not
    mixed into the earlier attempt's remote one. Plain names only: one with a path separator or
    ``..`` is ignored. Default: none."""

    def start(self, info: RunInfo) -> None:
        """Begin tracking one variant's run.

        Called once per run attempt, after the run folder has its ``manifest.toml``,
        ``provenance.json`` and ``tokenizer/`` and before the first training step.

        Args:
            info: The variant's names, configuration, plugins and environment.
        """
        raise NotImplementedError

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record metrics of one optimizer step; the same records go to ``metrics.jsonl``.

        Called on every logging step (each ``train.log_every`` steps and the last) with
        ``train_loss`` (the step's loss, averaged over processes), ``lr``, ``tokens_per_s`` and,
        when a module reports one, ``aux_loss``; after every evaluation during training with
        ``val_loss``; and on any step where ``lmlab_train_batch_end`` hooks returned metrics, with
        those (merged into the logging step's record on logging steps).

        Args:
            metrics: Metric name → number (floats, and whatever numbers hooks return).
            step: The optimizer step (``trainer.global_step``: 1 after the first step).
        """
        raise NotImplementedError

    def finish(self, summary: dict[str, Any], status: str) -> None:
        """End tracking the run: called once after ``summary.json`` is written, also when the run
        failed or was interrupted (a tracker may record the final numbers from ``summary``).

        Args:
            summary: What ``summary.json`` holds (``status``, ``val_loss`` over the whole validation
                split when completed, ``error`` when failed, ``steps``, ``wall_s``, ...).
            status: ``"completed"``, ``"failed"`` or ``"interrupted"``.
        """

    def amend(self, run_dir: Path, values: dict[str, float]) -> None:
        """Add figures to a finished run's record (API 1.21): ``lmlab eval`` gives each task's scores,
        keyed ``eval/<task>/<metric>``, after the run ended, when [finish][lmlab.api.tracker.Tracker.finish]
        has long been called (in another process). A tracker that keeps a remote run reopens it (its
        id kept under ``run_dir``) and adds them to its summary. Called in the main process, on an
        instance with the run's options, never between start and finish. Default: nothing."""

    def closing_note(self, run_dirs: list[Path]) -> str | None:
        """Something to print once ``lmlab run`` has gone through all its variants, e.g. how to
        upload offline runs (API 1.2).

        Called once per ``lmlab run`` in the main process, whether or not every variant completed,
        on a fresh instance made from the first variant's manifest: read what the runs left in their
        folders, not state kept from [start][lmlab.api.tracker.Tracker.start].

        Args:
            run_dirs: The folders of every selected variant, skipped ones included.

        Returns:
            The text to print, or None (the default) for nothing.
        """
        return None
