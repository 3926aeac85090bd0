"""Weights & Biases tracking, offline unless asked otherwise.

Each variant is one W&B run: its group is the manifest's name (so a sweep's variants sit together),
its name the variant's, its config the resolved manifest with dotted keys plus the version of
every plugin used. The run's files go to ``<run_dir>/wandb/``; an offline run can be uploaded
later with ``wandb sync <run_dir>/wandb/offline-run-*``.

The W&B run id is kept in ``<run_dir>/wandb/run_id`` so that ``lmlab run --resume`` continues the
same W&B run instead of starting a second one. No API key is ever read or written by this plugin:
online mode uses whatever login ``wandb`` itself finds (``wandb login`` or ``WANDB_API_KEY``).
"""

import os
import re
from typing import Any, Literal

from lmlab.api import Field, Options, RunInfo, Tracker

# Config keys that look like credentials are masked before they leave the machine.
_SECRET_KEY = re.compile(r"(api_?key|token|secret|password)$", re.IGNORECASE)


class WandbOptions(Options):
    project: str = Field("lmlab", min_length=1, help="W&B project")
    entity: str | None = Field(None, help="W&B user or team; default: the login's default entity")
    mode: Literal["offline", "online", "disabled"] | None = Field(
        None, help="offline writes files only; unset = $WANDB_MODE if set, else offline")
    tags: list[str] = Field([], help="tags attached to every run")


class WandbTracker(Tracker):
    """One W&B run per variant; several runs in one process are kept apart."""

    Options = WandbOptions

    def __init__(self, options: WandbOptions | None = None):
        super().__init__(options)
        self._run = None

    def start(self, info: RunInfo) -> None:
        import wandb  # imported here: its import is slow and `lmlab check` never tracks

        mode = self.options.mode or os.environ.get("WANDB_MODE") or "offline"
        id_file = info.run_dir / "wandb" / "run_id"
        id_file.parent.mkdir(parents=True, exist_ok=True)  # wandb.init(dir=run_dir) writes here too
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        config = {key: ("***" if _SECRET_KEY.search(key) else value) for key, value in info.flat_config.items()}
        config["plugins"] = info.plugins
        self._run = wandb.init(
            project=self.options.project, entity=self.options.entity, group=info.group, name=info.name,
            tags=list(self.options.tags), job_type="train", config=config, dir=str(info.run_dir),
            mode=mode, id=run_id, resume="allow" if run_id else None,
            # Each variant of a sweep is its own run, even when they share this process.
            reinit="create_new",
            settings=wandb.Settings(
                silent=True, console="off",  # our CLI owns the terminal; metrics.jsonl has the logs
                save_code=False, disable_code=True, disable_git=True, disable_job_creation=True),
        )
        if run_id is None and mode != "disabled":
            id_file.write_text(self._run.id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._require_run().log(metrics, step=step)

    def finish(self, summary: dict[str, Any], status: str) -> None:
        run = self._require_run()
        run.summary.update(summary)
        run.finish(exit_code=0 if status == "completed" else 1)
        self._run = None

    def _require_run(self):
        if self._run is None:
            raise RuntimeError("the wandb tracker was used before start() or after finish()")
        return self._run
