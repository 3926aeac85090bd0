"""One live run per run folder: a second `lmlab run` into a folder that a live run holds is refused
(exit 2, naming the holder), with or without --overwrite, and the first run ends intact; a lock left
by a killed run is taken over; `--jobs` hands each child its variant's lock."""

import json
import os
import signal
import subprocess
import sys

import pytest

from lmlab.errors import UserError
from lmlab.train.lock import NAME, RunLock
from support import logged_steps, run_cli, start_cli, wait_for

STEPS = 400


@pytest.fixture
def long_manifest(tiny_manifest):
    return tiny_manifest(steps=STEPS, eval_every=100, checkpoint_every=10)


def started(manifest, out):
    """(its command line, a run of it that has written its first checkpoint, its folder)."""
    args = ("run", str(manifest), "--out", str(out), "--set", "train.sample_tokens=0")
    proc = start_cli(*args)
    run_dir = out / "default"
    wait_for(lambda: (run_dir / "checkpoints" / "last.ckpt").is_file(), proc, what="the first checkpoint")
    return args, proc, run_dir


def test_a_second_live_run_into_the_same_folder_is_refused_and_the_first_ends_intact(long_manifest, tmp_path):
    args, first, run_dir = started(long_manifest, tmp_path / "runs")
    first.send_signal(signal.SIGSTOP)  # still alive, still holding the folder, however fast it trains
    try:
        for extra in ((), ("--overwrite",)):
            second = run_cli(*args, *extra)
            assert second.returncode == 2, second.stderr
            assert "Traceback" not in second.stderr
            (line,) = [line for line in second.stderr.splitlines() if line.startswith("lmlab: error:")]
            assert f"{run_dir}: is in use by another live run" in line and f"pid {first.pid} " in line
            assert (run_dir / "checkpoints" / "last.ckpt").is_file()  # --overwrite deleted nothing
    finally:
        first.send_signal(signal.SIGCONT)

    assert first.wait(timeout=600) == 0, first.stderr.read()[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert logged_steps(run_dir / "metrics.jsonl") == list(range(2, STEPS + 1, 2))  # written by one run alone
    final = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert final.get("final") is True
    assert not (run_dir / NAME).exists()  # released with the run


def test_the_lock_of_a_killed_run_is_taken_over_and_the_run_resumes(long_manifest, tmp_path):
    args, first, run_dir = started(long_manifest, tmp_path / "runs")
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert json.loads((run_dir / NAME).read_text())["pid"] == first.pid  # left behind, but nobody holds it

    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"taking over the lock of a run that is no longer alive (pid {first.pid} " in again.stderr
    assert "(resuming)" in again.stderr
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


def test_a_held_lock_refuses_another_holder_and_is_released(tmp_path):
    held = RunLock(tmp_path / "run").acquire()
    info = json.loads((tmp_path / "run" / NAME).read_text())
    assert info["pid"] == os.getpid() and info["host"]
    with pytest.raises(UserError, match=f"is in use by another live run \\(pid {os.getpid()} "):
        RunLock(tmp_path / "run").acquire()  # another open file: flock conflicts even in this process
    held.release()
    assert not (tmp_path / "run" / NAME).exists()
    again = RunLock(tmp_path / "run").acquire()
    assert again.took_over is None  # released cleanly: nothing stale to take over
    again.release()


def test_a_stale_lock_file_is_taken_over_naming_its_old_holder(tmp_path):
    (tmp_path / "run").mkdir()
    stale = {"host": "elsewhere", "pid": 1, "started": "2026-01-01", "command": "lmlab run old.toml"}
    (tmp_path / "run" / NAME).write_text(json.dumps(stale))
    lock = RunLock(tmp_path / "run").acquire()
    assert lock.took_over == stale
    assert json.loads((tmp_path / "run" / NAME).read_text())["pid"] == os.getpid()
    lock.release()


ADOPT = ("import sys; from pathlib import Path; from lmlab.train.lock import RunLock\n"
         "try:\n    RunLock(Path(sys.argv[1])).acquire(); print('held')\n"
         "except Exception as exc:\n    print('refused:', exc)\n")


def test_a_child_given_the_lock_holds_it_and_a_stranger_is_refused(tmp_path):
    lock = RunLock(tmp_path / "run").acquire()
    try:
        env, fd = lock.handoff_env()
        child = subprocess.run([sys.executable, "-c", ADOPT, str(tmp_path / "run")], capture_output=True, text=True,
                               env={**os.environ, **env}, pass_fds=(fd,))
        stranger = subprocess.run([sys.executable, "-c", ADOPT, str(tmp_path / "run")], capture_output=True, text=True)
        other_folder = subprocess.run([sys.executable, "-c", ADOPT, str(tmp_path / "elsewhere")], capture_output=True,
                                      text=True, env={**os.environ, **env}, pass_fds=(fd,))
    finally:
        lock.release()
    assert child.stdout.strip() == "held", child.stderr
    assert stranger.stdout.startswith("refused:") and f"pid {os.getpid()} " in stranger.stdout
    assert other_folder.stdout.strip() == "held"  # the handed lock is for its own folder only, not a pass
