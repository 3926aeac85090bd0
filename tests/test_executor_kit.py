"""The executor kit (``lmlab.testing.check_executor``) fails executors that break the contract: one that
leaves a job out, one whose variants' numbers differ from the same commands run here, one that
reports fields the core does not record. (The first-party executors pass it: lmlab-dask, lmlab-slurm.)"""

import json
import os
import socket

import pytest

from lmlab.api import Executor, JobOutcome
from lmlab.testing import ConformanceError, check_executor


class LeavesOneOut(Executor):
    api = ">=1.22,<2"

    def run_variants(self, jobs, parallel, say, report):
        return {}


class Forges(Executor):
    """Runs nothing: writes completed summaries with other numbers, and reports a field of its own."""

    api = ">=1.22,<2"

    def run_variants(self, jobs, parallel, say, report):
        for job in jobs:
            job.run_dir.mkdir(parents=True, exist_ok=True)
            (job.run_dir / "summary.json").write_text(json.dumps(
                {"status": "completed", "val_loss": 9.5, "train_loss": 9.5, "steps": 4, "params": 1}))
            report(job.name, state="done", colour="red")
        return {job.name: JobOutcome(0, socket.gethostname(), os.getpid()) for job in jobs}


def test_an_executor_that_leaves_a_job_out_fails_runs_every_job(tmp_path):
    with pytest.raises(ConformanceError, match=r"runs_every_job: run_variants returned no outcome for seed=1, seed=2"):
        check_executor(LeavesOneOut, root=tmp_path, skip=("same_numbers", "reports"))


@pytest.mark.slow  # the kit's reference sweep, run here: about 8 s
def test_an_executor_whose_numbers_differ_and_whose_reports_are_its_own_fails_those_checks(tmp_path):
    with pytest.raises(ConformanceError) as caught:
        check_executor(Forges, root=tmp_path)
    message = str(caught.value)
    assert "2 conformance checks failed" in message and "runs_every_job" not in message
    assert "same_numbers: seed=1: {'status': 'completed', 'val_loss': 9.5" in message
    assert "reports: report was given colour for seed=1" in message
