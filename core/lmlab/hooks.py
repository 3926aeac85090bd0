"""The run's pluggy manager: every loaded plugin instance is registered, and hooks without an
implementation are skipped before the call, so a per-step hook costs nothing unless implemented."""

import pluggy

from lmlab.api import LifecycleSpec
from lmlab.api.hooks import PROJECT


class Hooks:
    def __init__(self, plugins=()):
        self.manager = pluggy.PluginManager(PROJECT)
        self.manager.add_hookspecs(LifecycleSpec)
        self._implemented: set[str] | None = None  # hook names with an implementation, computed lazily
        for plugin in plugins:
            if plugin is not None:
                self.register(plugin)

    def register(self, plugin) -> None:
        if self.manager.is_registered(plugin):
            return
        self.manager.register(plugin, name=f"{type(plugin).__module__}.{type(plugin).__name__}#{id(plugin)}")
        self._implemented = None

    def has(self, name: str) -> bool:
        if self._implemented is None:
            self._implemented = {spec for spec in dir(LifecycleSpec) if spec.startswith("lmlab_")
                                 and getattr(self.manager.hook, spec).get_hookimpls()}
        return name in self._implemented

    def call(self, name: str, **kwargs) -> list:
        return getattr(self.manager.hook, name)(**kwargs) if self.has(name) else []

    def collect_each(self, name: str, warn, **kwargs) -> dict:
        """Like :meth:`collect`, but each implementation on its own: one that raises is reported
        through ``warn`` and the others still run (for hooks that close what a run opened)."""
        merged: dict = {}
        if not self.has(name):
            return merged
        for impl in reversed(getattr(self.manager.hook, name).get_hookimpls()):  # pluggy's call order
            try:
                result = impl.function(**{arg: kwargs[arg] for arg in impl.argnames})
            except Exception as exc:  # noqa: BLE001 - reported, and the other plugins still close
                warn(f"{impl.plugin_name.split('#')[0]}.{name} failed: {type(exc).__name__}: {exc}")
                continue
            if result:
                merged.update(result)
        return merged

    def collect(self, name: str, **kwargs) -> dict:
        """Call a hook whose implementations may return metric dicts; merge them."""
        merged: dict = {}
        for result in self.call(name, **kwargs):
            if result:
                merged.update(result)
        return merged
