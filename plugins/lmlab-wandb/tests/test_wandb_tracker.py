import json
import struct

import pytest

from lmlab.api import RunInfo, Tracker
from lmlab_wandb.wandb_tracker import WandbTracker

FAKE_KEY = "secret-abc123def456ghi789jkl012mno345pqr678"
PLUGINS = {"tracker": {"name": "wandb", "distribution": "lmlab-wandb", "version": "0.1.0"},
           "attention": {"name": "gqa", "distribution": "lmlab-attention", "version": "0.1.0"}}


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var.lower()))


ENVIRONMENT = {"lmlab": "0.1.0", "git": "abc123", "torch": "2.13.0", "lightning": "2.6.6", "device": "cpu"}


def info(run_dir, resume=False, **extra_config) -> RunInfo:
    flat = {"name": "ablation", "seed": 1, "model.n_layers": 2, "attention.use": "gqa",
            "attention.n_kv_heads": 2, "objective.use": "causal-lm", "variant": "attention.use=gqa", **extra_config}
    nested = {"name": "ablation", "seed": 1, "model": {"n_layers": 2},
              "attention": {"use": "gqa", "n_kv_heads": 2}, "objective": {"use": "causal-lm"}}
    return RunInfo(run_dir=run_dir, group="ablation", name="attention.use=gqa,seed=1", config=nested,
                   flat_config=flat, plugins=PLUGINS, resume=resume, variant="attention.use=gqa",
                   environment=ENVIRONMENT)


def run_once(run_dir, status="completed", resume=False, **extra_config):
    tracker = WandbTracker(WandbTracker.Options(tags=["test"]))
    tracker.start(info(run_dir, resume, **extra_config))
    tracker.log({"train_loss": 2.5, "lr": 1e-3}, step=1)
    tracker.finish({"val_loss": 1.25, "status": status}, status=status)


def records(path):
    """The protobuf records of an offline run's transaction log (``run-<id>.wandb``).

    The file is a ":W&B" header followed by a LevelDB-style log: 32 KiB blocks of records, each with
    a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last).
    """
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    i, pending = 7, b""
    while i + 7 <= len(data):
        if block - i % block < 7:  # a block's tail too short for a header is padding
            i += block - i % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[i:i + 7])
        if length == 0 and kind == 0:
            break
        pending += data[i + 7:i + 7 + length]
        i += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def of_type(path, kind):
    return [getattr(r, kind) for r in records(path) if r.WhichOneof("record_type") == kind]


def run_logs(run_dir, timeout=20.0):
    """The finished transaction logs under run_dir. W&B's service process writes them
    asynchronously and may still be flushing when ``finish`` returns: wait for each log's exit
    record (bounded), so reading never races the writer."""
    import time

    logs = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    deadline = time.monotonic() + timeout
    for log in logs:
        while not _finished(log) and time.monotonic() < deadline:
            time.sleep(0.05)
    return logs


def _finished(log) -> bool:
    try:
        return any(r.WhichOneof("record_type") == "exit" for r in records(log))
    except Exception:  # a record cut short mid-write
        return False


def test_wandb_tracker_options_default_to_an_offline_friendly_setup():
    assert issubclass(WandbTracker, Tracker)
    options = WandbTracker.Options()
    assert (options.project, options.entity, options.mode, options.tags) == ("lmlab", None, None, [])
    with pytest.raises(ValueError):
        WandbTracker.Options(mode="dryrun")


def test_offline_run_lands_in_run_dir_with_flat_config_plugins_metrics_and_summary(tmp_path):
    run_once(tmp_path, status="failed")
    (log,) = run_logs(tmp_path)
    run_id = (tmp_path / "wandb" / "run_id").read_text()
    assert log.name == f"run-{run_id}.wandb"

    (run,) = of_type(log, "run")
    assert (run.run_id, run.project, run.run_group, run.display_name, run.job_type) == (
        run_id, "lmlab", "ablation", "attention.use=gqa,seed=1", "causal-lm")
    assert list(run.tags) == ["test", "attention:gqa", "tracker:wandb"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    # Flat keys to group by, and the same tables nested.
    assert config["model.n_layers"] == 2 and config["attention.use"] == "gqa" and config["seed"] == 1
    assert config["attention"] == {"use": "gqa", "n_kv_heads": 2} and config["variant"] == "attention.use=gqa"
    assert config["plugins"] == PLUGINS and config["environment"] == ENVIRONMENT

    history = [{"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in h.item}
               for h in of_type(log, "history")]
    assert [(h["_step"], h["train_loss"]) for h in history] == [(1, 2.5)]
    summary = {u.key: json.loads(u.value_json) for s in of_type(log, "summary") for u in s.update if u.key}
    assert summary["val_loss"] == 1.25 and summary["status"] == "failed"
    assert [e.exit_code for e in of_type(log, "exit")] == [1]  # a failed run is marked failed


def test_resuming_in_the_same_run_dir_continues_the_same_wandb_run(tmp_path):
    run_once(tmp_path, status="interrupted")
    run_once(tmp_path, status="completed", resume=True)
    logs = run_logs(tmp_path)
    assert len(logs) == 2  # one offline folder per process start, ...
    ids = {run.run_id for log in logs for run in of_type(log, "run")}
    assert ids == {(tmp_path / "wandb" / "run_id").read_text()}  # ... but a single W&B run
    assert sorted(e.exit_code for log in logs for e in of_type(log, "exit")) == [0, 1]


def test_two_variants_in_one_process_are_two_runs(tmp_path):
    run_once(tmp_path / "a")
    run_once(tmp_path / "b")
    (a,), (b,) = run_logs(tmp_path / "a"), run_logs(tmp_path / "b")
    assert a.name != b.name
    assert (tmp_path / "a" / "wandb" / "run_id").read_text() != (tmp_path / "b" / "wandb" / "run_id").read_text()


def test_no_credential_reaches_any_file(tmp_path):
    run_once(tmp_path, **{"data.hf_token": "hf-token-value-42"})
    (log,) = run_logs(tmp_path)
    (run,) = of_type(log, "run")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["data.hf_token"] == "***"
    for path in tmp_path.rglob("*"):
        if path.is_file():
            content = path.read_bytes()
            assert FAKE_KEY.encode() not in content, path
            assert b"hf-token-value-42" not in content, path


def test_mode_comes_from_the_environment_and_disabled_writes_no_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_once(tmp_path / "disabled")
    assert run_logs(tmp_path / "disabled") == []
    assert not (tmp_path / "disabled" / "wandb" / "run_id").exists()

    monkeypatch.delenv("WANDB_MODE")  # unset means offline: nothing needs a network by default
    run_once(tmp_path / "default")
    assert len(run_logs(tmp_path / "default")) == 1


def test_logging_before_start_is_a_clear_error():
    with pytest.raises(RuntimeError, match="before start"):
        WandbTracker().log({"train_loss": 1.0}, step=0)


def test_the_closing_note_is_the_sync_command_for_the_offline_runs(tmp_path):
    run_once(tmp_path / "runs" / "a")
    run_once(tmp_path / "runs" / "b")
    (tmp_path / "runs" / "c").mkdir()  # a variant that never started its tracker
    note = WandbTracker().closing_note([tmp_path / "runs" / name for name in "abc"])
    assert "2 offline run(s)" in note
    assert note.endswith(f"wandb sync {tmp_path / 'runs'}/*/wandb/offline-run-*")
    assert WandbTracker().closing_note([tmp_path / "runs" / "c"]) is None
