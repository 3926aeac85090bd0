"""``lmlab compare RUNS_DIR``: one row per variant, seeds pooled (mean ± std)."""

import json
import re
import statistics
from pathlib import Path

from lmlab.errors import UserError

SEED = re.compile(r"(^|,)seed=\d+")


def add_arguments(parser) -> None:
    parser.add_argument("runs_dir", type=Path, help="a manifest's runs folder, e.g. runs/attention-ablation")


def group_runs(runs_dir: Path) -> dict[str, list[dict]]:
    """variant name without its seed → summaries of its completed runs."""
    if not runs_dir.is_dir():
        raise UserError("no such folder", key=str(runs_dir))
    groups: dict[str, list[dict]] = {}
    for path in sorted(runs_dir.glob("*/summary.json")):
        summary = json.loads(path.read_text())
        if summary.get("status") != "completed":
            continue
        name = SEED.sub("", path.parent.name).strip(",") or "default"
        groups.setdefault(name, []).append(summary)
    if not groups:
        raise UserError("holds no completed runs (no */summary.json with status completed)", key=str(runs_dir))
    return groups


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def main(args) -> int:
    groups = group_runs(args.runs_dir)
    # Memory: what a training step holds (activations saved for backward + parameters, gradients
    # and optimizer state), measured per variant; "peak MB" is the process's peak (on the CPU, the
    # resident set of everything the process ran so far).
    header = ("variant", "n", "val_loss", "tokens/s", "step MB", "peak MB", "params")
    rows = []
    for name, runs in sorted(groups.items(), key=lambda kv: statistics.mean(r["val_loss"] for r in kv[1])):
        step_mb = [r["activation_mb"] + r["state_mb"] for r in runs if "activation_mb" in r and "state_mb" in r]
        rows.append((name, str(len(runs)), _mean_std([r["val_loss"] for r in runs]),
                     f"{statistics.median(r['tokens_per_s'] or 0 for r in runs):,.0f}",
                     f"{max(step_mb):,.1f}" if step_mb else "-",
                     f"{max(r.get('peak_mem_mb') or 0 for r in runs):,.0f}", f"{runs[0]['params']:,}"))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    return 0
