"""Plugins are told about their run through one typed object (``lmlab.api.RunSettings``, API 1.20):
``CheckContext.run``, ``RunControl.run``, the ``lmlab_model_built`` hook's ``run`` and ``Peft.apply``'s
argument are the resolved variant with its tables as Options classes, not the dict manifest; a peft
plugin written before 1.20 that indexes it as the manifest keeps working."""

import json

import pytest
from pydantic import ValidationError

from lmlab.api import Monitor, Peft, RunSettings, TrainOptions, UserError, hookimpl
from lmlab.testing import stand_in_run
from lmlab.testing.runs import load_variant, run_variant


class Recorder(Monitor):
    """A third party's monitor that reads the run where the core hands it over."""

    name = "recorder"
    seen: dict = {}

    def check(self, context):
        Recorder.seen["check"] = context.run

    @hookimpl
    def lmlab_run_start(self, control):
        Recorder.seen["control"] = control.run

    @hookimpl
    def lmlab_model_built(self, model, run):
        Recorder.seen["built"] = run


class OldStylePeft(Peft):
    """A peft plugin written against API 1.4: ``apply`` receives what it calls the manifest."""

    name = "old-style"
    seen: dict = {}

    def apply(self, model, manifest):
        OldStylePeft.seen.update(max_steps=manifest["train"]["max_steps"],
                                 parallel=manifest.get("parallel", {}).get("use"))


def test_every_plugin_hook_is_handed_the_typed_variant(tiny_manifest, tmp_path):
    variant = load_variant(tiny_manifest(steps=2, eval_every=2, checkpoint_every=2), ["tracker.use=none"])
    variant = variant.with_plugin("monitor", Recorder).with_plugin("peft", OldStylePeft)
    Recorder.seen.clear()
    run_variant(variant, tmp_path / "run")
    assert set(Recorder.seen) == {"check", "control", "built"}
    for run in Recorder.seen.values():
        assert isinstance(run, RunSettings) and isinstance(run.train, TrainOptions)
        assert run.train.max_steps == 2 and run.model.d_model == variant.model.d_model
        assert run.uses("parallel") == "single" and run.uses("monitor") == ("recorder",)
        assert run.options("optimizer").lr == variant.options("optimizer").lr
        # Derived numbers are the ones the run uses, filled in once: no None left for a plugin to guess.
        assert run.train.min_lr is not None and run.train.eval_batch_size == 4 * run.train.batch_size
        assert run.grad_clip == variant.resolved.grad_clip
    assert OldStylePeft.seen == {"max_steps": 2, "parallel": "single"}
    # A stand-in no distribution declares is recorded by its class, not refused as "not installed".
    (monitor,) = json.loads((tmp_path / "run" / "provenance.json").read_text())["plugins"]["monitor"]
    assert monitor["distribution"] is None and monitor["class"].endswith(":Recorder")


def test_the_stand_in_run_reads_like_a_variant():
    run = stand_in_run(model={"d_model": 64, "n_heads": 4}, train={"max_steps": 20, "grad_clip": 0.5},
                       parallel="single", monitor=["grad-norm"], experiment="unit")
    assert (run.experiment, run.model.d_model, run.train.max_steps, run.grad_clip) == ("unit", 64, 20, 0.5)
    assert run.uses("parallel") == "single" and run.uses("monitor") == ("grad-norm",) and run.uses("peft") is None
    assert run.options("parallel").accelerator == "auto"
    assert run["train"]["max_steps"] == 20 and run.get("parallel") == run.manifest["parallel"]
    with pytest.raises(KeyError, match="stand_in_run"):
        run.options("peft")
    with pytest.raises((UserError, ValidationError), match="max_steps|greater than 0"):
        stand_in_run(train={"max_steps": 0})  # the core's own validation


def test_a_plugin_cannot_change_what_the_rest_of_the_run_reads():
    run = stand_in_run(train={"max_steps": 3})
    with pytest.raises(ValidationError, match="frozen"):
        run.train.max_steps = 4
