"""``lmlab doctor RUN_DIR``: a run's failure diagnosis (cause, evidence, fixes) and its health
summary from what it recorded, for finished runs as for failed ones."""

import json
from pathlib import Path

from lmlab.errors import UserError


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, help="a run's folder, e.g. runs/shakespeare-char/default")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def main(args) -> int:
    from lmlab.diagnose import render
    from lmlab.report.health import health

    run_dir = args.run_dir
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file() and not (run_dir / "metrics.jsonl").is_file():
        raise UserError("is not a run folder (it has neither summary.json nor metrics.jsonl)", key=str(run_dir))
    try:
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    except json.JSONDecodeError as exc:
        raise UserError(f"summary.json is not valid JSON ({exc})", key=str(summary_path)) from None
    findings = health(run_dir)
    warnings_log = run_dir / "warnings.log"
    warnings = warnings_log.read_text().splitlines() if warnings_log.is_file() else []
    if args.json:
        print(json.dumps({"status": summary.get("status"), "diagnosis": summary.get("diagnosis"),
                          "health": [f.as_dict() for f in findings], "warnings": warnings}, indent=2))
        return 0
    status = summary.get("status", "running or killed (no summary.json)")
    steps = summary.get("steps", "?")
    print(f"{run_dir}: {status}, {steps} step{'' if steps == 1 else 's'}")
    if summary.get("error"):
        print(f"error: {summary['error'].splitlines()[0]}")
    if summary.get("diagnosis"):
        print(render(summary["diagnosis"]))
    elif status == "failed":
        print("diagnosis: none recorded (a run from before lmlab diagnosed failures); see error.log")
    print("health:")
    for finding in findings:
        print(f"  {finding.name}: {finding.verdict}: {finding.detail}")
    for key, label in (("skipped_steps", "steps skipped"), ("rollbacks", "rollbacks")):
        if summary.get(key):
            print(f"  {label}: {len(summary[key]) if isinstance(summary[key], list) else summary[key]}")
    if warnings:
        print(f"warnings ({len(warnings)}, from warnings.log):")
        for line in warnings[-10:]:
            print(f"  {line}")
    return 0
