"""The runs a comparison reads: lmlab's own run folders, or the same fetched from the W&B API."""

from dataclasses import dataclass, field
from pathlib import Path

from lmlab.errors import UserError
from lmlab.variant import seedless
from lmlab.rundir import load_json_object, load_summary, read_metrics


@dataclass
class Run:
    name: str  # the variant, seed included: attention.use=gqa,seed=1
    summary: dict  # summary.json (or W&B's run summary)
    metrics: list[dict] = field(default_factory=list)  # metrics.jsonl records, for the curves

    @property
    def group(self) -> str:
        return seedless(self.name)

    @property
    def completed(self) -> bool:
        return self.summary.get("status") == "completed"


@dataclass
class RunSet:
    source: str  # the folder or W&B path, for messages and the report's title
    runs: list[Run]
    order: list[str] = field(default_factory=list)  # variant groups in sweep order, when known


def from_folder(runs_dir: Path) -> RunSet:
    """Every ``<runs_dir>/<variant>/summary.json`` with its metrics.jsonl; the sweep order from sweep.json."""
    if not runs_dir.is_dir():
        raise UserError("no such folder", key=str(runs_dir))
    runs = []
    for path in sorted(runs_dir.glob("*/summary.json")):
        summary = load_summary(path.parent, "move the variant's folder away, or train it again")
        runs.append(Run(path.parent.name, summary, read_metrics(path.parent / "metrics.jsonl")))
    if not runs:
        raise UserError("holds no runs (no <variant>/summary.json below it)", key=str(runs_dir))
    index = load_json_object(runs_dir / "sweep.json", "sweep index", "delete it (it is written again by lmlab run)")
    groups = (index or {}).get("groups", [])
    order = [g for g in groups if isinstance(g, str)] if isinstance(groups, list) else []
    return RunSet(str(runs_dir), runs, order)


def from_wandb(path: str, api=None) -> RunSet:
    """The runs of W&B group ``ENTITY/PROJECT/GROUP`` as lmlab logged them (needs W&B online access)."""
    parts = path.split("/")
    if len(parts) != 3 or not all(parts):
        raise UserError("expected ENTITY/PROJECT/GROUP, e.g. my-team/lmlab/attention-ablation", key="--wandb")
    entity, project, group = parts
    if api is None:
        try:
            import wandb

            api = wandb.Api(timeout=30)
        except Exception as exc:  # no login, no network: say so in one line
            raise UserError(f"cannot reach the W&B API ({type(exc).__name__}: {exc}); log in with "
                            "`wandb login` or compare the local runs folder instead", key="--wandb") from None
    try:
        remote = list(api.runs(f"{entity}/{project}", filters={"group": group}))
    except Exception as exc:
        raise UserError(f"W&B API error: {type(exc).__name__}: {exc}", key="--wandb") from None
    if not remote:
        raise UserError(f"W&B has no runs in group {group!r} of {entity}/{project}", key="--wandb")
    runs = []
    for run in remote:
        summary = {k: v for k, v in dict(run.summary).items() if not k.startswith("_")}
        history = [{k: v for k, v in row.items() if v is not None and not k.startswith("_") or k == "_step"}
                   for row in run.scan_history()]
        metrics = [{**{k: v for k, v in row.items() if k != "_step"}, "step": row.get("_step")} for row in history]
        runs.append(Run(run.name, summary, metrics))
    return RunSet(f"wandb:{path}", sorted(runs, key=lambda r: r.name))
