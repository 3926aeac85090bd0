"""Entry points → plugin classes.

Listing reads installed distributions' metadata and imports no plugin module (``lmlab plugins``
stays fast; lmlab.plugin_health says which cannot load from their source and from failures recorded
here). Loading goes through stevedore, one named plugin at a time, so a manifest imports only
the plugins it names; every loaded class is checked against its slot's contract before use.
"""

import importlib.metadata as md
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from lmlab import plugin_health
from lmlab.errors import UserError, did_you_mean
from lmlab.slots import ALL_SLOTS, MANY_SLOTS, SLOTS  # noqa: F401 — what discovery knows, re-exported

GROUP_PREFIX = "lmlab."


@dataclass(frozen=True)
class PluginInfo:
    slot: str
    name: str
    target: str  # "module:Class", as declared; never imported by listing
    distribution: str
    version: str


@cache
def installed() -> dict[str, list[PluginInfo]]:
    """slot → plugins declared by installed distributions (duplicates kept, so they can be reported)."""
    found: dict[str, list[PluginInfo]] = {slot: [] for slot in ALL_SLOTS}
    seen = set()
    for dist in md.distributions():
        # entry_points.txt is tiny; METADATA (name, version) is parsed only for lmlab plugin dists.
        eps = [ep for ep in dist.entry_points if ep.group.startswith(GROUP_PREFIX)]
        if not eps:
            continue
        dist_name, version = dist.metadata["Name"] or "?", dist.version
        for ep in eps:
            slot = ep.group[len(GROUP_PREFIX):]
            marker = (slot, ep.name, dist_name.lower().replace("_", "-"))
            if marker in seen:  # the same distribution found twice on sys.path is not a clash
                continue
            seen.add(marker)
            found.setdefault(slot, []).append(PluginInfo(slot, ep.name, ep.value, dist_name, version))
    for plugins in found.values():
        plugins.sort(key=lambda p: (p.name, p.distribution))
    return found


@cache
def catalogue() -> tuple[dict, ...]:
    """Entries of registry.toml: every known plugin, installed or not."""
    for path in _registry_paths():
        if path.is_file():
            with path.open("rb") as f:
                return tuple(tomllib.load(f).get("plugin", []))
    return ()


def _registry_paths():
    here = Path(__file__).resolve().parent
    yield here.parent.parent / "registry.toml"  # a source checkout (editable install)
    yield here / "registry.toml"  # a wheel (force-included at build)


def hint_for(slot: str, name: str) -> str:
    """What to install for a plugin that is not installed, from the catalogue."""
    for entry in catalogue():
        if entry.get("slot") == slot and entry.get("name") == name:
            where = entry.get("path")
            how = f"pip install {entry['distribution']}" + (f"  (in this repository: pip install -e {where})"
                                                             if where else "")
            return f"it is provided by the distribution {entry['distribution']}: {how}"
    return "no known distribution provides it (see `lmlab plugins`)"


def find(slot: str, name: str, key: str) -> PluginInfo:
    """The one installed plugin ``name`` of ``slot``, or a UserError saying why there is none."""
    if slot not in ALL_SLOTS:
        raise UserError(f"unknown slot {slot!r}", key=slot)
    candidates = [p for p in installed().get(slot, []) if p.name == name]
    if not candidates:
        names = sorted({p.name for p in installed().get(slot, [])})
        raise UserError(f"plugin {name!r} is not installed for slot {slot!r}{did_you_mean(name, names)}; "
                        f"{hint_for(slot, name)}", key=key)
    dists = {(p.distribution, p.target) for p in candidates}
    if len(dists) > 1:
        listing = ", ".join(f"{d} ({t})" for d, t in sorted(dists))
        raise UserError(f"plugin {name!r} of slot {slot!r} is declared by more than one distribution: "
                        f"{listing}; uninstall all but one", key=key)
    return candidates[0]


def installed_as(slot: str, plugin: type) -> PluginInfo | None:
    """The installed plugin ``plugin`` (a class with ``name`` set) was loaded as; None for a stand-in
    that no installed distribution declares (``Variant.with_plugin``)."""
    if not any(p.name == plugin.name for p in installed().get(slot, [])):
        return None
    return find(slot, plugin.name, key=f"{slot}.use")


def load(slot: str, name: str, key: str | None = None):
    """Import and check plugin ``name`` of ``slot``; returns its class with ``name`` set."""
    key = key or f"{slot}.use"
    return load_plugin(find(slot, name, key), key)


def load_plugin(info: PluginInfo, key: str):
    """Import and check the plugin ``info`` (one distribution's, even where two declare its name).
    The outcome is recorded for ``lmlab plugins``, which shows failures without importing anything."""
    cls = _import(info, key)
    from lmlab.plugin_check import check_plugin_class  # imports lmlab.api (pydantic, torch)

    try:
        check_plugin_class(cls, info.slot, info, key)
    except UserError as exc:
        # The message names the plugin, then its target, then what is wrong: keep what is wrong.
        plugin_health.remember_failure(info, "check", exc.message.partition(f"({info.target})")[2].lstrip(": ")
                                       or exc.message)
        raise
    plugin_health.forget_failure(info)
    cls.name = info.name
    return cls


def _import(info: PluginInfo, key: str):
    from stevedore import driver

    failures: dict[str, BaseException] = {}  # target → why it failed to import

    class _Installed(driver.DriverManager):
        """stevedore, given the one entry point installed now. Its own listing comes from a disk cache
        keyed on sys.path's mtimes packed as 32-bit floats (two minutes apart look equal), so a
        plugin reinstalled with a new target kept loading the old one; ``installed()`` reads the
        distributions' metadata afresh. One entry point: two distributions declaring the name
        (``plugins --check``) each load their own."""

        def list_entry_points(self):
            return [md.EntryPoint(info.name, info.target, self.namespace)]

    try:
        manager = _Installed(
            f"{GROUP_PREFIX}{info.slot}", info.name, invoke_on_load=False,
            on_load_failure_callback=lambda _mgr, ep, exc: failures.setdefault(ep.value, exc),
            on_missing_entrypoints_callback=lambda names: None)
        return manager.driver
    # stevedore reports a failed import as "no match": show the real cause. SystemExit too: a plugin
    # module that calls sys.exit() when imported is broken like any other, not a reason to stop.
    except (Exception, SystemExit) as exc:
        cause = failures.get(info.target, exc)
        plugin_health.remember_failure(info, "import", f"{type(cause).__name__}: {cause}")
        raise UserError(f"plugin {info.name!r} from {info.distribution} {info.version} failed to load "
                        f"({info.target}): {type(cause).__name__}: {cause}", key=key) from cause
