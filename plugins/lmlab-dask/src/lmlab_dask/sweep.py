"""A sweep's variants as tasks on a Dask cluster.

Each variant is one task whose work is a child process, ``lmlab run MANIFEST --only VARIANT``
(``lmlab.api.run_job``): a crash, an out-of-memory kill or a hung collective of one variant loses
that variant only, and the worker stays. A worker runs one variant at a time, whatever its thread
count, with the CPU threads of its host shared among the host's workers. The child dies with its
worker; the scheduler then runs the task again on another worker (up to Dask's
``distributed.scheduler.allowed-failures``), where the command resumes from the variant's last
checkpoint. Each attempt writes a line naming its worker into the variant's ``output.log``.

The workers must see the manifest, the data and the runs folder at the same paths as this process
(a shared filesystem on a real cluster), and have lmlab and the variants' plugins installed. A
variant with a GPU (``[parallel] accelerator = "gpu"``) asks for ``devices`` of the workers'
``GPU`` resource (``dask worker --resources "GPU=4"``); its parallel plugin starts the processes on
that node as it does on one machine. A variant over several nodes is for ``--executor slurm``.
"""

import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import replace

from lmlab.api import JobOutcome, UserError, VariantJob, run_job, usable_cores
from lmlab.api.executor import Terminated
from lmlab_dask.cluster import Cluster

STOP_GRACE_S = 120.0  # how long stopped variants get to write their checkpoint

_one_variant = threading.Lock()  # in a worker process: its variants one after another
_running: dict[str, int] = {}  # in a worker process: variant → its command's pid
_stopped: set[str] = set()  # in a worker process: the sweeps told to stop


def train(job: VariantJob, sweep: str, workers_per_host: dict[str, int]) -> JobOutcome:
    """The task: run ``job``'s command on this worker (its output appended to the variant's log)."""
    from distributed import get_worker

    worker = get_worker().address
    host = socket.gethostname()
    with _one_variant:
        if sweep in _stopped:  # queued behind another variant when the sweep was stopped
            return JobOutcome(None, host, None, worker)
        threads = str(max(1, usable_cores() // max(1, workers_per_host.get(_host_of(worker), 1))))
        job.run_dir.mkdir(parents=True, exist_ok=True)
        with open(job.log, "ab") as log:
            log.write(f"[lmlab-dask {sweep}] {time.strftime('%Y-%m-%dT%H:%M:%S')} {job.name} on worker {worker} "
                      f"(host {host}, {threads} thread(s))\n".encode())
        job = replace(job, env={**job.env, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
        try:
            outcome = run_job(job, on_start=lambda pid: _running.__setitem__(job.name, pid))
        finally:
            _running.pop(job.name, None)
    return replace(outcome, worker=worker)


def stop_running(sweep: str) -> list[str]:
    """In a worker process: SIGTERM to each variant's command (it checkpoints and exits 143); the
    sweep's tasks still waiting here will not start. The names of those that were running."""
    _stopped.add(sweep)
    for pid in list(_running.values()):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    return list(_running)


def _host_of(address: str) -> str:
    return address.rsplit("://", 1)[-1].rsplit(":", 1)[0]


class Sweep:
    def __init__(self, scheduler: str | None, parallel: int | None, jobs: list[VariantJob]):
        self.jobs, self.parallel = jobs, parallel
        # A local cluster: one single-threaded worker per variant running at once.
        self.cluster = Cluster(scheduler, parallel or min(len(jobs), usable_cores()))
        self.token = uuid.uuid4().hex[:8]
        self._names: dict[str, VariantJob] = {}  # task key → its job

    def start(self) -> None:
        for job in self.jobs:
            if job.nodes > 1:
                raise UserError("a variant over several nodes cannot run as one Dask task; use --executor slurm",
                                key=f"{job.name}: parallel.num_nodes")
        self.cluster.connect()
        workers = self.cluster.workers()
        gpus = max((w.get("resources", {}).get("GPU", 0) for w in workers.values()), default=0)
        for job in self.jobs:
            if job.accelerator == "gpu" and job.devices > gpus:
                raise UserError(f"needs {job.devices} GPU(s) on one worker, and no worker of the cluster declares "
                                f"that many (start them with: dask worker ADDRESS --resources \"GPU={job.devices}\")",
                                key=f"{job.name}: parallel.devices")

    def run(self, say, report) -> dict[str, JobOutcome]:
        from distributed import as_completed
        from distributed.scheduler import KilledWorker

        client = self.cluster.connect()
        hosts: dict[str, int] = {}
        for address in self.cluster.workers():
            hosts[_host_of(address)] = hosts.get(_host_of(address), 0) + 1
        say(f"dask: {sum(hosts.values())} worker(s) at {client.scheduler.address}"
            + (f", dashboard {self.cluster.dashboard()}" if self.cluster.dashboard() else ""))
        pending, outcomes = list(self.jobs), {}
        futures = as_completed()
        names = self._names

        def submit(job: VariantJob) -> None:
            resources = {"GPU": job.devices} if job.accelerator == "gpu" else None
            future = client.submit(train, job, self.token, hosts, key=f"lmlab-{job.name}-{self.token}", pure=False,
                                   resources=resources)
            names[future.key] = job
            futures.add(future)
            report(job.name, state="submitted", worker="", sweep=self.token)

        limit = self.parallel or len(pending)
        try:
            while pending and futures.count() < limit:
                submit(pending.pop(0))
            for future in futures:
                job = names[future.key]
                try:
                    outcome = future.result()
                except KilledWorker as exc:  # lost with its worker more often than the scheduler retries
                    outcome = JobOutcome(None)
                    say(f"[{job.name}] lost with its worker more often than Dask retries ({exc}); running the "
                        "same command again resumes it")
                outcomes[job.name] = outcome
                report(job.name, host=outcome.host, pid=outcome.pid, worker=outcome.worker,
                       returncode=outcome.returncode, attempts=self._attempts(job))
                if pending:
                    submit(pending.pop(0))
        except (KeyboardInterrupt, Terminated):
            self._stop(client, futures)
            raise
        return outcomes

    def _attempts(self, job: VariantJob) -> int:
        try:
            text = job.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return 0
        return text.count(f"[lmlab-dask {self.token}]")

    def _stop(self, client, futures) -> None:
        # Each running variant checkpoints and ends as interrupted; queued ones never start.
        running = {name for names in client.run(stop_running, self.token).values() for name in names}
        for future in list(futures.futures):
            if self._names[future.key].name not in running:
                future.cancel()
        deadline = time.monotonic() + STOP_GRACE_S
        for future in list(futures.futures):
            if not future.done():
                try:
                    future.result(timeout=max(0.1, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - cancelled or failed: nothing more to wait for
                    future.cancel()

    def close(self) -> None:
        self.cluster.close()
