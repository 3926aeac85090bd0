"""Discovery: lazy listing, loading only what is named, and plugins that fail are reported by name
without breaking the ones that work. Fake distributions are laid on PYTHONPATH as dist-info folders,
exactly as pip would install them."""

import json
import textwrap
from pathlib import Path

import pytest

from support import run_cli

GOOD = '''
from lmlab.api import FFN, FFNModule, hookimpl
from torch import nn


class Identity(FFN):
    def build(self, shape, layer):
        return _Zero()


class _Zero(FFNModule):
    def forward(self, x):
        return x * 0


class OldApi(Identity):
    api = ">=0.1,<1"


class BadHook(Identity):
    @hookimpl
    def lmlab_fit_end(self, summary, nonexistent_argument):
        pass


class NotAPlugin:
    pass
'''


def fake_dist(site: Path, dist: str, module: str, source: str, entry_points: dict[str, dict[str, str]]):
    (site / module).mkdir(parents=True)
    (site / module / "__init__.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3\n")
    lines = []
    for group, entries in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture
def site(tmp_path) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    fake_dist(site, "lmlab-fake", "lmlab_fake", GOOD, {"lmlab.ffn": {
        "zero": "lmlab_fake:Identity", "old-api": "lmlab_fake:OldApi", "bad-hook": "lmlab_fake:BadHook",
        "not-a-plugin": "lmlab_fake:NotAPlugin", "broken": "lmlab_fake_missing.module:Thing"}})
    fake_dist(site, "lmlab-rival", "lmlab_rival", "from lmlab_fake import Identity as Gqa\n",
              {"lmlab.attention": {"gqa": "lmlab_rival:Gqa"}})
    return site


def cli(site, *args):
    return run_cli(*args, env={"PYTHONPATH": str(site)})


def test_plugins_lists_fakes_without_importing_any_plugin_or_torch(site):
    code = ("import sys; from lmlab.cli.main import main; main(['plugins']); "
            "bad = [m for m in sys.modules if m.startswith('lmlab_') or m.split('.')[0] in "
            "('torch', 'lightning', 'wandb', 'pydantic')]; print('IMPORTED', bad)")
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(site)}).stdout
    assert "IMPORTED []" in out
    assert "broken" in out and "lmlab-fake 0.3" in out
    assert "also declared by another distribution" in out  # gqa from lmlab-attention and lmlab-rival


@pytest.mark.parametrize("name, message", [
    ("broken", "failed to load (lmlab_fake_missing.module:Thing): ModuleNotFoundError"),
    ("old-api", "needs lmlab.api >=0.1,<1"),
    ("bad-hook", "invalid hook implementation"),
    ("not-a-plugin", "is not a subclass of lmlab.api.FFN"),
])
def test_a_faulty_plugin_is_reported_by_name_with_its_cause(site, tiny_manifest, name, message):
    result = cli(site, "check", str(tiny_manifest(f'[ffn]\nuse = "{name}"\n')), "-q")
    assert result.returncode == 2, result.stderr
    assert "ffn.use" in result.stderr and f"'{name}'" in result.stderr and "lmlab-fake 0.3" in result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_faulty_plugins_do_not_break_a_working_one_from_the_same_distribution(site, tiny_manifest):
    result = cli(site, "check", str(tiny_manifest('[ffn]\nuse = "zero"\n')), "-q")
    assert result.returncode == 0, result.stderr


def test_a_name_declared_by_two_distributions_is_refused_naming_both(site, tiny_manifest):
    result = cli(site, "check", str(tiny_manifest('[attention]\nuse = "gqa"\n')), "-q")
    assert result.returncode == 2
    assert "lmlab-attention" in result.stderr and "lmlab-rival" in result.stderr


def test_a_plugin_that_calls_sys_exit_when_imported_is_contained_like_any_broken_plugin(site, tiny_manifest):
    fake_dist(site, "lmlab-exiting", "lmlab_exiting", "import sys\nsys.exit(3)\n",
              {"lmlab.ffn": {"exits": "lmlab_exiting:Thing"}})
    checked = cli(site, "check", str(tiny_manifest('[ffn]\nuse = "exits"\n')), "-q")
    assert checked.returncode == 2, checked.stderr
    assert checked.stderr.startswith("lmlab: error: ffn.use: plugin 'exits' from lmlab-exiting 0.3 failed to load")
    assert "SystemExit: 3" in checked.stderr and "Traceback" not in checked.stderr
    schema = cli(site, "schema")
    assert schema.returncode == 0, schema.stderr
    assert "left out of the schema" in schema.stderr and "'exits'" in schema.stderr
    assert json.loads(schema.stdout)["properties"]["ffn"]  # every other plugin is still there
    assert cli(site, "check", str(tiny_manifest()), "-q").returncode == 0  # not named: never imported


def test_plugins_of_one_slot(site):
    result = cli(site, "plugins", "attention")
    assert result.returncode == 0
    assert result.stdout.startswith("attention:") and "ffn:" not in result.stdout


def test_plugins_of_an_unknown_slot_is_bad_input(site):
    result = cli(site, "plugins", "attenion")
    assert result.returncode == 2 and "did you mean 'attention'" in result.stderr


HOOKS = '''
import json, os
from lmlab.api import Plugin, hookimpl


class CallRecorder(Plugin):
    """A monitor that records which lifecycle hooks ran and adds a metric to every step."""

    def _note(self, name, **data):
        with open(os.environ["HOOK_LOG"], "a") as f:
            f.write(json.dumps({"hook": name, **data}) + "\\n")

    @hookimpl
    def lmlab_model_built(self, model):
        self._note("model_built", params=sum(p.numel() for p in model.parameters()))

    @hookimpl
    def lmlab_before_optimizer_step(self, step, optimizer):
        self._note("before_optimizer_step", step=step)

    @hookimpl
    def lmlab_train_batch_end(self, step):
        return {"doubled_step": 2 * step}

    @hookimpl
    def lmlab_validation_end(self, step, metrics):
        self._note("validation_end", step=step, val_loss=metrics["val_loss"])

    @hookimpl
    def lmlab_checkpoint_saved(self, path, step):
        self._note("checkpoint_saved", step=step, exists=os.path.exists(path))

    @hookimpl
    def lmlab_fit_end(self, summary):
        self._note("fit_end", status=summary["status"])
'''


def test_hooks_of_a_loaded_plugin_run_through_the_lifecycle(tmp_path, tiny_manifest):
    import json

    site = tmp_path / "site"
    site.mkdir()
    fake_dist(site, "lmlab-callrec", "lmlab_callrec", HOOKS, {"lmlab.monitor": {"call-recorder": "lmlab_callrec:CallRecorder"}})
    log = tmp_path / "hooks.jsonl"
    path = tiny_manifest('[monitor]\nuse = ["call-recorder"]\n', steps=4, eval_every=2, checkpoint_every=2)
    result = run_cli("run", str(path), "--out", str(tmp_path / "runs"), "--set", "train.sample_tokens=0",
                     env={"PYTHONPATH": str(site), "HOOK_LOG": str(log)})
    assert result.returncode == 0, result.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    names = [c["hook"] for c in calls]
    assert names[0] == "model_built" and names[-1] == "fit_end" and calls[-1]["status"] == "completed"
    assert [c["step"] for c in calls if c["hook"] == "before_optimizer_step"] == [0, 1, 2, 3]
    assert [c["step"] for c in calls if c["hook"] == "validation_end"] == [2, 4]
    assert all(c["exists"] for c in calls if c["hook"] == "checkpoint_saved")
    records = [json.loads(line) for line in (tmp_path / "runs" / "default" / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"]: r["doubled_step"] for r in records if "doubled_step" in r} == {1: 2, 2: 4, 3: 6, 4: 8}
