"""The ``slurm`` executor: a sweep's variants as SLURM job arrays, submitted through submitit."""

import shutil
from pathlib import Path
from typing import Callable, Literal

from lmlab.api import Executor, Field, JobOutcome, Options, UserError, VariantJob, usable_cores


class SlurmOptions(Options):
    partition: str | None = Field(None, help="the partition (sbatch --partition)")
    account: str | None = Field(None, help="the account charged (sbatch --account)")
    qos: str | None = Field(None, help="the quality of service (sbatch --qos)")
    constraint: str | None = Field(None, help="node features required (sbatch --constraint)")
    timeout_min: int = Field(240, ge=1, help="each task's time limit, in minutes; a task that reaches it is "
                                             "checkpointed and requeued")
    cpus_per_task: int | None = Field(None, ge=1, help="CPUs of each process (and its OMP_NUM_THREADS)")
    mem_gb: float | None = Field(None, gt=0, help="memory per node, in GB")
    signal_delay_s: int = Field(90, ge=10, help="how long before the time limit SLURM signals the task to "
                                                "checkpoint (sbatch --signal=USR2@N)")
    max_requeues: int = Field(3, ge=0, help="requeues after the time limit before a variant counts as failed "
                                            "(preemptions are not counted)")
    setup: list[str] = Field([], help="shell lines each task runs first (module load ..., source venv/bin/activate)")
    wait: bool = Field(True, help="wait for the arrays to end (false: submit, record the job ids in sweep.json, "
                                  "and return; `lmlab run --status` follows them)")
    folder: Path | None = Field(None, help="submitit's folder (job scripts, logs, pickles); default: .slurm in the "
                                           "runs folder")
    cluster: Literal["slurm", "local", "debug"] = Field(
        "slurm", help="slurm; or submitit's local executor (each array task a process on this machine) or its "
                      "debug executor (in this process), to try a sweep where there is no SLURM")


class Slurm(Executor):
    """One job array per launch shape (devices × nodes × accelerator), one array task per variant, each
    running ``lmlab run MANIFEST --only VARIANT`` (in every process of a multi-process variant, through
    srun: Lightning reads its rank from SLURM). Preemption and time limits: SLURM signals the task
    (USR2), which has the variant write a checkpoint (SIGTERM to lmlab: exit 143) and requeues the task,
    which resumes from it."""

    Options = SlurmOptions
    api = ">=1.23,<2"  # Executor
    cli_options = "--slurm"

    def start(self, parallel: int | None, jobs: list[VariantJob]) -> None:
        try:
            import submitit  # noqa: F401
        except ImportError as exc:  # a dependency of this distribution, missing
            raise UserError(f"submitit cannot be imported ({exc}); pip install lmlab-slurm", key="--executor") from None
        missing = [tool for tool in ("sbatch", "srun") if shutil.which(tool) is None]
        if self.options.cluster == "slurm" and missing:
            raise UserError(f"no SLURM here ({' and '.join(missing)} not on PATH); run from a SLURM login node, or "
                            "pass --slurm cluster=local to run the array on this machine", key="--executor")
        self.parallel = parallel

    def run_variants(self, jobs: list[VariantJob], parallel: int | None, say: Callable[[str], None],
                     report) -> dict[str, JobOutcome]:
        from lmlab_slurm.array import submit_arrays, wait_for

        folder = self.options.folder or jobs[0].run_dir.parent / ".slurm"
        submitted = submit_arrays(jobs, self.options, parallel, folder, say, report)
        if not self.options.wait:
            return {}
        return wait_for(submitted, say, report)

    def status(self, jobs: dict[str, dict]) -> dict[str, str]:
        from lmlab_slurm.array import states

        return states(jobs)


def threads(options: SlurmOptions, running_here: int) -> dict[str, str]:
    """OMP/MKL threads of each variant's processes: its CPUs under SLURM, this machine's shared out
    when the array runs here."""
    if options.cpus_per_task:
        n = options.cpus_per_task
    elif options.cluster != "slurm":
        n = max(1, usable_cores() // max(1, running_here))
    else:
        return {}
    return {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)}
