"""Plugins named inside another plugin's options (``Architecture.components``): a hybrid's
``[architecture.mixers.M] use = "mamba"``.

Each nested table is validated here, at resolution, exactly as a slot's own table is: the plugin is
loaded by slot and name through discovery (never an import path), its options are its own Options
model, and a problem names the dotted key (``architecture.mixers.M.d_state``). The resolved tables,
every default filled in, replace the user's in the outer plugin's options, so ``manifest.toml``
records them; the nested choices travel with the outer one (``Choice.components``) for the checks,
``provenance.json`` and the build.
"""

from pathlib import Path

from lmlab import discovery
from lmlab.errors import UserError
from lmlab.tables import validate_options


def resolve(choice, key: str, base_dir: Path):
    """``choice`` (a Choice) with its nested plugin tables validated; ``key`` is its table's dotted
    key (``architecture``)."""
    from lmlab.variant import Choice

    declared = getattr(choice.plugin, "components", None) or {}
    if not declared:
        return choice
    components, update = {}, {}
    for field, slot in declared.items():
        tables = getattr(choice.options, field, None) or {}
        if not isinstance(tables, dict):
            raise UserError(f"must be a table of {slot} plugin tables", key=f"{key}.{field}")
        chosen, resolved = {}, {}
        for label, table in tables.items():
            where = f"{key}.{field}.{label}"
            if not isinstance(table, dict):
                raise UserError(f"must be a table naming a {slot} plugin (use = \"<name>\") and its options",
                                key=where)
            use = table.get("use")
            if not isinstance(use, str):
                raise UserError(f"needs use = \"<name of a {slot} plugin>\"", key=f"{where}.use")
            cls = discovery.load(slot, use, key=f"{where}.use")
            options = validate_options(cls.Options, {k: v for k, v in table.items() if k != "use"}, where,
                                       base_dir, plugin=use)
            inner = resolve(Choice(cls, options), where, base_dir)
            chosen[label] = inner
            resolved[label] = {"use": use, **inner.table()}
        components[field], update[field] = chosen, resolved
    return Choice(choice.plugin, choice.options.model_copy(update=update), components)
