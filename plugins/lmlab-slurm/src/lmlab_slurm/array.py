"""Submitting a sweep's variants as submitit job arrays, and waiting for them.

The array task is :class:`VariantTask`, a ``submitit.helpers.Checkpointable``: submitit pickles it
(cloudpickle, by value for nothing but this small object), SLURM runs it in each process of the
variant, and on USR2 (preemption notice, time limit) submitit calls its ``checkpoint``, which stops the
variant's command with SIGTERM (lmlab writes a checkpoint and exits 143) and hands submitit the task
again, which it requeues (``scontrol requeue``); the requeued task's command resumes from that
checkpoint. Under SLURM's own preemption (PreemptMode=REQUEUE: SIGTERM to every process, then a
requeue) the command does the same by itself.
"""

import os
import signal
import socket
import time
from dataclasses import replace
from itertools import groupby
from pathlib import Path

import submitit

from lmlab.api import JobOutcome, VariantJob, run_job

STOP_GRACE_S = 60.0  # inside signal_delay_s: the checkpoint must be written before SLURM kills the task


class VariantTask(submitit.helpers.Checkpointable):
    def __init__(self, job: VariantJob, env: dict[str, str]):
        self.job, self.env = job, env
        self._pid: int | None = None

    def __call__(self) -> JobOutcome:
        environment = submitit.JobEnvironment()
        rank = environment.global_rank
        job = replace(self.job, env={**self.job.env, **self.env})
        job.run_dir.mkdir(parents=True, exist_ok=True)
        # Rank 0 writes the variant's log; the others their own beside it.
        log = job.log if rank == 0 else job.run_dir / f"output.rank{rank}.log"
        with open(log, "ab") as f:
            f.write(f"[lmlab-slurm] {time.strftime('%Y-%m-%dT%H:%M:%S')} {job.name}: job {environment.job_id} "
                    f"task {rank} on {socket.gethostname()}\n".encode())
        outcome = run_job(job, on_start=self._started, log=log)
        return replace(outcome, worker=str(environment.job_id))

    def _started(self, pid: int) -> None:
        self._pid = pid

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on USR2: the variant checkpoints and stops; the task is requeued."""
        if self._pid is not None:
            _stop(self._pid)
        return submitit.helpers.DelayedSubmission(VariantTask(self.job, self.env))


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def shape(job: VariantJob) -> tuple[int, int, str]:
    return job.devices, job.nodes, job.accelerator


def submit_arrays(jobs: list[VariantJob], options, parallel: int | None, folder: Path, say, report) -> list:
    """One array per launch shape; [(variant job, submitit job)] in the variants' order."""
    from lmlab_slurm.executor import threads

    submitted = []
    for (devices, nodes, accelerator), group in groupby(sorted(jobs, key=shape), key=shape):
        group = list(group)
        executor = submitit.AutoExecutor(folder=folder / "%j", cluster=options.cluster,
                                         slurm_max_num_timeout=options.max_requeues)
        executor.update_parameters(**parameters(options, devices, nodes, accelerator, parallel or len(group),
                                                group[0].run_dir.parent.name))
        env = threads(options, min(len(group), parallel or len(group)))
        with executor.batch():
            pending = [(job, executor.submit(VariantTask(job, env))) for job in group]
        ids = sorted({str(s.job_id).split("_")[0] for _, s in pending})
        say(f"slurm: array {', '.join(ids)}: {len(group)} variant(s), {nodes} node(s) × {devices} "
            f"{'GPU' if accelerator == 'gpu' else 'process'}(es) each" + (f", submitit folder {folder}"))
        for job, sjob in pending:
            report(job.name, state="queued", job_id=str(sjob.job_id))
        submitted += pending
    order = {job.name: i for i, job in enumerate(jobs)}
    return sorted(submitted, key=lambda pair: order[pair[0].name])


def parameters(options, devices: int, nodes: int, accelerator: str, parallel: int, name: str) -> dict:
    params = {"name": f"lmlab-{name}", "timeout_min": options.timeout_min, "nodes": nodes,
              "tasks_per_node": devices, "slurm_array_parallelism": parallel,
              "slurm_signal_delay_s": options.signal_delay_s,
              "slurm_additional_parameters": {"requeue": True}}
    if accelerator == "gpu":
        params["gpus_per_node"] = devices
    for key in ("cpus_per_task", "mem_gb"):
        if getattr(options, key) is not None:
            params[key] = getattr(options, key)
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(options, key) is not None:
            params[f"slurm_{key}"] = getattr(options, key)
    if options.setup:
        params["slurm_setup"] = list(options.setup)
    if options.cluster != "slurm":
        # On this machine there is no srun to start the processes: the variant's parallel plugin does,
        # as it does under `lmlab run` alone.
        params = {k: v for k, v in params.items() if not k.startswith("slurm_")}
        params.update(tasks_per_node=1, nodes=1)
        params.pop("gpus_per_node", None)
    return params


def wait_for(submitted: list, say, report) -> dict[str, JobOutcome]:
    outcomes = {}
    for job, sjob in submitted:
        try:
            outcome = sjob.result()
        except Exception as exc:  # noqa: BLE001 - failed, cancelled, requeued too often: one line each
            outcome = JobOutcome(None, worker=str(sjob.job_id))
            say(f"[{job.name}] slurm job {sjob.job_id} ended without a result: "
                f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}")
        outcomes[job.name] = outcome
        report(job.name, host=outcome.host, pid=outcome.pid, job_id=str(sjob.job_id), returncode=outcome.returncode,
               attempts=_attempts(job, str(sjob.job_id)))
    return outcomes


def _attempts(job: VariantJob, job_id: str) -> int:
    try:
        text = job.log.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return 0
    return text.count(f": job {job_id} task 0 on ")


def states(jobs: dict[str, dict]) -> dict[str, str]:
    """What SLURM says of each recorded job (sacct, through submitit); nothing where it cannot ask."""
    out = {}
    for name, record in jobs.items():
        job_id = record.get("job_id")
        if not job_id or not str(job_id)[0].isdigit():
            continue
        try:
            out[name] = f"slurm {submitit.SlurmJob(Path('.'), str(job_id)).state}"
        except Exception:  # noqa: BLE001 - no sacct here, or the job is unknown to it
            continue
    return out
