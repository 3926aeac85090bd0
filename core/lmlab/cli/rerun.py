"""``lmlab rerun RUN_DIR``: trains a run again from its resolved manifest, into a sibling folder, and
says where the environment differs from the one the run recorded (plugin versions, lmlab's git
revision, torch, Lightning, Python, device), then how far the new result is from the old."""

import contextlib
import dataclasses
import json
import sys
from pathlib import Path

from lmlab.errors import UserError


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, help="a run's folder, e.g. runs/attention-ablation/attention.use=gqa,seed=1")
    parser.add_argument("--out", type=Path,
                        help="runs folder for the rerun (default: <runs folder>-rerun next to the original)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="change a value of the recorded manifest (the rerun is then no longer exact)")


def main(args) -> int:
    from lmlab import checks, manifest, provenance
    from lmlab.cli.run import _run_here
    from lmlab.train import sweep

    run_dir = args.run_dir
    recorded_manifest = run_dir / "manifest.toml"
    if not recorded_manifest.is_file():
        raise UserError("is not a run folder (it has no manifest.toml)", key=str(run_dir))
    (variant,) = manifest.load(recorded_manifest, args.overrides, recorded=True)  # resolved: one variant, no sweep
    variant = dataclasses.replace(variant, name=run_dir.name)
    out = args.out or run_dir.resolve().parent.with_name(run_dir.resolve().parent.name + "-rerun")

    recorded = _recorded_provenance(run_dir)
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    if recorded is None:
        say(f"warning: {run_dir} records no provenance (a run from before lmlab recorded it); "
            "the environment cannot be checked")
    else:
        differences = (provenance.plugin_differences(recorded.get("plugins", {}), provenance.plugins(variant))
                       + provenance.differences(recorded.get("environment", {}), provenance.environment()))
        for line in differences:
            say(f"warning: the environment differs: {line}")
        if not differences:
            say("the environment matches the recorded one (plugins, lmlab revision, torch, Lightning, device)")
    if args.overrides:
        say(f"warning: changed from the recorded manifest: {', '.join(args.overrides)}")

    checked = checks.run_all([variant])  # refused before anything is written, as in lmlab run
    sweep.check_out(out)
    with contextlib.ExitStack() as held:
        sweep.claim([out / variant.name], held)
        (item,) = sweep.plan([variant], out)
        if item.action == "skip":
            say(f"{item.run_dir} already holds a completed rerun")
        elif _run_here([item], say, checked):
            return 1
    _report(run_dir, item.run_dir)
    return 0


def _recorded_provenance(run_dir: Path) -> dict | None:
    for name in ("provenance.json", "summary.json"):
        path = run_dir / name
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError:
                continue
            if "plugins" in data and "environment" in data:
                return data
    return None


def _report(original: Path, rerun: Path) -> None:
    def summary(path: Path) -> dict:
        try:
            return json.loads((path / "summary.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    before, after = summary(original), summary(rerun)
    if isinstance(before.get("val_loss"), float) and isinstance(after.get("val_loss"), float):
        print(f"val_loss: {before['val_loss']:.6f} recorded, {after['val_loss']:.6f} rerun "
              f"(difference {after['val_loss'] - before['val_loss']:+.2e}); rerun in {rerun}")
