"""Conformance checks of executor plugins: a tiny sweep run through the executor, against the same sweep
run here.

The subject writes a sweep of two variants (two seeds of a 2-layer model, 4 steps, on a synthetic
corpus) into a temporary folder, runs it once through the executor as ``lmlab run --executor`` does
(``start``, ``run_variants`` with every job, ``close``) and once as the local executor does (each
job's command in this machine's processes, one after the other), and the checks compare the two. An
executor that runs elsewhere must see the folder: pass ``root``, a folder its workers share.
"""

import atexit
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from lmlab.testing import generic
from lmlab.testing.common import Subject, fail

MANIFEST = """name = "executor-kit"
seed = 5

[data]
use = "text-file"
path = "corpus.txt"

[model]
n_layers = 2
d_model = 32
n_heads = 4
block_size = 16

[train]
max_steps = 4
batch_size = 4
warmup_steps = 1
eval_every = 4
eval_steps = 2
checkpoint_every = 2
log_every = 2
sample_tokens = 0

[tracker]
use = "none"

[sweep]
seeds = [1, 2]
"""
#: What must not depend on where a variant ran.
NUMBERS = ("status", "val_loss", "train_loss", "steps", "params")
#: manifest → the sweep run here: the same in every process that checks an executor (the kit's corpus is fixed).
_REFERENCE: dict[str, "SweepRun"] = {}
#: The fields an executor may report of a job (``Executor.run_variants``'s ``report``).
REPORTED = {"state", "host", "pid", "worker", "job_id", "attempt", "attempts", "returncode", "action", "sweep"}


@dataclass
class SweepRun:
    """One run of the kit's sweep: each variant's summary numbers, the outcomes, what was reported."""

    numbers: dict[str, dict] = field(default_factory=dict)
    outcomes: dict = field(default_factory=dict)
    reports: list[tuple[str, dict]] = field(default_factory=list)
    said: list[str] = field(default_factory=list)


class ExecutorSubject(Subject):
    slot = "executor"

    def __init__(self, plugin, options=None, *, root: Path | None = None, parallel: int = 2, **settings):
        super().__init__(plugin, options, **settings)
        self.root = Path(root) if root is not None else None
        self.parallel = parallel
        self._runs: dict[str, SweepRun] = {}

    def folder(self) -> Path:
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="lmlab-executor-kit-"))
            atexit.register(shutil.rmtree, self.root, True)
        manifest = self.root / "sweep.toml"
        if not manifest.is_file():
            self.root.mkdir(parents=True, exist_ok=True)
            words = "the quick brown fox jumps over the lazy dog while the cat sleeps by the fire "
            (self.root / "corpus.txt").write_text(words * 400)
            manifest.write_text(MANIFEST)
        return self.root

    def jobs(self, out: Path) -> list:
        from lmlab import manifest as manifests
        from lmlab.train.executors import absolute_argv, jobs_for
        from lmlab.train.sweep import plan

        path = self.folder() / "sweep.toml"
        return jobs_for(plan(manifests.load(path), out), absolute_argv(str(path), out, []))

    def run(self, where: str) -> SweepRun:
        """The sweep run ``where`` = "executor" (through the plugin) or "here" (the local reference),
        once per subject."""
        if where in self._runs:
            return self._runs[where]
        from lmlab.api import VariantJob, run_job

        out = self.folder() / where
        if where == "here" and MANIFEST in _REFERENCE:  # the same sweep, run by an earlier subject
            self._runs[where] = _REFERENCE[MANIFEST]
            return self._runs[where]
        shutil.rmtree(out, ignore_errors=True)
        jobs = self.jobs(out)
        result = SweepRun()
        if where == "here":
            # Every variant in one process, one after the other, as `lmlab run` without --jobs does.
            whole = VariantJob("all", tuple(jobs[0].argv[:-2]), out)
            outcome = run_job(whole)
            result.outcomes = {job.name: outcome for job in jobs}
        else:
            executor = self.plugin()
            executor.start(self.parallel, jobs)
            try:
                result.outcomes = executor.run_variants(jobs, self.parallel, result.said.append,
                                                        lambda name, **fields: result.reports.append((name, fields)))
            finally:
                executor.close()
        for job in jobs:
            try:
                summary = json.loads((job.run_dir / "summary.json").read_text())
            except (OSError, ValueError):
                continue
            result.numbers[job.name] = {k: summary.get(k) for k in NUMBERS}
        self._runs[where] = result
        if where == "here":
            _REFERENCE[MANIFEST] = result
        return result


def runs_every_job(subject: ExecutorSubject) -> None:
    """``run_variants`` returns an outcome for every job it was given (by the job's name), each with exit
    status 0 and where the command ran (``host``, ``pid``), and each variant's folder holds a completed
    run: the executor ran every command to its end."""
    run = subject.run("executor")
    names = [job.name for job in subject.jobs(subject.folder() / "executor")]
    missing = [n for n in names if n not in run.outcomes]
    if missing:
        fail(f"run_variants returned no outcome for {', '.join(missing)} (it returned {sorted(run.outcomes)})")
    for name in names:
        outcome = run.outcomes[name]
        if getattr(outcome, "returncode", None) != 0:
            fail(f"the job of {name} ended with exit status {getattr(outcome, 'returncode', None)!r}, not 0; "
                 f"see {subject.folder() / 'executor' / name / 'output.log'}")
        if not getattr(outcome, "host", "") or not isinstance(getattr(outcome, "pid", None), int):
            fail(f"the outcome of {name} does not say where it ran: host {outcome.host!r}, pid {outcome.pid!r} "
                 "(return run_job's outcome, or one like it)")
        if run.numbers.get(name, {}).get("status") != "completed":
            fail(f"{name}'s folder holds no completed run after run_variants returned "
                 f"(summary: {run.numbers.get(name)})")


def same_numbers(subject: ExecutorSubject) -> None:
    """Each variant's summary (val_loss, train_loss, steps, params) is exactly the one the same command
    gives when run here: where a variant ran changes nothing it trains."""
    theirs, ours = subject.run("executor").numbers, subject.run("here").numbers
    for name, numbers in ours.items():
        if theirs.get(name) != numbers:
            fail(f"{name}: {theirs.get(name)} through the executor, {numbers} run here")


def reports(subject: ExecutorSubject) -> None:
    """What ``report`` was told names only jobs the executor was given, with fields the core records
    (``state``, ``host``, ``pid``, ``worker``, ``job_id``, ``attempts``, ``returncode``...) as JSON values."""
    run = subject.run("executor")
    names = set(run.outcomes) | {job.name for job in subject.jobs(subject.folder() / "executor")}
    for name, fields in run.reports:
        if name not in names:
            fail(f"report was called for {name!r}, which is no job of the sweep")
        unknown = set(fields) - REPORTED
        if unknown:
            fail(f"report was given {', '.join(sorted(unknown))} for {name}; the core records {', '.join(sorted(REPORTED))}")
        try:
            json.dumps(fields)
        except (TypeError, ValueError):
            fail(f"report was given values that are not JSON for {name}: {fields!r}")


#: name → check, in the order ``check_executor`` runs them.
CHECKS = {
    "plugin_class": generic.plugin_class,
    "runs_every_job": runs_every_job,
    "same_numbers": same_numbers,
    "reports": reports,
}
