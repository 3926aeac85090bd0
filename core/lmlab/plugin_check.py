"""Checks a plugin class against its slot's contract when it is loaded, naming it in every error."""

import inspect

import pluggy

from lmlab.api import API_VERSION, SLOT_BASES, LifecycleSpec, Options
from lmlab.api.hooks import PROJECT
from lmlab.errors import UserError, did_you_mean
from lmlab.plugin_health import api_supported

HOOK_PREFIX = "lmlab_"  # what every hookspec's name starts with, and no other method's may


def check_plugin_class(cls, slot: str, info, key: str) -> None:
    who = f"plugin {info.name!r} from {info.distribution} {info.version} ({info.target})"
    base = SLOT_BASES.get(slot)
    if not (inspect.isclass(cls) and base is not None and issubclass(cls, base)):
        raise UserError(f"{who} is not a subclass of lmlab.api.{base.__name__ if base else 'Plugin'}", key=key)
    if cls.slot and cls.slot != slot:  # Plugin (the base of slots without their own) has none
        raise UserError(f"{who} says its slot is {cls.slot!r}, but it is registered for {slot!r}", key=key)
    try:
        supported = api_supported(cls.api)
    except ValueError:  # packaging's InvalidSpecifier
        raise UserError(f"{who} declares an invalid API range {cls.api!r}", key=key) from None
    if not supported:
        raise UserError(f"{who} needs lmlab.api {cls.api}, which excludes this lmlab.api {API_VERSION}; "
                        "upgrade the plugin or lmlab", key=key)
    if not (inspect.isclass(cls.Options) and issubclass(cls.Options, Options)):
        raise UserError(f"{who}: its Options must subclass lmlab.api.Options", key=key)
    problem = hook_name_problem(cls)
    if problem:
        raise UserError(f"{who} {problem}", key=key)
    try:
        # A hookimpl with a wrong name or signature is refused now, not at its first call.
        manager = pluggy.PluginManager(PROJECT)
        manager.add_hookspecs(LifecycleSpec)
        manager.register(cls)
        manager.check_pending()
    except pluggy.PluginValidationError as exc:
        raise UserError(f"{who} has an invalid hook implementation: {exc}", key=key) from None


def hook_name_problem(cls) -> str | None:
    """What is wrong with the methods of ``cls`` named like hooks, or None. Pluggy ignores a method
    that is not marked @hookimpl, so a misspelt hook (``lmlab_train_batch_ended``) or a forgotten
    decorator would be silently never called."""
    hooks = sorted(name for name in dir(LifecycleSpec) if name.startswith(HOOK_PREFIX))
    for name in sorted(dir(cls)):
        if not name.startswith(HOOK_PREFIX) or not callable(getattr(cls, name, None)):
            continue
        if name not in hooks:
            hint = did_you_mean(name, hooks) or f"; the hooks are {', '.join(hooks)}"
            return f"has a method {name!r} named like a hook, but lmlab has no such hook{hint}"
        if getattr(getattr(cls, name), f"{PROJECT}_impl", None) is None:
            return f"has a method {name!r} named after a hook but not marked @hookimpl: it would never be called"
    return None
