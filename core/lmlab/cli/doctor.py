"""``lmlab doctor RUN_DIR``: a run's failure diagnosis (cause, evidence, fixes) and its health
summary from what it recorded, for finished runs as for failed ones."""

import json
from pathlib import Path

from lmlab.errors import UserError, warn
from lmlab.rundir import load_summary


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, help="a run's folder, e.g. runs/shakespeare-char/default")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def main(args) -> int:
    from lmlab.diagnose import render
    from lmlab.report.health import health

    run_dir = args.run_dir
    summary_path = run_dir / "summary.json"
    if not summary_path.exists() and not (run_dir / "metrics.jsonl").is_file():
        raise UserError("is not a run folder (it has neither summary.json nor metrics.jsonl)", key=str(run_dir))
    summary = load_summary(run_dir, "lmlab doctor reads what the run recorded there") or {}
    _check_summary(summary, summary_path)
    findings = health(run_dir)
    warnings = _warnings(run_dir / "warnings.log")
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
    if warnings:  # None: unreadable, said on stderr
        print(f"warnings ({len(warnings)}, from warnings.log):")
        for line in warnings[-10:]:
            print(f"  {line}")
    return 0


def _check_summary(summary: dict, path: Path) -> None:
    """Refuse a summary whose ``error`` or ``diagnosis`` is not what ``lmlab run`` writes, naming the
    key: printing them is all this command does with them."""
    def refuse(key: str, value, expected: str):
        what = f"is {_json_type(value)}, not {expected}" if not isinstance(value, list) or "list" not in expected \
            else f"is not {expected}"
        raise UserError(f"{key!r} {what} (the file is damaged)", key=str(path))

    error = summary.get("error")
    if error is not None and not isinstance(error, str):
        refuse("error", error, "a string")
    diagnosis = summary.get("diagnosis")
    if diagnosis is None:
        return
    if not isinstance(diagnosis, dict):
        refuse("diagnosis", diagnosis, "an object")
    for key in ("kind", "cause"):
        if not isinstance(diagnosis.get(key), str):
            refuse(f"diagnosis.{key}", diagnosis.get(key), "a string")
    evidence = diagnosis.get("evidence", [])
    if not isinstance(evidence, list) or not all(isinstance(line, str) for line in evidence):
        refuse("diagnosis.evidence", evidence, "a list of strings")
    fixes = diagnosis.get("fixes", [])
    if not isinstance(fixes, list) or not all(
            isinstance(fix, dict) and isinstance(fix.get("text"), str) and isinstance(fix.get("key"), (str, type(None)))
            and isinstance(fix.get("also", {}), dict) for fix in fixes):
        refuse("diagnosis.fixes", fixes, "a list of {\"text\", \"key\", \"value\"} objects")


def _json_type(value) -> str:
    if value is None:
        return "missing or null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _warnings(path: Path) -> list[str] | None:
    """warnings.log's lines; None, said once on stderr, when it cannot be read as text: the
    diagnosis and health do not depend on it."""
    try:
        return path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    except (OSError, UnicodeDecodeError) as exc:
        why = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else f"cannot be read ({exc.strerror})"
        warn(f"{path}: {why}; its warnings are left out")
        return None
