"""``lmlab run --executor dask``: a sweep's variants as tasks on a local Dask cluster of two worker
processes run on the workers, survive a worker killed mid-variant (its task runs again elsewhere and
resumes from the checkpoint) and give the numbers ``--jobs 2`` gives."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CORPUS, tiny_toml
from support import refused, run_cli

pytestmark = pytest.mark.exclusive  # several processes at once

SWEEP = '[sweep]\n"attention.use" = ["mha", "mqa"]\nseeds = [1, 2]\n'
VARIANTS = ["attention.use=mha,seed=1", "attention.use=mha,seed=2", "attention.use=mqa,seed=1",
            "attention.use=mqa,seed=2"]
# What must not depend on where a variant ran.
NUMBERS = ("val_loss", "val_ppl", "train_loss", "steps", "params", "trainable_params", "status")


MANIFEST = tiny_toml("tiny.txt", name="dask-sweep", steps=24, eval_every=12, checkpoint_every=4, sample_tokens=0)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dask-sweep")
    (root / "tiny.txt").write_text(CORPUS.read_text()[:60_000])
    path = root / "sweep.toml"
    path.write_text(MANIFEST + SWEEP)
    return path


@pytest.fixture(scope="module")
def local_results(sweep) -> dict:
    """The reference: the same sweep with the local executor, two variants at a time."""
    out = sweep.parent / "local"
    done = run_cli("run", str(sweep), "--out", str(out), "--jobs", "2", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {v: numbers(out / v) for v in VARIANTS}


def numbers(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    return {k: summary[k] for k in NUMBERS}


@pytest.mark.slow  # two sweeps of four tiny variants, two at a time, one worker killed: about a minute
def test_a_sweep_on_two_dask_workers_survives_a_killed_worker_and_gives_the_local_executor_s_numbers(
        sweep, local_results):
    psutil = pytest.importorskip("psutil")
    out = sweep.parent / "dask"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sweep_proc = subprocess.Popen([sys.executable, "-m", "lmlab", "run", str(sweep), "--out", str(out), "--executor",
                                   "dask", "--jobs", "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)
    victim = out / VARIANTS[0]
    try:
        deadline = time.monotonic() + 300
        while not (victim / "checkpoints" / "last.ckpt").is_file():
            assert sweep_proc.poll() is None and time.monotonic() < deadline, sweep_proc.communicate()[1][-3000:]
            time.sleep(0.05)
        holder = json.loads((victim / ".lmlab.lock").read_text())  # the variant's own process
        worker = psutil.Process(holder["pid"]).parent()  # the Dask worker that runs it
        assert "lmlab" not in " ".join(worker.cmdline()[1:3])
        worker.send_signal(signal.SIGKILL)  # mid-variant: its task runs again elsewhere and resumes
        _, stderr = sweep_proc.communicate(timeout=600)
    finally:
        if sweep_proc.poll() is None:
            os.killpg(sweep_proc.pid, signal.SIGKILL)
            sweep_proc.wait()
    assert sweep_proc.returncode == 0, stderr[-3000:]
    assert {v: numbers(out / v) for v in VARIANTS} == local_results
    steps = [json.loads(line)["step"] for line in (victim / "metrics.jsonl").read_text().splitlines()
             if "train_loss" in line]
    assert steps == sorted(set(steps)) and steps[-1] == 24  # resumed from its checkpoint: no step twice

    index = json.loads((out / "sweep.json").read_text())
    assert index["executor"] == "dask" and index["variants"] == VARIANTS
    jobs = index["jobs"]
    assert sorted(jobs) == VARIANTS
    assert all(job["worker"].startswith("tcp://") for job in jobs.values())
    assert len({job["worker"] for job in jobs.values()}) >= 2  # both workers trained
    pids = {job["pid"] for job in jobs.values()}
    assert len(pids) == 4 and os.getpid() not in pids and holder["pid"] not in pids
    assert {v: job["attempts"] for v, job in jobs.items()} == {v: 2 if v == VARIANTS[0] else 1 for v in VARIANTS}
    assert all(job["returncode"] == 0 and job["state"] == "done" for job in jobs.values())
    for variant, job in jobs.items():
        log = (out / variant / "output.log").read_text()
        assert f"{variant} on worker {job['worker']}" in log  # the attempt's line, written on the worker

    # Run again: every variant is skipped; --status reads the folders and the index.
    again = run_cli("run", str(sweep), "--out", str(out), "--executor", "dask", "--jobs", "2")
    assert again.returncode == 0 and again.stderr.count("already completed; skipped") == 4, again.stderr[-2000:]
    status = run_cli("run", str(sweep), "--out", str(out), "--status")
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[0].endswith("4 variant(s), executor dask")
    for variant in VARIANTS:
        (line,) = [x for x in lines if x.split() and x.split()[0] == variant]
        assert line.split()[1] == "completed" and f"val_loss {local_results[variant]['val_loss']:.4f}" in line


@pytest.mark.parametrize("args, key, says", [
    (("--executor", "dask", "--scheduler", "tcp://127.0.0.1:9"), "--scheduler",
     "cannot reach the Dask scheduler at 'tcp://127.0.0.1:9'"),
    (("--scheduler", "tcp://127.0.0.1:9"), "--scheduler", "needs --executor dask"),
    (("--executor", "dask", "--slurm", "partition=gpu"), "--slurm", "the dask executor takes no --slurm options"),
    (("--executor", "kubernetes"), "--executor", "plugin 'kubernetes' is not installed for slot 'executor'"),
])
def test_an_executor_that_cannot_be_used_is_one_line_and_exit_2_with_nothing_started(sweep, tmp_path, args, key,
                                                                                       says):
    out = tmp_path / "out"
    line = refused(run_cli("run", str(sweep), "--out", str(out), *args, timeout=120), key)
    assert says in line
    assert not out.exists()  # no sweep index, no variant folder


@pytest.mark.slow  # one variant of two DDP processes on one Dask worker: about 20 s
def test_a_variant_of_two_processes_runs_them_both_from_its_one_task(tmp_path):
    (tmp_path / "tiny.txt").write_text(CORPUS.read_text()[:60_000])
    ddp = '[parallel]\nuse = "ddp"\ndevices = 2\naccelerator = "cpu"\n'
    (tmp_path / "ddp.toml").write_text(MANIFEST.replace("max_steps = 24", "max_steps = 4") + ddp)
    out = tmp_path / "runs"
    done = run_cli("run", str(tmp_path / "ddp.toml"), "--out", str(out), "--executor", "dask", "--jobs", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "default" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["steps"] == 4
    job = json.loads((out / "sweep.json").read_text())["jobs"]["default"]
    assert job["returncode"] == 0 and job["worker"].startswith("tcp://")

