"""Where a sweep's variants run (``lmlab run --executor NAME``) and what ``sweep.json`` records of them.

The core plans (:mod:`lmlab.train.sweep`); ``local`` (the default) trains here or in child processes
(``--jobs``); any other name is an executor plugin (``lmlab.api.executor``) given one
[VariantJob][lmlab.api.executor.VariantJob] per variant to train. Every job is an ordinary
``lmlab run MANIFEST --only VARIANT``: it takes its folder's lock, resumes from its checkpoint, and
writes its summary where the planner finds it, so running the sweep again skips what completed and
resumes what did not, whichever executor ran it. What each executor did with each job (where it ran,
its pid, its attempts, a SLURM job id) is kept in ``sweep.json`` under ``jobs``, for ``lmlab run
--status``.
"""

import sys
import time
from pathlib import Path

from lmlab.errors import UserError
from lmlab.rundir import write_json
from lmlab.train.sweep import read_index

LOCAL = "local"


def load(name: str, scheduler: str | None, pairs: list[str]):
    """The executor plugin ``name`` with its options from the command line (None for ``local``);
    bad input (an executor not installed, an option it does not have) is a UserError, before anything
    starts."""
    if name == LOCAL:
        if scheduler is not None:
            raise UserError("a scheduler address needs --executor dask", key="--scheduler")
        if pairs:
            raise UserError("the local executor takes no such options; they belong to --executor slurm",
                            key="--slurm")
        return None
    from lmlab import discovery
    from lmlab.manifest import parse_value
    from lmlab.tables import validate_options

    cls = discovery.load("executor", name, key="--executor")
    values, flag = {}, "--slurm"  # the one KEY=VALUE flag of lmlab run (Executor.cli_options)
    if scheduler is not None:
        if "scheduler" not in cls.Options.model_fields:
            raise UserError(f"the {name} executor takes no scheduler address", key="--scheduler")
        values["scheduler"] = scheduler
    for pair in pairs:
        key, eq, text = pair.partition("=")
        if not eq or not key.strip():
            raise UserError(f"expected KEY=VALUE, got {pair!r}", key=flag)
        if cls.cli_options != flag:
            raise UserError(f"the {name} executor takes no {flag} options", key=flag)
        values[key.strip()] = parse_value(text.strip())
    return cls(validate_options(cls.Options, values, flag, Path.cwd(), plugin=name))


def launch_shape(variant) -> tuple[int, int, str]:
    """(processes per node, nodes, "cpu" or "gpu") of a variant, from its parallel plugin's options."""
    options = variant.options("parallel") if variant.uses("parallel") else None
    devices, nodes = getattr(options, "devices", 1), getattr(options, "num_nodes", 1)
    accelerator = "gpu" if getattr(options, "accelerator", "cpu") in ("gpu", "cuda") else "cpu"
    if devices == "auto":
        if accelerator == "gpu":
            raise UserError("a variant sent to a cluster must say how many GPUs it uses; set a number",
                            key=f"{variant.name}: parallel.devices")
        devices = 1
    return int(devices), int(nodes), accelerator


def jobs_for(todo: list, base_argv: list[str]) -> list:
    from lmlab.api.executor import VariantJob

    jobs = []
    for item in todo:
        devices, nodes, accelerator = launch_shape(item.variant)
        jobs.append(VariantJob(item.variant.name, (*base_argv, "--only", item.variant.name), item.run_dir.resolve(),
                               devices=devices, nodes=nodes, accelerator=accelerator, action=item.action))
    return jobs


def absolute_argv(manifest: str, out: Path, overrides: list[str]) -> list[str]:
    """``lmlab run``'s arguments as a job elsewhere runs them: paths absolute (its working folder may
    differ), never ``--overwrite`` (this process already cleared what it had to)."""
    return ["run", str(Path(manifest).resolve()), "--out", str(out.resolve()), *(f"--set={o}" for o in overrides)]


def run(executor, name: str, todo: list, parallel: int | None, base_argv: list[str], out: Path,
        say) -> tuple[dict, list[str]]:
    """Hand ``todo`` to ``executor`` and wait: (variant name → its summary, None when it has none;
    the variants the executor left running). ``parallel``: ``--jobs``, None when not given (the
    executor decides)."""
    from lmlab.train.sweep import describe, read_summary

    jobs = jobs_for(todo, base_argv)
    record = JobRecord(out, name)
    for job in jobs:
        record(job.name, state="queued", action=job.action)
    executor.start(parallel, jobs)
    try:
        outcomes = executor.run_variants(jobs, parallel, say, record)
    finally:
        executor.close()
    results, running = {}, []
    for job in jobs:
        if job.name not in outcomes:
            running.append(job.name)
            continue
        returncode = outcomes[job.name].returncode
        summary = results[job.name] = read_summary(job.run_dir)
        record(job.name, state="done" if returncode is not None else "lost", returncode=returncode)
        say(describe(job.name, summary, returncode if returncode is not None else -1, job.run_dir))
    if running:
        say(f"{len(running)} variant(s) left running on the {name} executor; `lmlab run {base_argv[1]} --out "
            f"{out} --status` follows them, and running the sweep again once they ended completes it")
    return results, running


class JobRecord:
    """``report(name, **fields)`` for executors: each job's fields merged into ``sweep.json``'s ``jobs``,
    written atomically each time (this process alone writes it)."""

    def __init__(self, out: Path, executor: str):
        self.path, self.executor = out / "sweep.json", executor

    def __call__(self, name: str, **fields) -> None:
        index = read_index(self.path.parent)
        index["executor"] = self.executor
        jobs = index.setdefault("jobs", {})
        jobs[name] = {**jobs.get(name, {}), **fields, "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        write_json(self.path, index)


def status_lines(variants: list, out: Path) -> list[str]:
    """``lmlab run MANIFEST --status``: one line per variant, from its folder (summary, the live
    holder of its lock) and what ``sweep.json`` says its executor did with it."""
    from lmlab.train.lock import live_holder
    from lmlab.train.sweep import read_summary, status_of

    index = read_index(out)
    jobs, executor_name = index.get("jobs", {}), index.get("executor", LOCAL)
    words = _executor_words(executor_name, jobs)
    width = max(len(v.name) for v in variants)
    lines = [f"{out}: {len(variants)} variant(s), executor {executor_name}"]
    for variant in variants:
        run_dir = out / variant.name
        state = status_of(run_dir) or "not started"
        holder = live_holder(run_dir)
        detail = ""
        if holder is not None:
            state, detail = "running", f"pid {holder.get('pid')} on {holder.get('host')}"
        elif state == "completed":
            summary = read_summary(run_dir) or {}
            if isinstance(summary.get("val_loss"), (int, float)):
                detail = f"val_loss {summary['val_loss']:.4f}"
        job = jobs.get(variant.name) or {}
        if holder is None and job.get("state") == "queued" and state != "completed":
            state = "queued"
        where = ", ".join(str(x) for x in (job.get("job_id") and f"job {job['job_id']}",
                                           words.get(variant.name)) if x)
        lines.append(f"  {variant.name:<{width}}  {state:<11}  {'; '.join(x for x in (detail, where) if x)}".rstrip())
    return lines


def _executor_words(name: str, jobs: dict) -> dict[str, str]:
    if name == LOCAL or not jobs:
        return {}
    from lmlab import discovery

    try:
        return discovery.load("executor", name, key="--executor")().status(jobs)
    except UserError as exc:  # the executor is not installed here: its records still show
        print(f"lmlab: note: {exc}", file=sys.stderr)
        return {}
