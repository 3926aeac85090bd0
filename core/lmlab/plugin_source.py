"""What a plugin's source says, read without running any of it: where a module's file is, what its
top level imports and binds (lmlab.plugin_facts), and from that, where a plugin class is defined, its
bases and its ``api`` range. ``lmlab plugins`` marks the plugins that cannot load with it.

Nothing here imports a plugin module or a parent package of one (``importlib.util.find_spec("a.b")``
would run ``a/__init__.py``). Parsing every plugin module on each listing would cost more than the
listing itself, so each file's facts are kept in the cache folder, keyed by path, mtime and size, and
so is where each module was found, while the folders searched for it are unchanged.
"""

import builtins
import importlib.util
import json
import os
import sys
from importlib.machinery import PathFinder

FORMAT = 2  # of the cached facts; older caches are ignored
MAX_HOPS = 8  # re-exports (`from a import B`) followed to find where a class is defined
MAX_DEPTH = 16  # base classes followed up a hierarchy
PATHS = 4  # sys.path variants whose module locations are kept

OPAQUE = "opaque"  # defined outside plugin packages (lmlab.api, torch): not read, assumed sound


def load_json(path) -> dict:
    """A JSON object from a cache file; {} when it is missing, unreadable or not what was written."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_json(path, data: dict) -> None:
    """Written whole or not at all (readers never see half a file), and never an error: these files
    only spare work or remember what went wrong, so an unwritable cache folder must not fail a command."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, separators=(",", ":"))
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


class Sources:
    """Where modules are and what their source says, for one command, with what is still true of an
    earlier command's answers read from ``cache_file`` (None: no cache). ``plugin_tops``: the top-level
    packages that hold plugins; only their modules are read, anything else counts as opaque."""

    def __init__(self, cache_file, plugin_tops):
        self.cache_file, self.plugin_tops = cache_file, set(plugin_tops)
        stored = load_json(cache_file) if cache_file else {}
        if not (stored.get("format") == FORMAT and isinstance(stored.get("files"), dict)
                and isinstance(stored.get("memo"), dict) and isinstance(stored.get("found"), list)):
            stored = {}  # another version's, or not what this module writes: start afresh
        self._files = stored.get("files", {})
        self.memo = stored.get("memo", {})  # small verdicts worth keeping (API ranges), for plugin_health
        # Where a module is found changes only when a folder searched for it gains or loses an entry
        # (the import system's own finders rely on the same mtimes), or when sys.path changes. One
        # answer per sys.path, for a few: `lmlab` and `python -m lmlab` start with different ones.
        self._path = [*sys.path, *(type(finder).__qualname__ for finder in sys.meta_path)]
        self._others = [f for f in stored.get("found", []) if isinstance(f, dict) and f.get("path") != self._path]
        found = next((f for f in stored.get("found", []) if isinstance(f, dict) and f.get("path") == self._path
                      and all(_mtime(d) == m for d, m in f.get("dirs", {}).items())), {})
        self._dirs, self._found = found.get("dirs", {}), found.get("modules", {})
        self._before = (json.dumps(self.memo, sort_keys=True), len(self._found) if found else -1)
        self._parsed = False
        self._facts = {}

    def spec(self, module: str) -> list | None:
        """[file or None, package folders or None] of ``module``, found as the import system would
        find it, or None where there is none."""
        if module not in self._found:
            parent = module.rpartition(".")[0]
            spec = None
            try:
                if not parent:  # a top-level name: asking the finders runs no code of the package
                    searched = sys.path
                    spec = importlib.util.find_spec(module)
                else:
                    above = self.spec(parent)
                    searched = above[1] if above and above[1] is not None else []
                    spec = PathFinder.find_spec(module, list(searched)) if searched else None
            except Exception:  # noqa: BLE001 — a finder that breaks, or a __main__ without a spec
                searched, spec = [], None
            for folder in searched:
                self._dirs.setdefault(folder, _mtime(folder))
            where = spec.submodule_search_locations if spec else None
            self._found[module] = spec and [spec.origin if spec.has_location else None,
                                            None if where is None else list(where)]
        return self._found[module]

    def is_package(self, module: str) -> bool:
        found = self.spec(module)
        return bool(found and found[1] is not None)

    def stamp(self, module: str) -> list | None:
        """[path, mtime_ns, size] of the module's file, or None where it has none."""
        found = self.spec(module)
        if not (found and found[0]):
            return None
        try:
            st = os.stat(found[0])
        except OSError:
            return None
        return [found[0], st.st_mtime_ns, st.st_size]

    def facts(self, module: str) -> dict | None:
        """None: no such module. {}: a module whose source cannot be read (an extension, a namespace
        package). Else {"error": ...} for a file that does not parse, or {"names", "imports", "dynamic"}."""
        if module not in self._facts:
            stamp = self.stamp(module)
            if stamp is None or not stamp[0].endswith(".py"):
                self._facts[module] = None if self.spec(module) is None else {}
                return self._facts[module]
            path = stamp[0]
            entry = self._files.get(path)
            if not (entry and entry.get("stamp") == stamp[1:]):
                from lmlab.plugin_facts import read_facts  # compiled only when a file must be parsed

                try:
                    with open(path, "rb") as f:
                        entry = {"stamp": stamp[1:], "facts": read_facts(f.read(), path)}
                except OSError:
                    entry = {"stamp": None, "facts": {}}
                self._files[path], self._parsed = entry, True
            self._facts[module] = entry["facts"]
        return self._facts[module]

    def save(self) -> None:
        """Writes the cache when this command learnt something, dropping files that are gone."""
        now = (json.dumps(self.memo, sort_keys=True), len(self._found))
        if self.cache_file and (self._parsed or now != self._before):
            files = {path: entry for path, entry in self._files.items() if os.path.exists(path)}
            found = [{"path": self._path, "dirs": self._dirs, "modules": self._found}, *self._others][:PATHS]
            save_json(self.cache_file, {"format": FORMAT, "files": files, "memo": self.memo, "found": found})

    def absolute(self, module: str, target: str, level: int) -> str:
        """The module a ``from <level dots><target> import`` in ``module`` names."""
        if not level:
            return target
        package = module if self.is_package(module) else module.rpartition(".")[0]
        for _ in range(level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{target}" if target else package

    def resolve(self, module: str, name: str, hops: int = 0):
        """What ``module.name`` is: ("class", key, facts), ("missing", message), OPAQUE, or None
        when the source does not say (a function, a value computed at import, a dynamic module)."""
        if module.split(".")[0] not in self.plugin_tops:
            return OPAQUE
        facts = self.facts(module)
        if not facts or "names" not in facts:
            return None
        binding = facts["names"].get(name)
        if binding is None:
            if facts["dynamic"] or self.spec(f"{module}.{name}") is not None:  # a submodule is importable
                return None
            return ("missing", f"{module} has no {name}")
        if binding[0] == "class":
            return ("class", (module, name), binding[1])
        if binding[0] == "from" and hops < MAX_HOPS:
            source = self.absolute(module, binding[1], binding[2])
            if self.spec(f"{source}.{binding[3]}") is not None:  # `from a import b` of the module a.b
                return None
            return self.resolve(source, binding[3], hops + 1)
        return None

    def resolve_dotted(self, module: str, dotted: str):
        """resolve() for a base class written ``Name`` or ``alias.Name`` in ``module``."""
        head, _, rest = dotted.partition(".")
        if not rest:
            found = self.resolve(module, head)
            if found and found[0] == "missing":  # not bound in the module: a builtin, or a NameError
                return OPAQUE if hasattr(builtins, head) else None
            return found
        facts = self.facts(module) or {}
        binding = facts.get("names", {}).get(head)
        if binding and binding[0] == "module":
            base = binding[1]
        elif binding and binding[0] == "from":
            base = f"{self.absolute(module, binding[1], binding[2])}.{binding[3]}"
        else:
            return None
        where, _, name = f"{base}.{rest}".rpartition(".")
        return self.resolve(where, name)

    def mro(self, key: tuple, facts: dict, depth: int = 0) -> list | None:
        """The class's method resolution order (C3, as Python computes it) as keys (module, name) of
        classes read here and ("?", dotted) for opaque ones; None where a base cannot be followed."""
        if depth > MAX_DEPTH:
            return None
        chains = []
        for dotted in facts["bases"]:
            found = self.resolve_dotted(key[0], dotted) if dotted else None
            if found == OPAQUE:
                if dotted != "object":
                    chains.append([("?", dotted)])
            elif found and found[0] == "class":
                chain = self.mro(found[1], found[2], depth + 1)
                if chain is None:
                    return None
                chains.append(chain)
            else:
                return None
        merged = _c3(chains + [[chain[0] for chain in chains]])
        return None if merged is None else [key, *merged]


def _mtime(folder: str) -> int | None:
    try:
        return os.stat(folder or ".").st_mtime_ns  # "" on sys.path: the current folder
    except OSError:
        return None


def _c3(sequences: list[list]) -> list | None:
    result, sequences = [], [list(s) for s in sequences if s]
    while sequences:
        head = next((s[0] for s in sequences if not any(s[0] in t[1:] for t in sequences)), None)
        if head is None:
            return None  # no consistent order: Python refuses the class too, but say nothing here
        result.append(head)
        sequences = [rest for rest in ([x for x in s if x != head] for s in sequences) if rest]
    return result
