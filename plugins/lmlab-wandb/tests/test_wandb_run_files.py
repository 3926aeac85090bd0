"""Everything the tracker keeps in a run folder is under the names it declares (``Tracker.run_files``),
which the core removes when a run starts over."""

from lmlab.api import RunInfo
from lmlab_wandb.wandb_tracker import WandbTracker


def test_every_file_an_offline_run_leaves_in_the_run_folder_is_declared(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var.lower()))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    tracker = WandbTracker(WandbTracker.Options())
    tracker.start(RunInfo(run_dir=run_dir, group="g", name="v", config={}, flat_config={}))
    tracker.log({"train_loss": 2.5}, step=1)
    tracker.finish({"status": "completed"}, status="completed")
    made = {path.name for path in run_dir.iterdir()}
    assert made and made <= set(WandbTracker.run_files)
