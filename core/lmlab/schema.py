"""The JSON Schema (draft 2020-12) of manifests, for editors and linters (taplo, VS Code's Even Better TOML).

Built from what validation itself uses: the top-level keys, the core's tables (``lmlab.config``), the
slot list and the packaged defaults (which plugin a table without ``use`` means), and the ``Options``
model of every installed plugin. A single-valued slot's table has one ``if``/``then`` per plugin:
when ``use`` names it, the table is that plugin's options, closed; a many-valued slot's table takes
``use = [..]`` and one subtable of options per plugin. Descriptions are the help texts and the plugins' docstrings.

What a schema cannot see: a plugin's own cross-option checks (a ``UserError`` raised in code), files
that must exist, and options that a ``[sweep]`` switching ``use`` drops. ``lmlab check`` sees all.
"""

import copy
import inspect
import sys
from collections.abc import Callable

from lmlab import __version__, discovery
from lmlab.api import API_VERSION, SLOT_BASES, Plugin
from lmlab.config import CORE_TABLES
from lmlab.slots import MANY_SLOTS, SLOTS
from lmlab.errors import UserError
from lmlab.manifest import defaults as manifest_defaults
from lmlab.tables import NAME_PATTERN
from lmlab.validate import REQUIRED_SLOTS

DIALECT = "https://json-schema.org/draft/2020-12/schema"
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas (the rest, such
# as "default", "const", "enum", hold data and are left alone when titles are stripped).
_SCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
           "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "dependentSchemas")


def installed_plugins(warn: Callable[[str], None]) -> dict[str, dict[str, type]]:
    """slot → {name: plugin class} of every installed plugin that loads; those that do not are
    reported through ``warn`` (they would fail ``lmlab check`` as well) and left out."""
    found: dict[str, dict[str, type]] = {}
    for slot in SLOTS:
        for name in sorted({p.name for p in discovery.installed().get(slot, [])}):
            try:
                found.setdefault(slot, {})[name] = discovery.load(slot, name)
            except UserError as exc:
                warn(f"left out of the schema: {exc}")
    return found


def manifest_schema(plugins: dict[str, dict[str, type]] | None = None,
                    warn: Callable[[str], None] | None = None) -> dict:
    """The schema of a manifest file. ``plugins`` (slot → {name: class}) defaults to the installed ones."""
    warn = warn or (lambda message: print(f"lmlab: warning: {message}", file=sys.stderr))
    if plugins is None:
        plugins = installed_plugins(warn)
    defaults = manifest_defaults()
    defs: dict = {}
    properties: dict = {
        "name": {"type": "string", "pattern": NAME_PATTERN.pattern,
                 "description": "the experiment's name; runs go to runs/<name>/ (letters, digits, '.', '_', '-')"},
        "seed": {"type": "integer", "minimum": 0, "default": defaults.get("seed", 0),
                 "description": "random seed of every variant (a [sweep] seeds list repeats each variant)"},
        "description": {"type": "string", "description": "what the experiment asks; free text"},
    }
    for table, options_cls in CORE_TABLES.items():
        schema = options_schema(options_cls, f"core.{table}", defs, warn)
        schema["description"] = _first_paragraph(options_cls.__doc__) or f"the core's [{table}] table"
        properties[table] = schema
    for slot in SLOTS:
        available = {name: cls for name, cls in (plugins.get(slot) or {}).items()}
        default = (defaults.get(slot) or {}).get("use")
        if slot in MANY_SLOTS:
            properties[slot] = _many_slot(slot, available, defs, warn)
        else:
            properties[slot] = _single_slot(slot, available, default, defs, warn)
    for slot in _composed_slots(plugins):  # the tables a plugin's nested fields hold (Architecture.components)
        defs[f"slot.{slot}"] = {**copy.deepcopy(properties[slot]), "required": ["use"]}
    properties["sweep"] = _sweep(properties)
    required = ["name"] + [s for s in REQUIRED_SLOTS if not (defaults.get(s) or {}).get("use")]
    schema = {
        "$schema": DIALECT,
        "title": "lmlab manifest",
        "description": "An lmlab experiment: one plugin per slot (`use`) with its options, the core's "
                       "[model] and [train] tables, and an optional [sweep] grid.",
        "$comment": f"Written by `lmlab schema` (lmlab {__version__}, lmlab.api {API_VERSION}) from the "
                    "plugins installed then; run it again after installing or upgrading plugins.",
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    if defs:
        schema["$defs"] = defs
    return schema


def _composed_slots(plugins: dict[str, dict[str, type]]) -> list[str]:
    """The slots whose plugins some installed plugin's options nest (``Architecture.components``)."""
    found = {inner for classes in plugins.values() for cls in classes.values()
             for inner in (getattr(cls, "components", None) or {}).values()}
    return sorted(found)


def options_schema(options_cls: type, prefix: str, defs: dict, warn: Callable[[str], None]) -> dict:
    """The closed object schema of an Options model, its nested definitions moved into ``defs``
    under ``prefix`` (so that two plugins' models of one name cannot collide)."""
    try:
        schema = options_cls.model_json_schema(ref_template=f"#/$defs/{prefix}.{{model}}")
    except Exception as exc:  # a field type pydantic cannot express: accept any table, say why
        warn(f"{prefix}: options not in the schema ({type(exc).__name__}: {exc})")
        return {"type": "object"}
    for name, definition in schema.pop("$defs", {}).items():
        defs[f"{prefix}.{name}"] = _strip_titles(definition)
    schema = _strip_titles(schema)
    schema.pop("description", None)  # the Options docstring; callers describe the table
    schema.setdefault("properties", {})
    schema["additionalProperties"] = False
    return schema


def _single_slot(slot: str, plugins: dict[str, type], default: str | None, defs: dict, warn) -> dict:
    """One ``if``/``then`` per plugin: when ``use`` is that plugin (or absent, for the default one),
    the table is that plugin's options, closed. The top-level ``properties`` list every plugin's
    options too (typed where the plugins that share a name agree), so that editors complete them."""
    if not plugins:
        return {"description": f"no {slot} plugin is installed (see `lmlab plugins {slot}`)", "not": {}}
    rules, union = [], {}
    for name, cls in plugins.items():
        branch = options_schema(cls.Options, f"{slot}.{name}", defs, warn)
        for field, inner in (getattr(cls, "components", None) or {}).items():
            described = branch.get("properties", {}).get(field, {}).get("description", "")
            branch.setdefault("properties", {})[field] = {
                "type": "object", "description": described or f"tables of {inner} plugins, by label",
                "additionalProperties": {"$ref": f"#/$defs/slot.{inner}"}}
        branch = {"description": _plugin_help(name, cls), **branch}
        branch["properties"] = {"use": {"const": name}, **branch.get("properties", {})}
        condition = {"properties": {"use": {"const": name}}}
        if name != default:  # a table without `use` means the default plugin
            condition["required"] = ["use"]
        rules.append({"if": condition, "then": branch})
        for option, option_schema in branch["properties"].items():
            if option != "use":
                union.setdefault(option, {})[name] = option_schema
    use = {"enum": list(plugins), "description": _use_help(slot, plugins, default)}
    if default in plugins:
        use["default"] = default
    properties = {"use": use}
    for option, by_plugin in union.items():
        properties[option] = _shared_option(by_plugin)
    schema = {"type": "object", "description": _slot_help(slot, default), "properties": properties,
              "allOf": rules}
    if default not in plugins:
        schema["required"] = ["use"]
    return schema


def _shared_option(by_plugin: dict[str, dict]) -> dict:
    """An option as the slot's table lists it: its schema when every plugin that has it agrees on
    one (the ``then`` of the plugin in use checks it in any case), a description otherwise."""
    plain = [{k: v for k, v in schema.items() if k != "description"} for schema in by_plugin.values()]
    help_text = "; ".join(f"{name}: {schema.get('description', '')}".rstrip(": ")
                          for name, schema in by_plugin.items())
    if all(p == plain[0] for p in plain):
        return {**plain[0], "description": help_text}
    return {"description": help_text}


def _many_slot(slot: str, plugins: dict[str, type], defs: dict, warn) -> dict:
    if not plugins:
        return {"description": f"no {slot} plugin is installed (see `lmlab plugins {slot}`)", "not": {}}
    names = list(plugins)
    properties = {"use": {
        "anyOf": [{"enum": names}, {"type": "array", "items": {"enum": names}, "uniqueItems": True}],
        "description": f"the {slot} plugins to use, in order: " + _use_help(slot, plugins, None)}}
    for name, cls in plugins.items():
        options = options_schema(cls.Options, f"{slot}.{name}", defs, warn)
        properties[name] = {"description": f"options of {slot} plugin {name!r}: " + _plugin_help(name, cls),
                            **options}
    return {"type": "object", "description": _slot_help(slot, None),
            "properties": properties, "required": ["use"], "additionalProperties": False}


def _sweep(properties: dict) -> dict:
    """[sweep]: dotted keys (or whole slot tables) to lists of values; ``seeds`` repeats each variant."""
    axes: dict = {"seeds": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0},
                            "description": "run every variant once per seed"}}
    for table in (*CORE_TABLES, *SLOTS):
        node = properties[table]
        for option, option_schema in node.get("properties", {}).items():
            if table in MANY_SLOTS and option != "use":
                continue  # per-plugin subtables: their dotted keys are two levels deep
            if table in SLOTS and option != "use":
                option_schema = {"description": option_schema.get("description", "")}  # types vary with `use`
            axes[f"{table}.{option}"] = {"type": "array", "minItems": 1, "items": option_schema,
                                         "description": f"values of {table}.{option}, one variant each"}
        if table in SLOTS and table not in MANY_SLOTS and "allOf" in node:  # whole tables that change together
            axes[table] = {"type": "array", "minItems": 1,
                           "items": {"$ref": f"#/properties/{table}", "required": ["use"]},
                           "description": f"whole [{table}] tables, one variant each"}
    heads = "|".join(("seed", *CORE_TABLES, *SLOTS))
    axes["linked"] = {"type": "array", "minItems": 1,
                      "items": {"type": "object", "minProperties": 1,
                                "propertyNames": {"pattern": rf"^({heads})(\..+)?$"}},
                      "description": "points that set several keys together (a learning rate tuned per "
                                     "method, say): each entry maps dotted keys or slot names to one value"}
    return {
        "type": "object",
        "description": "an ablation grid: the Cartesian product of these lists, each point one variant",
        "properties": axes,
        "propertyNames": {"pattern": rf"^(seeds|linked|({heads})(\..+)?)$"},
        "additionalProperties": {"type": "array", "minItems": 1},
    }


def _strip_titles(node):
    """pydantic's generated titles ("N Kv Heads") say less than the names; editors show descriptions."""
    if isinstance(node, list):
        return [_strip_titles(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in _SCHEMA or key in _SCHEMA_LISTS:
            out[key] = _strip_titles(value)
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _strip_titles(sub) for name, sub in value.items()}
        else:
            out[key] = copy.deepcopy(value)
    return out


def _plugin_help(name: str, cls: type) -> str:
    """The first paragraph of a plugin's own docstring, else of its module's."""
    return _first_paragraph(cls.__doc__) or _first_paragraph(inspect.getmodule(cls).__doc__) or f"plugin {name!r}"


def _use_help(slot: str, plugins: dict[str, type], default: str | None) -> str:
    versions = {p.name: f"{p.distribution} {p.version}" for p in discovery.installed().get(slot, [])}
    listed = ", ".join(f"{name} ({versions[name]})" if name in versions else name for name in plugins)
    return f"installed: {listed}" + (f"; default {default!r}" if default else "")


def _slot_help(slot: str, default: str | None) -> str:
    base = SLOT_BASES.get(slot)
    doc = _first_paragraph(sys.modules[base.__module__].__doc__) if base is not None and base is not Plugin else ""
    text = doc or f"The {slot} slot."
    if slot in MANY_SLOTS:
        text += " Many-valued: `use` names a list of plugins, each with its options under [" + slot + ".<name>]."
    else:
        text += " `use` names the plugin; the other keys are its options."
    return text + (f" Default plugin: {default!r}." if default else "")


def _first_paragraph(doc: str | None) -> str:
    if not doc:
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split()).replace("``", "`")
