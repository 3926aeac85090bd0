"""lm-eval's tasks run on a run, the results written into its folder: lm-eval's own results JSON
(with its versions, task configs and settings) as ``eval/harness-<tasks>.json``, and each task's
metrics under ``eval`` in ``summary.json``, where ``lmlab compare`` finds them."""

import functools
import json
import re
from pathlib import Path

from lmlab.errors import UserError

#: The tasks lmlab ships, found by name like lm-eval's own.
SHIPPED = Path(__file__).resolve().parent / "tasks"


def task_manager(include_path: Path | None = None, tasks: list[str] | None = None):
    """lm-eval's TaskManager over the shipped tasks and ``include_path``, with lm-eval's own thousands of
    tasks indexed too unless every one of ``tasks`` is found without them (indexing them takes about
    7 s; it is done once per process)."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError("scoring tasks needs lm-evaluation-harness: pip install 'lmlab[eval]'",
                        key="eval.tasks") from None

    paths = [str(SHIPPED)]
    if include_path is not None:
        if not include_path.is_dir():
            raise UserError("no such folder of task YAML files", key="--include-path")
        paths.append(str(include_path.resolve()))
    if tasks:
        local = TaskManager(include_path=paths, include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    return _with_defaults(tuple(paths))


@functools.cache
def _with_defaults(paths: tuple[str, ...]):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(paths))


def check_tasks(manager, tasks: list[str], key: str = "--tasks") -> None:
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        shipped = sorted(t for t in known if t.startswith("shakespeare_"))
        raise UserError(f"no task {unknown[0]!r} in lm-eval or --include-path (lmlab ships {', '.join(shipped)}; "
                        "`lm_eval ls tasks` lists lm-eval's)", key=key)


def evaluate(run, tasks: list[str], *, num_fewshot: int | None = None, limit: int | None = None,
             include_path: Path | None = None, batch_size: int = 8, chat: bool = False,
             max_length: int | None = None) -> dict:
    """lm-eval's results of ``tasks`` on ``run`` (a loaded run)."""
    import lm_eval

    from lmlab.harness.model import LmlabLM

    manager = task_manager(include_path, tasks)
    check_tasks(manager, tasks)
    model = LmlabLM(run=run, batch_size=batch_size, max_length=max_length)
    try:
        return lm_eval.simple_evaluate(model=model, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                       task_manager=manager, apply_chat_template=chat, log_samples=True,
                                       bootstrap_iters=0)
    except FileNotFoundError as exc:
        raise UserError(f"a task's data cannot be read: {exc}", key="--tasks") from None


def metrics(results: dict) -> dict[str, dict[str, float]]:
    """task → metric → value, lm-eval's ``acc,none`` written ``acc`` (its filter kept when not ``none``)."""
    out = {}
    for task, values in results["results"].items():
        kept = {}
        for key, value in values.items():
            name, _, filt = key.partition(",")
            if not filt or "stderr" in name or not isinstance(value, (int, float)):
                continue
            kept[name if filt == "none" else f"{name}:{filt}"] = float(value)
        out[task] = kept
    return out


def record(run_dir: Path, results: dict, tracker=None) -> Path:
    """Write lm-eval's results into ``run_dir`` and, through the run's ``tracker`` plugin, into its
    remote record (``Tracker.amend``); returns the results file."""
    from lm_eval.utils import handle_non_serializable

    from lmlab.rundir import atomic_write_bytes, load_summary

    tasks = sorted(results["results"])
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", "+".join(tasks))[:120]
    path = run_dir / "eval" / f"harness-{name}.json"
    path.parent.mkdir(exist_ok=True)
    kept = {k: v for k, v in results.items() if k != "samples"}
    atomic_write_bytes(path, json.dumps(kept, indent=1, default=handle_non_serializable).encode())
    samples = results.get("samples") or {}
    for task, rows in samples.items():
        lines = "".join(json.dumps(r, default=handle_non_serializable) + "\n" for r in rows)
        atomic_write_bytes(run_dir / "eval" / f"samples-{task}.jsonl", lines.encode())
    summary = load_summary(run_dir, "remove it to start a new one") or {}
    summary.setdefault("eval", {}).update(metrics(results))
    atomic_write_bytes(run_dir / "summary.json", json.dumps(summary, indent=1).encode())
    if tracker is not None:
        tracker.amend(run_dir, {f"eval/{task}/{name}": value for task, values in metrics(results).items()
                                for name, value in values.items()})
    return path
