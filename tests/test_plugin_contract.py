"""The contract a plugin class is checked against when it is loaded: methods named like hooks must be
hooks (a misspelt one would never be called), and every first-party plugin's options hold their own
declared types at their defaults."""

import importlib

import pytest

from lmlab import discovery
from lmlab.api import Plugin, hookimpl
from lmlab.errors import UserError
from lmlab.plugin_check import check_plugin_class
from lmlab.testing import ConformanceError
from lmlab.testing import check_plugin_class as kit_check_plugin_class

from support import run_cli


class Misspelt(Plugin):
    slot = "monitor"

    @hookimpl
    def lmlab_train_batch_ended(self, step, loss):
        return None


class MisspeltUndecorated(Plugin):
    """Pluggy ignores a method without @hookimpl: without the check, nothing at all would be said."""

    slot = "monitor"

    def lmlab_train_batch_ended(self, step, loss):
        return None


class FarFromAnyHook(Plugin):
    slot = "monitor"

    def lmlab_xylophone_quartz(self):
        return None


class ForgotTheDecorator(Plugin):
    slot = "monitor"

    def lmlab_fit_end(self, summary):
        return None


class Correct(Plugin):
    slot = "monitor"

    @hookimpl
    def lmlab_train_batch_end(self, step, loss):
        return None


def loaded(cls) -> None:
    """``cls`` checked as discovery checks a plugin it loads."""
    info = discovery.PluginInfo("monitor", "watcher", f"{__name__}:{cls.__name__}", "lmlab-watcher", "0.1")
    check_plugin_class(cls, "monitor", info, key="monitor.use")


@pytest.mark.parametrize("cls", [Misspelt, MisspeltUndecorated])
def test_a_misspelt_hook_is_refused_with_the_close_name(cls):
    with pytest.raises(UserError) as caught:
        loaded(cls)
    message = str(caught.value)
    assert caught.value.key == "monitor.use"
    assert "plugin 'watcher'" in message and "'lmlab_train_batch_ended'" in message
    assert "did you mean 'lmlab_train_batch_end'?" in message


def test_a_method_named_like_no_hook_lists_the_hooks():
    with pytest.raises(UserError, match="'lmlab_xylophone_quartz' named like a hook.*the hooks are lmlab_before_optimizer_step"):
        loaded(FarFromAnyHook)


def test_a_hook_without_hookimpl_is_refused():
    with pytest.raises(UserError, match="'lmlab_fit_end' named after a hook but not marked @hookimpl"):
        loaded(ForgotTheDecorator)


def test_a_correct_hook_passes():
    loaded(Correct)
    kit_check_plugin_class(Correct, "monitor")


def test_the_conformance_kit_refuses_a_misspelt_hook():
    with pytest.raises(ConformanceError, match="'lmlab_train_batch_ended'.*did you mean 'lmlab_train_batch_end'"):
        kit_check_plugin_class(Misspelt, "monitor")


MISSPELT_FFN = '''
from lmlab.api import FFN, FFNModule, hookimpl


class _Zero(FFNModule):
    def forward(self, x):
        return x * 0


class Zero(FFN):
    def build(self, shape, layer):
        return _Zero()

    @hookimpl
    def lmlab_validation_ended(self, step, metrics):
        pass
'''


def test_a_manifest_naming_a_plugin_with_a_misspelt_hook_exits_2(tmp_path, tiny_manifest):
    # An installed distribution, as pip lays it out, so that the real discovery loads it.
    site = tmp_path / "site"
    (site / "lmlab_misspelt").mkdir(parents=True)
    (site / "lmlab_misspelt" / "__init__.py").write_text(MISSPELT_FFN)
    info = site / "lmlab_misspelt-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lmlab-misspelt\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[lmlab.ffn]\nzero = lmlab_misspelt:Zero\n")
    result = run_cli("check", str(tiny_manifest('[ffn]\nuse = "zero"\n')), "-q", env={"PYTHONPATH": str(site)})
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line
    assert line.startswith("lmlab: error: ffn.use: plugin 'zero'")
    assert "'lmlab_validation_ended'" in line and "did you mean 'lmlab_validation_end'?" in line


def first_party_plugins():
    return [(slot, info) for slot, infos in discovery.installed().items() for info in infos
            if info.distribution.startswith("lmlab-")]


@pytest.mark.parametrize("slot, info", first_party_plugins(), ids=lambda v: getattr(v, "name", v))
def test_first_party_options_hold_their_declared_types_at_their_defaults(slot, info):
    module, _, attr = info.target.partition(":")
    options = getattr(importlib.import_module(module), attr).Options
    if any(field.is_required() for field in options.model_fields.values()):
        pytest.skip("has required options (a data path): its manifests are checked by the experiments")
    options()  # validate_default: each default goes through the same type check as a manifest value

