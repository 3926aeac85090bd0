"""Discovery: lazy listing, loading only what is named, and plugins that fail are reported by name
without breaking the ones that work. Fake distributions are laid on PYTHONPATH as dist-info folders,
exactly as pip would install them."""

import json
import os
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


def cli(site, *args, **env):
    return run_cli(*args, env={"PYTHONPATH": str(site), "LMLAB_CACHE": str(site.parent / "cache"), **env})


def marks(listing: str) -> dict[str, str]:
    """plugin name → what `lmlab plugins` says is wrong with it ("" when nothing)."""
    found = {}
    for line in listing.splitlines():
        if line.startswith("  ") and "(not installed" not in line:
            name, _, rest = line.strip().partition(" ")
            found[name] = rest.partition("  ! ")[2]
    return found


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
    assert "! cannot load: no module lmlab_fake_missing.module" in out  # marking imports nothing either


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


def test_plugins_marks_those_that_cannot_load_and_only_those(site):
    from lmlab.api.version import API_VERSION

    result = cli(site, "plugins", "ffn")
    assert result.returncode == 0, result.stderr
    found = marks(result.stdout)
    assert found["broken"] == "cannot load: no module lmlab_fake_missing.module"
    assert found["old-api"] == f"needs lmlab.api >=0.1,<1 (this is {API_VERSION})"
    assert found["not-a-plugin"] == "is not a subclass of lmlab.api.FFN"
    assert found["zero"] == found["mlp"] == found["swiglu"] == ""
    assert found["bad-hook"] == ""  # only importing it tells (`lmlab plugins --check`)
    again = cli(site, "plugins", "ffn")  # from the cache of what each file says: the same
    assert again.stdout == result.stdout and (site.parent / "cache" / "plugins" / "sources.json").is_file()


STATIC = {
    "needs.py": "import lmlab_not_installed_anywhere\nfrom lmlab_fake import Identity as Needs\n",
    "typo.py": "from lmlab_fake import Identity\n\nclass Typo(Identity:\n    pass\n",
    "old.py": "from lmlab_fake import OldApi\n\n\nclass Older(OldApi):\n    pass\n",
    "reexport.py": "from .old import Older as Renamed\n",
    "optional.py": ("try:\n    import lmlab_not_installed_anywhere\nexcept ImportError:\n    pass\n"
                    "from lmlab_fake import Identity\n\n\nclass Optional(Identity):\n    api = '>=1.0'\n"),
    "sibling.py": "from lmlab_static.gone import Thing\n",
}


def test_plugins_reads_imports_re_exports_and_inherited_ranges_from_the_source(site):
    fake_dist(site, "lmlab-static", "lmlab_static", "", {"lmlab.ffn": {
        "needs": "lmlab_static.needs:Needs", "typo": "lmlab_static.typo:Typo",
        "renamed": "lmlab_static.reexport:Renamed",
        "optional": "lmlab_static.optional:Optional", "sibling": "lmlab_static.sibling:Thing",
        "misnamed": "lmlab_static.old:Oldest"}})
    for name, source in STATIC.items():
        (site / "lmlab_static" / name).write_text(source)
    found = marks(cli(site, "plugins", "ffn").stdout)
    assert found["needs"] == "needs lmlab_not_installed_anywhere, which is not installed"
    assert found["typo"].startswith("cannot load: SyntaxError in ") and "typo.py, line 3" in found["typo"]
    assert found["renamed"].startswith("needs lmlab.api >=0.1,<1")  # two re-exports, then its base's range
    assert found["sibling"] == "cannot load: no module lmlab_static.gone"
    assert found["misnamed"] == "cannot load: lmlab_static.old has no Oldest"
    assert found["optional"] == ""  # an import under try may fail; its own range includes this lmlab


def test_a_plugin_that_failed_when_imported_is_marked_until_it_loads(site, tiny_manifest):
    fake_dist(site, "lmlab-exiting", "lmlab_exiting", "import sys\nsys.exit(3)\n",
              {"lmlab.ffn": {"exits": "lmlab_exiting:Thing"}})
    fake_dist(site, "lmlab-flaky", "lmlab_flaky", "import os\nif os.environ.get('FLAKY'):\n"
              "    raise RuntimeError('told to fail')\nfrom lmlab_fake import Identity as Thing\n",
              {"lmlab.ffn": {"flaky": "lmlab_flaky:Thing"}})
    # Nothing was imported yet: flaky's source is sound (exits' lacks its class, which reading it shows).
    listed = marks(cli(site, "plugins", "ffn").stdout)
    assert listed["flaky"] == "" and listed["exits"] == "cannot load: lmlab_exiting has no Thing"
    for name, env in (("exits", {}), ("flaky", {"FLAKY": "1"})):
        assert cli(site, "check", str(tiny_manifest(f'[ffn]\nuse = "{name}"\n')), "-q", **env).returncode == 2
    found = marks(cli(site, "plugins", "ffn").stdout)
    assert found["exits"] == "failed to load when last imported: SystemExit: 3"
    assert found["flaky"] == "failed to load when last imported: RuntimeError: told to fail"
    assert found["zero"] == ""
    assert cli(site, "check", str(tiny_manifest('[ffn]\nuse = "flaky"\n')), "-q").returncode == 0
    assert marks(cli(site, "plugins", "ffn").stdout)["flaky"] == ""  # it loaded since: the record is gone
    (site / "lmlab_exiting" / "__init__.py").write_text("from lmlab_fake import Identity as Thing\n")
    assert marks(cli(site, "plugins", "ffn").stdout)["exits"] == ""  # about a file that has changed


def test_an_unwritable_cache_folder_changes_nothing_but_speed(site, tiny_manifest):
    cache = site.parent / "not-a-folder"
    cache.write_text("")
    checked = cli(site, "check", str(tiny_manifest('[ffn]\nuse = "broken"\n')), "-q", LMLAB_CACHE=str(cache))
    assert checked.returncode == 2 and checked.stderr.count("\n") == 1, checked.stderr
    listed = cli(site, "plugins", "ffn", LMLAB_CACHE=str(cache))
    assert listed.returncode == 0 and listed.stderr == ""
    assert marks(listed.stdout)["broken"] == "cannot load: no module lmlab_fake_missing.module"
    (site.parent / "cache" / "plugins").mkdir(parents=True)
    (site.parent / "cache" / "plugins" / "sources.json").write_text("{not json")
    assert cli(site, "plugins", "ffn").stdout == listed.stdout  # a damaged cache is read as an empty one


def test_plugins_check_imports_every_plugin_and_names_each_that_fails(site):
    fake_dist(site, "lmlab-raising", "lmlab_raising",
              "raise RuntimeError('no GPU driver')\nfrom lmlab_fake import Identity as Thing\n",
              {"lmlab.ffn": {"raises": "lmlab_raising:Thing"}})
    # Its source is sound, and the listing imports no plugin: until something imports it, nothing
    # can know that it raises (README, "lmlab plugins": only --check, or a run naming it, tells).
    assert marks(cli(site, "plugins", "ffn").stdout)["raises"] == ""
    result = cli(site, "plugins", "--check")
    assert result.returncode == 1, result.stderr
    failing = {line.split("'")[1]: line for line in result.stdout.splitlines()
               if line.startswith(("ffn:", "attention:"))}
    assert sorted(failing) == ["bad-hook", "broken", "gqa", "not-a-plugin", "old-api", "raises"]
    assert failing["raises"] == ("ffn: plugin 'raises' from lmlab-raising 0.3 failed to load "
                                 "(lmlab_raising:Thing): RuntimeError: no GPU driver")
    assert "invalid hook implementation" in failing["bad-hook"] and "lmlab-fake 0.3" in failing["bad-hook"]
    assert "is not a subclass of lmlab.api.FFN" in failing["not-a-plugin"]
    assert "lmlab-rival" in failing["gqa"]  # each distribution's plugin, though two declare the name
    assert "fail" in result.stdout.splitlines()[-1]
    found = marks(cli(site, "plugins", "ffn").stdout)  # what --check learnt, the listing now shows
    assert found["bad-hook"].startswith("refused when last loaded: has an invalid hook implementation")
    assert found["raises"] == "failed to load when last imported: RuntimeError: no GPU driver"
    assert found["zero"] == ""


def test_plugins_check_passes_with_the_first_party_plugins(tmp_path):
    result = run_cli("plugins", "--check", env={"LMLAB_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stdout + result.stderr
    loaded, _, total = result.stdout.split()[:3]
    assert loaded == total and int(total) > 40


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


def test_a_reinstalled_plugin_loads_its_new_entry_point_not_a_cached_one(site, tiny_manifest, tmp_path):
    """stevedore caches entry points on disk (~/.cache/python-entrypoints) under a hash of sys.path's
    mtimes packed as 32-bit floats, which cannot tell times within about two minutes apart: a
    reinstall that soon kept loading the old target. Discovery must load what is installed now."""
    fake_dist(site, "lmlab-moving", "lmlab_moving", "from lmlab_fake import Identity as Old\n",
              {"lmlab.ffn": {"moving": "lmlab_moving:Old"}})
    info = site / "lmlab_moving-0.3.dist-info"
    env = {"PYTHONPATH": str(site), "LMLAB_CACHE": str(tmp_path / "cache"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    manifest = str(tiny_manifest('[ffn]\nuse = "moving"\n'))
    first = run_cli("check", manifest, "-q", env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    # The reinstall: the class renamed, the entry point moved with it, within the same two minutes.
    stamps = {p: (p.stat().st_atime, p.stat().st_mtime) for p in (site, info, info / "entry_points.txt")}
    (site / "lmlab_moving" / "__init__.py").write_text("from lmlab_fake import Identity as New\n")
    (info / "entry_points.txt").write_text("[lmlab.ffn]\nmoving = lmlab_moving:New\n")
    for path, times in stamps.items():
        os.utime(path, times)
    again = run_cli("check", manifest, "-q", env=env, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    listed = run_cli("plugins", "ffn", env=env, cwd=tmp_path)
    assert "lmlab_moving:New" not in listed.stderr and marks(listed.stdout)["moving"] == ""
