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


def core_import_graph(package: Path) -> dict[str, set[str]]:
    """module → the core modules it imports, deferred imports (inside functions) included; a package
    counts as its ``__init__``. ``from lmlab.x import y`` depends on ``lmlab.x.y`` when that is a module,
    else on ``lmlab.x``."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def owner(name: str) -> str | None:  # the longest prefix of name that is a module of ours
        parts = name.split(".")
        return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules), None)

    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps |= {owner(a.name) for a in node.names if a.name.split(".")[0] == package.name}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.split(".")[0] == package.name:
                for a in node.names:  # `from lmlab.x import y`: the module lmlab.x.y, or what lmlab.x defines
                    full = f"{node.module}.{a.name}"
                    deps.add(full if full in modules else owner(node.module))
        graph[name] = deps - {None, name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cores_modules_never_import_each_other_in_a_cycle():
    assert cycles(core_import_graph(ROOT / "core" / "lmlab")) == []


def test_a_cycle_through_a_deferred_import_is_caught(tmp_path):
    package = tmp_path / "lmlab"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "manifest.py").write_text("def load():\n    from lmlab.validate import check\n")
    (package / "validate.py").write_text("from lmlab import manifest\n")
    (package / "tables.py").write_text("import lmlab.errors\n")
    (package / "errors.py").write_text("")
    assert cycles(core_import_graph(package)) == [["lmlab.manifest", "lmlab.validate"]]
