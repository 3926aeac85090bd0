"""Weights & Biases tracking, offline unless asked otherwise.

Each variant is one W&B run: its group is the manifest's name (so a sweep's variants sit together),
its name the variant's, its job type the objective's plugin (``causal-lm``, ``sft``, ...), its tags
``slot:plugin`` for each slot. The config carries the resolved manifest twice, because W&B's UI
handles neither form alone well: as nested objects (``attention: {use, n_kv_heads}``, readable) and
as flat top-level ``slot.option`` keys with lists joined into strings, which the UI can filter and
group by (wandb issue 6222), where every variant of a sweep has every key, ``None`` where it does not
apply (so runs of methods with different options still group: wandb issue 9046). ``variant`` is the
name without the seed, to group seeds. Provenance rides along: ``plugins`` (distribution and version
per slot) and ``environment`` (lmlab version, git revision, torch and Lightning versions, device).

The run's files go to ``<run_dir>/wandb/``; offline runs are uploaded later with the ``wandb sync``
command printed at the end of ``lmlab run``.

The W&B run id is kept in ``<run_dir>/wandb/run_id`` so that ``lmlab run --resume`` continues the
same W&B run instead of starting a second one. No API key is ever read or written by this plugin:
online mode uses whatever login ``wandb`` itself finds (``wandb login`` or ``WANDB_API_KEY``).
"""

import os
import re
import shlex
from pathlib import Path
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
    api = ">=1.2,<2"  # RunInfo.variant and .environment, closing_note; run_files (1.18), amend (1.21) where there
    run_files = ("wandb",)  # wandb.init(dir=run_dir) and the run id file

    def __init__(self, options: WandbOptions | None = None):
        super().__init__(options)
        self._run = None

    def start(self, info: RunInfo) -> None:
        id_file = info.run_dir / "wandb" / "run_id"
        id_file.parent.mkdir(parents=True, exist_ok=True)  # wandb.init(dir=run_dir) writes here too
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        self._run = self._init(
            info.run_dir, run_id, group=info.group, name=info.name,
            tags=[*self.options.tags, *plugin_tags(info.plugins)], job_type=job_type(info.config),
            config=run_config(info))
        if run_id is None and self._mode() != "disabled":
            id_file.write_text(self._run.id)

    def amend(self, run_dir: Path, values: dict[str, float]) -> None:
        """The run reopened by its id (an offline run gets a new offline folder of the same id, which
        ``wandb sync`` merges), the values added to its summary."""
        id_file = run_dir / "wandb" / "run_id"
        if not id_file.is_file():
            return
        run = self._init(run_dir, id_file.read_text().strip())
        run.summary.update(values)
        run.finish()

    def _mode(self) -> str:
        return self.options.mode or os.environ.get("WANDB_MODE") or "offline"

    def _init(self, run_dir: Path, run_id: str | None, **details):
        import wandb  # imported here: its import is slow and `lmlab check` never tracks

        return wandb.init(
            project=self.options.project, entity=self.options.entity, dir=str(run_dir), mode=self._mode(),
            id=run_id, resume="allow" if run_id else None,
            # Each variant of a sweep is its own run, even when they share this process.
            reinit="create_new",
            settings=wandb.Settings(
                silent=True, console="off",  # our CLI owns the terminal; metrics.jsonl has the logs
                save_code=False, disable_code=True, disable_git=True, disable_job_creation=True),
            **details)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._require_run().log(metrics, step=step)

    def finish(self, summary: dict[str, Any], status: str) -> None:
        run = self._require_run()
        run.summary.update(summary)
        run.finish(exit_code=0 if status == "completed" else 1)
        self._run = None

    def closing_note(self, run_dirs: list[Path]) -> str | None:
        offline = [d for d in run_dirs if any((d / "wandb").glob("offline-run-*"))]
        if not offline:
            return None
        # One glob per runs folder, so the command stays short for a large sweep; a resumed variant
        # has one offline folder per start, all with the same run id, which sync merges into one run.
        patterns = sorted({shlex.quote(str(d.parent)) + "/*/wandb/offline-run-*" for d in offline})
        return f"W&B: {len(offline)} offline run(s); to upload them: wandb sync {' '.join(patterns)}"

    def _require_run(self):
        if self._run is None:
            raise RuntimeError("the wandb tracker was used before start() or after finish()")
        return self._run


def run_config(info: RunInfo) -> dict[str, Any]:
    """Nested manifest tables, flat grouping keys, provenance; anything that looks like a credential
    masked before it leaves the machine."""
    config = {key: value for key, value in info.config.items() if isinstance(value, dict)}
    config.update(info.flat_config)
    config["plugins"] = info.plugins
    config["environment"] = info.environment
    return _masked(config)


def _masked(value: Any, key: str = "") -> Any:
    if key and _SECRET_KEY.search(key):
        return "***"
    if isinstance(value, dict):
        return {k: _masked(v, str(k)) for k, v in value.items()}
    return value


def job_type(config: dict) -> str:
    objective = config.get("objective")
    return objective.get("use", "train") if isinstance(objective, dict) else "train"


def plugin_tags(plugins: dict) -> list[str]:
    """``attention:gqa``, ``ffn:moe``, ... (W&B caps a tag at 64 characters)."""
    tags = []
    for slot, entry in sorted(plugins.items()):
        for e in entry if isinstance(entry, list) else [entry]:
            tags.append(f"{slot}:{e['name']}"[:64])
    return tags
