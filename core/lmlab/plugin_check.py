"""Checks a plugin class against its slot's contract when it is loaded, naming it in every error."""

import inspect

import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from lmlab.api import API_VERSION, SLOT_BASES, LifecycleSpec, Options
from lmlab.api.hooks import PROJECT
from lmlab.errors import UserError


def check_plugin_class(cls, slot: str, info, key: str) -> None:
    who = f"plugin {info.name!r} from {info.distribution} {info.version} ({info.target})"
    base = SLOT_BASES.get(slot)
    if not (inspect.isclass(cls) and base is not None and issubclass(cls, base)):
        raise UserError(f"{who} is not a subclass of lmlab.api.{base.__name__ if base else 'Plugin'}", key=key)
    if cls.slot and cls.slot != slot:  # Plugin (the base of slots without their own) has none
        raise UserError(f"{who} says its slot is {cls.slot!r}, but it is registered for {slot!r}", key=key)
    try:
        supported = SpecifierSet(cls.api)
    except InvalidSpecifier:
        raise UserError(f"{who} declares an invalid API range {cls.api!r}", key=key) from None
    if API_VERSION not in supported:
        raise UserError(f"{who} needs lmlab.api {cls.api}, which excludes this lmlab.api {API_VERSION}; "
                        "upgrade the plugin or lmlab", key=key)
    if not (inspect.isclass(cls.Options) and issubclass(cls.Options, Options)):
        raise UserError(f"{who}: its Options must subclass lmlab.api.Options", key=key)
    try:
        # A hookimpl with a wrong name or signature is refused now, not at its first call.
        manager = pluggy.PluginManager(PROJECT)
        manager.add_hookspecs(LifecycleSpec)
        manager.register(cls)
        manager.check_pending()
    except pluggy.PluginValidationError as exc:
        raise UserError(f"{who} has an invalid hook implementation: {exc}", key=key) from None
