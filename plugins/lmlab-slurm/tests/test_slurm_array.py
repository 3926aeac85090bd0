"""``lmlab run --executor slurm`` without SLURM: the array submitit builds (read from the script a stand-in
``sbatch`` receives), and a sweep on submitit's local executor whose variant is preempted (USR2, as
SLURM signals) checkpoints, is requeued and resumes to the numbers of an uninterrupted run."""

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

MANIFEST = tiny_toml("tiny.txt", name="slurm-sweep", steps=24, eval_every=12, checkpoint_every=4, sample_tokens=0) + """
[sweep]
"attention.use" = ["mha", "mqa"]
"""
VARIANTS = ["attention.use=mha", "attention.use=mqa"]
NUMBERS = ("val_loss", "train_loss", "steps", "params", "status")
# Stands in for sbatch: keeps the script it is given and answers as sbatch does.
FAKE_SBATCH = """#!/bin/sh
cp "$1" "$(dirname "$0")/submitted-$(date +%s%N).sh"
echo "Submitted batch job 4242"
"""


@pytest.fixture
def sweep(tmp_path) -> Path:
    (tmp_path / "tiny.txt").write_text(CORPUS.read_text()[:60_000])
    path = tmp_path / "sweep.toml"
    path.write_text(MANIFEST)
    return path


def numbers(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    return {k: summary[k] for k in NUMBERS}


def test_the_array_has_one_task_per_variant_with_the_resources_of_its_parallel_table(sweep, tmp_path):
    gpus = '[parallel]\nuse = "ddp"\ndevices = 2\naccelerator = "gpu"\n'
    sweep.write_text(MANIFEST.replace("[sweep]\n", f'{gpus}\n[sweep]\nseeds = [1, 2]\n'))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # only looked for: the script runs srun on a node
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).chmod(0o755)
    out = tmp_path / "runs"
    done = run_cli("run", str(sweep), "--out", str(out), "--executor", "slurm", "--jobs", "3",
                   "--slurm", "partition=gpu", "--slurm", "timeout_min=30", "--slurm", "wait=false",
                   "--slurm", 'setup=["module load cuda"]',
                   env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr[-3000:]
    (script,) = bin_dir.glob("submitted-*.sh")  # one array for the four variants (one launch shape)
    lines = set(script.read_text().splitlines())
    for flag in ("--array=0-3%3", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2", "--partition=gpu",
                 "--time=30", "--signal=USR2@90", "--requeue", "--job-name=lmlab-runs"):
        assert f"#SBATCH {flag}" in lines, (flag, sorted(lines))
    assert "module load cuda" in lines
    assert any(line.startswith("srun ") and "submitit.core._submit" in line for line in lines)

    # Nothing ran here; each variant's job is recorded, and --status shows it queued.
    jobs = json.loads((out / "sweep.json").read_text())["jobs"]
    variants = [f"{v},seed={s}" for v in VARIANTS for s in (1, 2)]
    assert {name: job["job_id"] for name, job in jobs.items()} == {v: f"4242_{i}" for i, v in enumerate(variants)}
    assert not any((out / v / "summary.json").exists() for v in variants)
    assert "left running on the slurm executor" in done.stderr
    status = run_cli("run", str(sweep), "--out", str(out), "--status")
    assert status.returncode == 0, status.stderr
    rows = {line.split()[0]: line for line in status.stdout.splitlines()[1:]}
    assert all(rows[v].split()[1] == "queued" and f"job 4242_{i}" in rows[v] for i, v in enumerate(variants))


@pytest.mark.slow  # two tiny variants on submitit's local executor, one preempted and requeued: about 40 s
def test_a_preempted_variant_checkpoints_is_requeued_and_resumes_to_an_uninterrupted_run_s_numbers(sweep, tmp_path):
    psutil = pytest.importorskip("psutil")
    reference = run_cli("run", str(sweep), "--out", str(tmp_path / "reference"), "--only", VARIANTS[0])
    assert reference.returncode == 0, reference.stderr[-3000:]
    out = tmp_path / "runs"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "lmlab", "run", str(sweep), "--out", str(out), "--executor", "slurm",
                             "--jobs", "2", "--slurm", "cluster=local"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    victim = out / VARIANTS[0]
    try:
        deadline = time.monotonic() + 300
        while not (victim / "checkpoints" / "last.ckpt").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        holder = json.loads((victim / ".lmlab.lock").read_text())
        task = psutil.Process(holder["pid"]).parent()  # submitit's task process, which SLURM signals
        assert "submitit" in " ".join(task.cmdline())
        task.send_signal(signal.SIGUSR2)
        _, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    assert numbers(victim) == numbers(tmp_path / "reference" / VARIANTS[0])
    assert numbers(out / VARIANTS[1])["status"] == "completed"
    log = (victim / "output.log").read_text()
    assert log.count("[lmlab-slurm]") == 2  # the first attempt and the requeued one
    steps = [json.loads(line)["step"] for line in (victim / "metrics.jsonl").read_text().splitlines()
             if "train_loss" in line]
    assert steps == sorted(set(steps)) and steps[-1] == 24  # resumed from its checkpoint: no step twice
    job = json.loads((out / "sweep.json").read_text())["jobs"][VARIANTS[0]]
    assert job["attempts"] == 2 and job["returncode"] == 0


@pytest.mark.parametrize("args, key, says", [
    (("--slurm", "nosuch=1"), "--slurm.nosuch", "unknown option of plugin 'slurm'"),
    (("--slurm", "timeout_min=soon"), "--slurm.timeout_min", "soon"),
    (("--slurm", "partition"), "--slurm", "expected KEY=VALUE"),
    ((), "--executor", "no SLURM here (sbatch and srun not on PATH)"),
])
def test_bad_slurm_input_is_one_line_and_exit_2_with_nothing_submitted(sweep, tmp_path, args, key, says):
    out = tmp_path / "runs"
    line = refused(run_cli("run", str(sweep), "--out", str(out), "--executor", "slurm", *args,
                           env={"PATH": os.path.dirname(sys.executable)}), key)
    assert says in line
    assert not out.exists()


@pytest.mark.slow  # a two-variant sweep through submitit's local executor and here: about 20 s
def test_the_slurm_executor_on_submitit_s_local_cluster_passes_the_executor_kit():
    from lmlab.testing import check_executor
    from lmlab_slurm.executor import Slurm

    check_executor(Slurm, {"cluster": "local"})


# Installed through PYTHONPATH in the subprocess: submitit looks uninstalled, whatever this environment holds.
BLOCKER = """
import sys

class _NoSubmitit:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "submitit":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoSubmitit())
"""


def test_without_submitit_the_slurm_executor_is_one_line_naming_the_distribution(sweep, tmp_path):
    site = tmp_path / "no-submitit"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    out = tmp_path / "runs"
    line = refused(run_cli("run", str(sweep), "--out", str(out), "--executor", "slurm", "--slurm", "cluster=local",
                           env={"PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}),
                   "--executor")
    assert "submitit cannot be imported" in line and "pip install lmlab-slurm" in line
    assert not out.exists()
