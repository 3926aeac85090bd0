"""Where the core needs something of a slot's plugins it asks them, never names one: the monitor that
recovers from non-finite steps (``Monitor.nonfinite_recovery``) and the files a tracker keeps in a run
folder (``Tracker.run_files``) come from whichever plugins declare them, third-party ones included; the
first-party plugins keep what they did. Strings that only look like plugin names (a dtype, OpenAI's
finish reason, a summary key) keep their values."""

import json

import pytest
import torch

from lmlab import discovery
from lmlab.api import Monitor, Tracker
from lmlab.diagnose import nonfinite_fixes
from lmlab.testing import stand_in_run
from lmlab.train import sweep


class Steady(Monitor):
    """A third-party monitor that rides out non-finite steps when told to."""

    @classmethod
    def nonfinite_recovery(cls):
        return "ride it out", {"mode": "ride"}


class Watcher(Monitor):
    """A monitor that does not recover."""


class Lab(Tracker):
    """A third-party tracker keeping its files in the run folder, and paths that reach outside it."""

    run_files = ("mlruns", "../outside", "/etc")


def only_installed(monkeypatch, slot, classes: dict) -> None:
    """``classes`` (name → class) as the only installed plugins of ``slot``."""
    infos = [discovery.PluginInfo(slot, name, f"{__name__}:{cls.__name__}", "lmlab-third", "0.1")
             for name, cls in classes.items()]
    real = discovery.installed()
    monkeypatch.setattr(discovery, "installed", lambda: {**real, slot: infos})
    monkeypatch.setattr(discovery, "load", lambda s, name, key=None: classes[name])


def monitor_fixes(uses: list[str]):
    return [fix for fix in nonfinite_fixes(stand_in_run(monitor=uses), None) if fix.key == "monitor.use"]


def test_a_nonfinite_failure_suggests_the_installed_monitor_that_declares_recovery(monkeypatch):
    only_installed(monkeypatch, "monitor", {"a-watcher": Watcher, "steady": Steady})
    (fix,) = monitor_fixes(["a-watcher"])
    assert (fix.text, fix.value, fix.also) == ("ride it out", ["a-watcher", "steady"], {"monitor.steady.mode": "ride"})


def test_a_run_that_used_a_recovering_monitor_or_has_none_installed_is_not_told_to_add_one(monkeypatch):
    only_installed(monkeypatch, "monitor", {"steady": Steady})
    assert monitor_fixes(["steady"]) == []
    only_installed(monkeypatch, "monitor", {"a-watcher": Watcher})
    assert monitor_fixes([]) == []


def test_the_first_party_nan_guard_is_suggested_with_the_action_that_skips():
    (fix,) = monitor_fixes(["grad-norm"])
    assert fix.value == ["grad-norm", "nan-guard"] and fix.also == {"monitor.nan-guard.action": "skip"}
    assert "skip non-finite steps" in fix.text
    assert monitor_fixes(["nan-guard"]) == []


def run_folder(tmp_path, *names):
    run_dir = tmp_path / "runs" / "default"
    for name in names:
        (run_dir / name).mkdir(parents=True)
        (run_dir / name / "kept-by-it").write_text("x")
    (run_dir / "metrics.jsonl").write_text("{}\n")
    (run_dir / "notes.txt").write_text("the user's")
    return run_dir


def test_starting_over_removes_what_an_installed_tracker_declares_and_nothing_outside(tmp_path, monkeypatch):
    only_installed(monkeypatch, "tracker", {"lab": Lab})
    run_dir = run_folder(tmp_path, "mlruns", "wandb")
    (tmp_path / "runs" / "outside").mkdir()
    sweep.clear(run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt", "wandb"]  # wandb is not installed here
    assert (tmp_path / "runs" / "outside").is_dir()


def test_starting_over_removes_the_first_party_wandb_folder(tmp_path):
    run_dir = run_folder(tmp_path, "wandb")
    sweep.clear(run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("by_keyword", [False, True])
def test_the_check_skips_random_init_of_a_tensor_given_by_position_or_keyword(by_keyword):
    from lmlab.unfilled import without_random_init

    weight = torch.empty(4, 4, device="meta")
    with without_random_init():
        filled = torch.nn.init.normal_(tensor=weight, std=0.02) if by_keyword else torch.nn.init.normal_(weight, 0, 0.02)
    assert filled is weight


def test_a_load_skips_the_random_init_of_parameters_only():
    from lmlab.unfilled import without_random_init

    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    parameter = torch.nn.Parameter(torch.zeros(64))
    with without_random_init(parameters_only=True):
        torch.nn.init.normal_(parameter)
        torch.nn.Linear(8, 8)  # kaiming_uniform_ and uniform_ of its weight and bias
    assert torch.equal(torch.random.get_rng_state(), before) and torch.equal(parameter, torch.zeros(64))
    buffer = torch.zeros(64)
    with without_random_init(parameters_only=True):
        torch.nn.init.normal_(buffer)
    assert buffer.std() > 0.5  # a buffer, which a checkpoint may not hold, is still drawn


def test_the_planner_knows_integer_dtypes_by_their_width():
    from lmlab.plan.arithmetic import dtype_bytes

    assert [dtype_bytes(d) for d in ("int8", "uint8", "int32", "bfloat16", "float64")] == [1, 1, 4, 2, 8]
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        dtype_bytes("int4")


def test_finish_reasons_go_out_as_openai_spells_them():
    from lmlab.generation.outputs import Outputs

    outputs = Outputs(None, [2, 5], eos_id=0)
    outputs.record(0, [7, 8, 9])
    outputs.record(1, [7, 0])
    assert json.dumps([c.finish_reason for c in outputs.completions]) == '["length", "stop"]'
