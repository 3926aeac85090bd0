"""watchdog against a data source that never delivers: the run fails as a hang, and the stacks it
writes name the function the data source waits in; a healthy run is left alone and leaves no thread
behind; "wait" only warns, again after each further timeout."""

import json
import threading
import time
from typing import Literal

import pytest

from lmlab.api import DataOptions, DataSource, Field, RunFailed, hookimpl
from lmlab.testing.runs import main
from lmlab.testing.runs import load_variant, run_variant
from lmlab_monitors.watchdog import Watchdog, WatchdogOptions
from lmlab.testing import stand_in_run


def wait_for_remote_shard(seconds: float = 60.0) -> None:
    """A read from a server that never answers, in short sleeps so that an interrupt gets through."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    raise TimeoutError("the remote shard never came")


def wait_for_remote_lock() -> None:
    """A wait in C, without a timeout (a lock no one releases): Python code never runs again in it."""
    threading.Event().wait()


class BlockingOptions(DataOptions):
    how: Literal["sleep", "lock"] = Field("sleep", help="where the source blocks")


class BlockingSource(DataSource):
    """Blocks in its first document; never named in a manifest (a test's stand-in)."""

    Options = BlockingOptions
    name = "blocking-test"
    yields_records = False

    def documents(self):
        if self.options.how == "lock":
            wait_for_remote_lock()
        else:
            wait_for_remote_shard()
        yield "never reached"


def _watchdog_thread_alive() -> bool:
    return any(t.name.startswith("lmlab-watchdog") for t in threading.enumerate())


def _blocked_variant(tiny_manifest, how: str):
    path = tiny_manifest('\n[monitor]\nuse = ["watchdog"]\n\n[monitor.watchdog]\n'
                         'startup_timeout_s = 2.0\ntimeout_s = 2.0\n')
    variant = load_variant(path)
    return variant.with_plugin("data", BlockingSource, BlockingSource.Options(how=how))


def test_a_blocked_data_source_fails_as_a_hang_naming_the_function(tiny_manifest, tmp_path, capfd):
    variant = _blocked_variant(tiny_manifest, "sleep")
    run_dir = tmp_path / "runs" / "default"
    started = time.monotonic()
    with pytest.raises(RunFailed) as failed:
        run_variant(variant, run_dir)
    assert time.monotonic() - started < 30  # the 60 s wait was cut short
    diagnosis = failed.value.diagnosis
    assert diagnosis.kind == "hang"
    assert "before its first step" in diagnosis.cause
    assert diagnosis.evidence[0].startswith("no step completed for 2")
    assert diagnosis.evidence[0].endswith(" s since the run started")
    assert "in wait_for_remote_shard" in diagnosis.evidence[1]  # the innermost frame comes first
    assert any("in documents" in e for e in diagnosis.evidence)
    stacks = run_dir / "stacks-0.txt"
    assert diagnosis.evidence[-1] == f"every thread's stack: {stacks}"
    text = stacks.read_text()
    assert "wait_for_remote_shard" in text
    assert "wait_for_remote_shard" in capfd.readouterr().err  # the log has the stacks too
    fix_keys = [f.key for f in diagnosis.fixes]
    assert "monitor.watchdog.startup_timeout_s" in fix_keys
    assert not _watchdog_thread_alive()


def test_the_early_summary_records_the_hang(tiny_manifest, tmp_path):
    """summary.json of a run that hung before its first step: failed, with the hang diagnosis."""
    variant = _blocked_variant(tiny_manifest, "sleep")
    run_dir = tmp_path / "runs" / "default"
    with pytest.raises(RunFailed):
        run_variant(variant, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["diagnosis"]["kind"] == "hang"
    assert any("wait_for_remote_shard" in e for e in summary["diagnosis"]["evidence"])


def test_a_source_blocked_in_c_is_interrupted_too(tiny_manifest, tmp_path):
    """fail() alone lands only when the main thread runs Python again: the watchdog's SIGINT wakes a
    lock wait that has no timeout."""
    variant = _blocked_variant(tiny_manifest, "lock")
    run_dir = tmp_path / "runs" / "default"
    started = time.monotonic()
    with pytest.raises(RunFailed) as failed:
        run_variant(variant, run_dir)
    assert time.monotonic() - started < 30
    assert failed.value.diagnosis.kind == "hang"
    assert any("in wait_for_remote_lock" in e for e in failed.value.diagnosis.evidence)
    assert "wait_for_remote_lock" in (run_dir / "stacks-0.txt").read_text()
    assert not _watchdog_thread_alive()


def wait_for_allreduce() -> None:
    """A collective whose peer never arrives, in short sleeps."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)


class HangAtStep:
    """Blocks the training loop after optimizer step ``step``."""

    def __init__(self, step: int):
        self.step = step

    @hookimpl
    def lmlab_train_batch_end(self, step):
        if step == self.step:
            wait_for_allreduce()


def test_a_hang_in_training_fails_the_run_with_its_summary(tiny_manifest, tmp_path):
    path = tiny_manifest('\n[monitor]\nuse = ["watchdog"]\n\n[monitor.watchdog]\ntimeout_s = 2.0\n', steps=6)
    variant = load_variant(path)
    run_dir = tmp_path / "runs" / "default"
    with pytest.raises(RunFailed) as failed:
        run_variant(variant, run_dir, extra_hooks=[HangAtStep(2)])
    diagnosis = failed.value.diagnosis
    assert diagnosis.kind == "hang" and "after step 2" in diagnosis.cause
    assert any("in wait_for_allreduce" in e for e in diagnosis.evidence)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 2
    assert summary["diagnosis"]["kind"] == "hang"
    assert summary["watchdog_hangs"] == 1
    assert "wait_for_allreduce" in (run_dir / "stacks-0.txt").read_text()
    assert not _watchdog_thread_alive()


def test_a_healthy_run_completes_and_leaves_no_thread(tiny_manifest, tmp_path):
    path = tiny_manifest('\n[monitor]\nuse = ["watchdog"]\n\n[monitor.watchdog]\ntimeout_s = 60.0\n')
    assert main(["run", str(path), "--out", str(tmp_path / "runs")]) == 0
    run_dir = tmp_path / "runs" / "default"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert "watchdog_hangs" not in summary
    assert not (run_dir / "stacks-0.txt").exists()
    assert not _watchdog_thread_alive()


class FakeControl:
    def __init__(self, run_dir, max_steps: int = 100):
        self.run_dir, self.rank, self.is_main = run_dir, 0, True
        self.run = stand_in_run(train={"max_steps": max_steps})
        self.notes: list[str] = []
        self.failures: list = []

    def note(self, text: str) -> None:
        self.notes.append(text)

    def fail(self, diagnosis) -> None:
        self.failures.append(diagnosis)


def test_wait_mode_warns_again_after_each_timeout_and_never_fails(tmp_path, capfd):
    control = FakeControl(tmp_path / "run")
    dog = Watchdog(WatchdogOptions(timeout_s=0.3, startup_timeout_s=0.3, action="wait"))
    dog.lmlab_run_start(control=control)
    time.sleep(1.05)  # three limits without a step: three reports, one per full timeout
    assert 2 <= len(control.notes) <= 4, control.notes
    assert all(n.startswith("watchdog: no step completed for ") and "since the run started" in n
               for n in control.notes)
    assert "in test_wait_mode_warns_again_after_each_timeout_and_never_fails" in control.notes[0]
    stacks = (tmp_path / "run" / "stacks-0.txt").read_text()
    assert stacks.count("=== ") == len(control.notes)  # each report appended to the file
    # Steps resume: no more reports while they keep coming within the limit.
    before = len(control.notes)
    for step in range(1, 11):
        dog.lmlab_train_batch_end(step=step)
        time.sleep(0.05)
    assert len(control.notes) == before
    assert control.failures == []
    assert dog.lmlab_run_end() == {"watchdog_hangs": before}
    assert not _watchdog_thread_alive()
    assert "since the run started" in capfd.readouterr().err


def test_the_limit_after_the_first_step_is_timeout_s(tmp_path):
    control = FakeControl(tmp_path / "run")
    dog = Watchdog(WatchdogOptions(timeout_s=0.2, startup_timeout_s=30.0, action="stop"))
    dog.lmlab_run_start(control=control)
    dog.lmlab_train_batch_end(step=1)
    deadline = time.monotonic() + 5
    while not control.failures and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.lmlab_run_end()
    (diagnosis,) = control.failures
    assert diagnosis.kind == "hang" and "after step 1" in diagnosis.cause
    assert diagnosis.evidence[0].startswith("no step completed for 0.")
    assert diagnosis.evidence[0].endswith(" s since step 1")
    assert diagnosis.fixes[-1].key == "monitor.watchdog.timeout_s" and diagnosis.fixes[-1].value == 0.4
    assert not _watchdog_thread_alive()


@pytest.mark.parametrize("option", ["timeout_s", "startup_timeout_s"])
def test_limits_must_be_positive(tiny_manifest, capsys, option):
    path = tiny_manifest(f'\n[monitor]\nuse = ["watchdog"]\n\n[monitor.watchdog]\n{option} = 0.0\n')
    assert main(["check", str(path)]) == 2
    assert f"monitor.watchdog.{option}" in capsys.readouterr().err
