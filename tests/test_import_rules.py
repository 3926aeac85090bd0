"""Plugins import from the core only `lmlab.api` (tests may also use `lmlab.testing`); the core never
imports a plugin package. Checked on the real tree, and shown to catch violations on a fake one."""

import ast
from pathlib import Path

from support import ROOT

ALLOWED_IN_PLUGINS = ("lmlab.api",)
ALLOWED_IN_PLUGIN_TESTS = ("lmlab.api", "lmlab.testing")


def imported_modules(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module == "lmlab" and node.level == 0:
            for alias in node.names:  # `from lmlab import train` is lmlab.train
                yield node.lineno, f"lmlab.{alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def _is_test(path: Path) -> bool:
    return "tests" in path.parts or path.name.startswith("test_") or path.name == "conftest.py"


def _within(module: str, allowed) -> bool:
    return any(module == a or module.startswith(a + ".") for a in allowed)


def violations(root: Path) -> list[str]:
    found = []
    for path in sorted((root / "plugins").rglob("*.py")):
        allowed = ALLOWED_IN_PLUGIN_TESTS if _is_test(path) else ALLOWED_IN_PLUGINS
        for line, module in imported_modules(path):
            if (module == "lmlab" or module.startswith("lmlab.")) and not _within(module, allowed):
                found.append(f"{path.relative_to(root)}:{line}: plugin imports {module}")
    for path in sorted((root / "core").rglob("*.py")):
        for line, module in imported_modules(path):
            if module.split(".")[0].startswith("lmlab_"):
                found.append(f"{path.relative_to(root)}:{line}: core imports plugin {module}")
    return found


def test_plugins_use_only_the_api_and_the_core_knows_no_plugin():
    assert violations(ROOT) == []


def test_the_rule_catches_a_plugin_reaching_into_the_core_and_the_core_importing_a_plugin(tmp_path):
    (tmp_path / "plugins" / "lmlab-x" / "src" / "lmlab_x").mkdir(parents=True)
    (tmp_path / "plugins" / "lmlab-x" / "tests").mkdir()
    (tmp_path / "core" / "lmlab").mkdir(parents=True)
    (tmp_path / "plugins" / "lmlab-x" / "src" / "lmlab_x" / "ok.py").write_text("from lmlab.api import FFN\n")
    (tmp_path / "plugins" / "lmlab-x" / "src" / "lmlab_x" / "bad.py").write_text(
        "import torch\nfrom lmlab.model import LanguageModel\nfrom lmlab import train\n")
    (tmp_path / "plugins" / "lmlab-x" / "src" / "lmlab_x" / "sneaky.py").write_text("from lmlab.testing import x\n")
    (tmp_path / "plugins" / "lmlab-x" / "tests" / "test_x.py").write_text("from lmlab.testing import check\n")
    (tmp_path / "core" / "lmlab" / "model.py").write_text("from lmlab_attention.gqa import GroupedQueryAttention\n")
    assert sorted(violations(tmp_path)) == [
        "core/lmlab/model.py:1: core imports plugin lmlab_attention.gqa",
        "plugins/lmlab-x/src/lmlab_x/bad.py:2: plugin imports lmlab.model",
        "plugins/lmlab-x/src/lmlab_x/bad.py:3: plugin imports lmlab.train",
        "plugins/lmlab-x/src/lmlab_x/sneaky.py:1: plugin imports lmlab.testing",
    ]
