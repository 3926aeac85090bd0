"""The executor slot (API 1.22): where ``lmlab run``'s variants and ``lmlab prepare``'s tasks run.

``lmlab run MANIFEST --executor NAME`` and ``lmlab prepare MANIFEST --executor NAME`` name an
executor on the command line, not in the manifest: where a sweep runs changes nothing it trains. The
core's own executor, ``local``, is the default (child processes of this one, ``--jobs N`` at once);
plugins add others (first-party: ``dask`` in lmlab-dask, ``slurm`` in lmlab-slurm).

The core plans a sweep (what to skip, resume or start), then hands the executor one
[VariantJob][lmlab.api.executor.VariantJob] per variant to train: an ordinary ``lmlab run ... --only
VARIANT`` command line. Running it again is how a variant resumes (from its last checkpoint), so an
executor that loses a job (a dead worker, a preempted node) only has to run its command again.
[run_job][lmlab.api.executor.run_job] runs one where it is called; executors call it on their
workers.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Mapping

from lmlab.api.options import Options
from lmlab.api.plugin import Plugin
from lmlab.signals import Terminated  # noqa: F401 - what SIGTERM raises in lmlab's main thread


@dataclass(frozen=True)
class VariantJob:
    """One variant of a sweep to train: a self-contained command and what it needs."""

    name: str
    """The variant's name, which is its folder's."""
    argv: tuple[str, ...]
    """The ``lmlab`` arguments that train it (``run MANIFEST --out OUT --set=... --only NAME``), with
    absolute paths: it runs on any machine that sees the same files."""
    run_dir: Path
    """The variant's run folder."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables to set for the command besides the worker's own (thread counts); never a secret."""
    devices: int = 1
    """Processes per node its parallel plugin runs (``[parallel] devices``; 1 for one device)."""
    nodes: int = 1
    """Nodes it runs on (``[parallel] num_nodes``)."""
    accelerator: str = "cpu"
    """``"cpu"`` or ``"gpu"``: whether each of its processes needs a GPU."""
    action: str = "start"
    """What the plan found: ``"start"``, ``"resume"`` or ``"restart"``."""

    @property
    def log(self) -> Path:
        """Where the command's output goes (appended: a resumed variant's follows the earlier)."""
        return self.run_dir / "output.log"

    @property
    def processes(self) -> int:
        """The processes of the whole variant (``devices × nodes``)."""
        return self.devices * self.nodes


@dataclass(frozen=True)
class JobOutcome:
    """How one run of a job's command ended, and where it ran."""

    returncode: int | None
    """The command's exit status (0 completed; 143 SIGTERM, resumable; None: it never ran)."""
    host: str = ""
    pid: int | None = None
    """The command's process, on ``host``."""
    worker: str = ""
    """The executor's name for where it ran (a Dask worker's address, a SLURM job id)."""


@dataclass(frozen=True)
class PluginSpec:
    """A plugin as a worker process rebuilds it: the class (pickled by reference) and its options."""

    cls: type
    name: str
    options: Options

    def build(self):
        """A new instance, with ``name`` set as discovery sets it (a worker imports the class afresh)."""
        self.cls.name = self.name
        return self.cls(self.options)


@dataclass(frozen=True)
class PreparationKit:
    """What a preparation's tasks are made of, handed to [Executor.preparation][lmlab.api.executor.Executor.preparation]:
    classes a pool sends to its workers by reference (pickled as their import path), so an executor
    runs the core's tasks without importing the core."""

    worker: type
    """The task runner: ``worker(filters)``, a list of [PluginSpec][lmlab.api.executor.PluginSpec],
    has the methods ``filter_chunk``, ``read_part``, ``write_part`` and ``tokenize_part``, each a pure
    function of its one argument; build one per worker process and keep it for later tasks."""
    read_task: type
    """``read_task(source, part, number, stage, conversations)``: a part of a source for a worker to
    read (``source`` a [PluginSpec][lmlab.api.executor.PluginSpec] of the data source)."""


class WorkerLost(Exception):
    """An executor's worker was lost with state no retry gives back (part of a partitioned
    deduplication index): the preparation resumes from its last checkpoint. One line for the user."""


#: ``report(name, **fields)``: an executor tells the core what became of a job (``state`` = "queued",
#: "running", "done", "lost"; ``host``, ``pid``, ``worker``, ``job_id``, ``attempt``), which the core
#: keeps in ``sweep.json`` for ``lmlab run --status``.
Report = Callable[..., None]


class Executor(Plugin):
    """Runs a sweep's variants (and, if it can, a preparation's tasks) somewhere.

    ``Options`` holds what the command line passes (``--scheduler`` is the ``scheduler`` option,
    ``--slurm KEY=VALUE`` sets option KEY), validated like any plugin's: a wrong key is one line
    naming it, exit 2, before anything starts.
    """

    slot: ClassVar[str] = "executor"
    api: ClassVar[str] = ">=1.22,<2"
    cli_options: ClassVar[str] = ""
    """The command-line flag whose KEY=VALUE pairs set this executor's options (``"--slurm"``), if any."""

    def start(self, parallel: int | None, jobs: list[VariantJob]) -> None:
        """Reach or start what runs ``jobs`` (a cluster, a scheduler's client), ``parallel`` at once
        (``--jobs``; None: not given, the executor's choice); raise ``UserError`` (exit 2, nothing
        started) when it cannot be reached or cannot run one of them. Called once, before
        ``run_variants``."""

    def run_variants(self, jobs: list[VariantJob], parallel: int | None, say: Callable[[str], None],
                     report: Report) -> dict[str, JobOutcome]:
        """Run every job's command, at most ``parallel`` at once, and return each one's last outcome
        by name; a job left out of the result was left running (a SLURM array not waited for: the
        command ends, ``lmlab run --status`` follows it, and running the command again once it ended
        compares). A job whose run was lost (a worker that died, a preempted node) is run again: its
        command resumes from the variant's last checkpoint. Runs on the main process; it may block
        until all end. SIGINT/SIGTERM to this process arrive as ``KeyboardInterrupt`` /
        ``lmlab.api.executor.Terminated``: stop the jobs (each writes a checkpoint on SIGTERM) and
        re-raise."""
        raise NotImplementedError

    def status(self, jobs: dict[str, dict]) -> dict[str, str]:
        """``lmlab run --status``: the executor's word on jobs ``sweep.json`` says it was given
        (name → what was recorded), e.g. a SLURM job's state; name → one line. Default: none."""
        return {}

    def preparation(self, workers: int, filters: list[PluginSpec], listener, kit: PreparationKit):
        """A pool that runs ``lmlab prepare``'s tasks, ``kit``'s, with ``filters`` (the interface of the
        core's local pool: ``start``, ``map``, ``close``, a context manager; see lmlab-dask), or None
        when this executor cannot prepare data. ``listener(event, info)`` takes progress events."""
        return None

    def close(self) -> None:
        """Release what ``start`` reached or started (a local cluster is stopped)."""


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a SLURM or container cpuset),
    not the machine's count, so that the threads an executor hands its jobs never outnumber them
    (API 1.23)."""
    from lmlab.cores import usable_cores as cores

    return cores()


def run_job(job: VariantJob, on_start: Callable[[int], None] | None = None, log: Path | None = None) -> JobOutcome:
    """Run ``job``'s command here, its output appended to ``log`` (default ``job.log``); returns how it
    ended.

    The command is a child process that dies with the calling thread (``PR_SET_PDEATHSIG`` on Linux):
    an executor's worker that is killed takes its variant down with it at once, so the folder's lock
    is free for the job's next attempt. A SIGTERM to this process is passed on to the child, which
    then checkpoints and exits with 143; so is a SIGINT. ``on_start(pid)`` is called once it runs.
    """
    job.run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **job.env}
    with open(log or job.log, "ab") as output:
        proc = subprocess.Popen([sys.executable, "-m", "lmlab", *job.argv], stdout=output, stderr=subprocess.STDOUT,
                                env=env, preexec_fn=_death_signal(), start_new_session=True)
    if on_start is not None:
        on_start(proc.pid)
    try:
        returncode = proc.wait()
    except BaseException:
        forward_stop(proc)
        raise
    return JobOutcome(returncode, socket.gethostname(), proc.pid)


def forward_stop(proc: subprocess.Popen, grace_s: float = 120.0) -> None:
    """Ask a running job's command to stop (SIGTERM: it checkpoints and exits 143) and wait for it;
    killed after ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _death_signal():
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)``, resolved here: between fork and exec (where threads may
    hold locks) the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
