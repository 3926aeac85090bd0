"""Which installed plugins cannot load, told without importing any of them (``lmlab plugins``).

One reason per plugin, from the first source that has one:

- the record of real failures: whenever discovery fails to import or check a plugin (``lmlab check``,
  ``run``, ``schema``, ``plugins --check``), the cause is kept in the cache folder with the stamp of
  the plugin's module file. It is shown while that file, the plugin's version and lmlab are unchanged,
  and cleared when the plugin next loads: code that raises at import is only found by running it;
- the source, read statically (lmlab.plugin_source): a missing module or dependency, a syntax error,
  a class that is not there or derives from nothing, an ``api`` range that excludes this lmlab.
"""

import importlib.metadata as md
import os
import sys
from pathlib import Path

from lmlab import __version__
from lmlab.api.version import API_VERSION  # lmlab.api imports its names lazily: nothing heavy here
from lmlab.plugin_source import OPAQUE, Sources, load_json, save_json
from lmlab.slots import BY_NAME

MAX_MODULES = 400  # read per listing, following imports between plugin packages
MAX_CAUSE = 160  # characters of a recorded cause: the listing shows it on one line


def api_supported(api: str) -> bool:
    """Whether a plugin declaring the PEP 440 range ``api`` works with this lmlab.api: the one test,
    for the loader's check and for the listing. ValueError (InvalidSpecifier) when it is no range."""
    from packaging.specifiers import SpecifierSet  # 5 ms: the listing asks only about unseen ranges

    return API_VERSION in SpecifierSet(api)


def cache_folder() -> Path | None:
    """$LMLAB_CACHE/plugins, else ~/.cache/lmlab/plugins (beside the token cache); None without a home."""
    if os.environ.get("LMLAB_CACHE"):
        return Path(os.environ["LMLAB_CACHE"]) / "plugins"
    try:
        return Path.home() / ".cache" / "lmlab" / "plugins"
    except RuntimeError:
        return None


def problems(infos, everything) -> dict:
    """PluginInfo → why it cannot load, for those of ``infos`` that cannot. ``everything``: all installed
    plugins; the packages their targets name are the ones whose source is read."""
    folder = cache_folder()
    src = Sources(folder / "sources.json" if folder else None, {_module(i).split(".")[0] for i in everything})
    if src.memo.get("api", {}).get("version") != API_VERSION:  # verdicts on ranges, for this API only
        src.memo["api"] = {"version": API_VERSION, "ranges": {}}
    failures = load_json(folder / "failures.json") if folder else {}
    modules: dict = {}
    found = {}
    for info in infos:
        reason = _recorded(failures, info, src) if failures else None
        if reason or (reason := _static_problem(src, info, modules)):
            found[info] = reason
    src.save()
    return found


def remember_failure(info, kind: str, cause: str) -> None:
    """Keeps why ``info`` failed: kind "import" (its module raised) or "check" (its class was refused)."""
    path = _record_file()
    if path is None:
        return
    stamp = Sources(None, ()).stamp(_module(info))
    failures = {k: v for k, v in load_json(path).items()  # another process may have written since
                if isinstance(v, dict) and (not v.get("file") or os.path.exists(v["file"][0]))}
    cause = " ".join(cause.split())
    failures[_key(info, stamp)] = {
        "version": info.version, "target": info.target, "file": stamp, "lmlab": _lmlab(), "kind": kind,
        "cause": cause if len(cause) <= MAX_CAUSE else cause[:MAX_CAUSE - 3] + "..."}
    save_json(path, failures)


def forget_failure(info) -> None:
    """Called after ``info`` loaded and passed its checks."""
    path = _record_file()
    failures = load_json(path) if path else {}
    if failures:  # most of the time there is no record at all: nothing to look up
        key = _key(info, Sources(None, ()).stamp(_module(info)))
        if failures.pop(key, None) is not None:
            save_json(path, failures)


def _record_file():
    folder = cache_folder()
    return folder / "failures.json" if folder else None


def _target(info) -> tuple[str, str | None]:
    """The module and attribute an entry point names, parsed as the import machinery parses them."""
    entry = md.EntryPoint(info.name, info.target, info.slot)
    try:
        return entry.module, entry.attr
    except AttributeError:  # not an entry point's syntax: no module has that name
        return info.target, None


def _module(info) -> str:
    return _target(info)[0]


def _key(info, stamp) -> str:
    # The file's path is in the key: one cache folder may serve several environments.
    return f"{info.slot} {info.name} {info.distribution} {stamp[0] if stamp else ''}"


def _lmlab() -> str:
    return f"{__version__} api {API_VERSION}"


def _recorded(failures: dict, info, src: Sources) -> str | None:
    stamp = src.stamp(_module(info))
    entry = failures.get(_key(info, stamp))
    if not (isinstance(entry, dict) and entry.get("file") == stamp and entry.get("version") == info.version
            and entry.get("target") == info.target and entry.get("lmlab") == _lmlab()):
        return None  # no record, or one about other code: it says nothing about this
    what = "failed to load when last imported" if entry.get("kind") == "import" else "refused when last loaded"
    return f"{what}: {entry.get('cause')}"


def _static_problem(src: Sources, info, modules: dict) -> str | None:
    module, attr = _target(info)
    if src.spec(module) is None:
        return f"cannot load: no module {module}"
    if problem := _module_problem(src, module, modules):
        return problem
    if not attr:
        return None
    found = src.resolve(module, attr.split(".")[0])
    if found is None or found == OPAQUE:
        return None
    if found[0] == "missing":
        return f"cannot load: {found[1]}"
    mro = src.mro(found[1], found[2]) if "." not in attr else None
    if mro is None:
        return None
    slot = BY_NAME.get(info.slot)
    if slot and all(key[0] != "?" for key in mro):  # nothing from outside: not derived from lmlab.api
        return f"is not a subclass of lmlab.api.{slot.base}"
    for key in mro:
        if key[0] == "?":
            return None  # an lmlab.api base's default range, which is not read here
        facts = src.resolve(*key)[2]
        if "api" in facts:
            return _api_problem(src, facts["api"])
    return None


def _module_problem(src: Sources, module: str, modules: dict) -> str | None:
    """Why importing ``module`` would fail, as far as its source, its parent packages' and the plugin
    modules' it imports tell. ``modules``: module → problem, shared by the plugins of one listing; a
    module under way counts as sound, which ends import cycles."""
    if module not in modules:
        modules[module] = None
        parent = module.rpartition(".")[0]
        modules[module] = (parent and _module_problem(src, parent, modules)) or _own_problem(src, module, modules)
    return modules[module]


def _own_problem(src: Sources, module: str, modules: dict) -> str | None:
    facts = src.facts(module)
    if facts is None:
        return f"cannot load: no module {module}"
    if "error" in facts:
        return f"cannot load: {facts['error']}"
    for target, level in facts.get("imports", ()):
        name = src.absolute(module, target, level)
        top = name.split(".")[0]
        if top in src.plugin_tops:
            if len(modules) < MAX_MODULES and (problem := _module_problem(src, name, modules)):
                return problem
        elif top and top not in sys.stdlib_module_names and top not in sys.modules and src.spec(top) is None:
            return f"needs {top}, which is not installed"  # another distribution's: only whether it is there
    return None


def _api_problem(src: Sources, api: str | None) -> str | None:
    if api is None:
        return None  # not a literal: only importing the class tells
    ranges = src.memo["api"]["ranges"]
    if api not in ranges:
        try:
            ranges[api] = "ok" if api_supported(api) else "excluded"
        except ValueError:
            ranges[api] = "invalid"
    if ranges[api] == "excluded":
        return f"needs lmlab.api {api} (this is {API_VERSION})"
    if ranges[api] == "invalid":
        return f"declares an invalid API range {api!r}"
    return None
