import pytest

from lmlab.api import RunInfo, Tracker
from lmlab_trackers.none import NoTracker


def test_none_tracker_has_no_options():
    assert issubclass(NoTracker, Tracker)
    assert NoTracker.Options.model_fields == {}
    with pytest.raises(ValueError):
        NoTracker.Options(project="x")


def test_none_tracker_accepts_a_whole_run_and_writes_nothing(tmp_path):
    tracker = NoTracker(NoTracker.Options())
    info = RunInfo(run_dir=tmp_path, group="g", name="v", config={"seed": 1}, flat_config={"seed": 1})
    tracker.start(info)
    tracker.log({"train_loss": 1.0}, step=1)
    tracker.finish({"val_loss": 1.0}, status="completed")
    assert list(tmp_path.iterdir()) == []
