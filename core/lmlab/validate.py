"""Validation of one variant: the core's tables and every named plugin's options.

Imports exactly the plugins the variant names (through discovery) and nothing heavier than torch.
"""

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from lmlab import discovery
from lmlab.config import CORE_TABLES, OPTIONAL_TABLES
from lmlab.discovery import MANY_SLOTS, SLOTS, did_you_mean
from lmlab.errors import UserError
from lmlab.manifest import NAME_PATTERN, TOP_LEVEL, Variant

REQUIRED_SLOTS = ("data", "tokenizer", "position", "attention", "ffn", "objective", "optimizer",
                  "parallel", "decoding", "tracker")


def validate_variant(variant_name: str, manifest: dict, base_dir: Path) -> Variant:
    sweep_keys = manifest.pop("_sweep", {})
    switched = set(manifest.pop("_switched", []))
    explicit = manifest.pop("_explicit", None)
    if explicit is not None:
        explicit = [*explicit, *sweep_keys]
    try:
        return _validate(variant_name, manifest, base_dir, switched, explicit)
    except UserError as exc:
        if exc.key and any(exc.key == k or exc.key.startswith(k + ".") or k.startswith(exc.key + ".")
                           for k in sweep_keys):
            raise UserError(f"in [sweep]: {exc}") from None
        raise


def _validate(variant_name: str, manifest: dict, base_dir: Path, switched: set,
              explicit: list[str] | None = None) -> Variant:
    known = (*TOP_LEVEL, *SLOTS, *CORE_TABLES)
    for key in manifest:
        if key not in known:
            raise UserError(f"unknown slot or table{did_you_mean(key, known)}", key=key)
    name = manifest.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise UserError("required: a name of letters, digits, '.', '_' or '-' (it names the run folder)",
                        key="name")
    seed = manifest.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        # numpy's and Lightning's seeding take 32 bits
        raise UserError(f"must be an integer from 0 to {2**32 - 1}, got {seed!r}", key="seed")
    if not isinstance(manifest.get("description", ""), str):
        raise UserError("must be a string", key="description")

    resolved: dict[str, Any] = {"name": name, "seed": seed, "description": manifest.get("description", "")}
    if "init" in manifest:
        # A fine-tune: the shape and tokenizer tables become the init's, before anything is validated.
        from lmlab import pretrained

        init = validate_options(CORE_TABLES["init"], manifest["init"], "init", base_dir)
        manifest = pretrained.merge_tables(manifest, init, explicit, base_dir)
    for table, options_cls in CORE_TABLES.items():
        if table in OPTIONAL_TABLES and table not in manifest:
            continue
        values = manifest.get(table, {})
        if not isinstance(values, dict):
            raise UserError("must be a table", key=table)
        resolved[table] = validate_options(options_cls, values, table, base_dir).model_dump(mode="json")

    variant = Variant(variant_name, resolved, base_dir=base_dir)
    for slot in SLOTS:
        if slot not in manifest:
            if slot in REQUIRED_SLOTS:
                raise UserError(f"required: a [{slot}] table with use = \"<plugin>\"", key=slot)
            continue
        table = manifest[slot]
        if not isinstance(table, dict) or "use" not in table:
            raise UserError(f"[{slot}] needs use = \"<plugin name>\"", key=f"{slot}.use")
        if slot in MANY_SLOTS:
            _many(variant, slot, table, base_dir)
        else:
            _single(variant, slot, table, base_dir, slot in switched)
    return variant


def _single(variant: Variant, slot: str, table: dict, base_dir: Path, switched: bool) -> None:
    use = table["use"]
    if not isinstance(use, str):
        raise UserError(f"must name one plugin, got {use!r}", key=f"{slot}.use")
    cls = discovery.load(slot, use, key=f"{slot}.use")
    values = {k: v for k, v in table.items() if k != "use"}
    if switched:
        dropped = sorted(set(values) - set(cls.Options.model_fields))
        for key in dropped:
            del values[key]
            variant.notes.append(f"{slot}.{key} does not apply to {slot} plugin {use!r}; ignored")
    options = validate_options(cls.Options, values, slot, base_dir, plugin=use)
    variant.plugins[slot] = cls
    variant.manifest[slot] = {"use": use, **options.model_dump(mode="json")}


def _many(variant: Variant, slot: str, table: dict, base_dir: Path) -> None:
    uses = table["use"]
    if isinstance(uses, str):
        uses = [uses]
    if not isinstance(uses, list) or not all(isinstance(u, str) for u in uses):
        raise UserError("must be a list of plugin names", key=f"{slot}.use")
    extra = set(table) - {"use", *uses}
    if extra:
        key = sorted(extra)[0]
        raise UserError(f"options of a {slot} plugin go under [{slot}.<name>]; {key!r} is not in use = {uses}",
                        key=f"{slot}.{key}")
    classes, resolved = [], {"use": uses}
    for use in uses:
        cls = discovery.load(slot, use, key=f"{slot}.use")
        options = validate_options(cls.Options, table.get(use, {}), f"{slot}.{use}", base_dir, plugin=use)
        classes.append(cls)
        resolved[use] = options.model_dump(mode="json")
    variant.plugins[slot] = classes
    variant.manifest[slot] = resolved


def validate_options(options_cls, values: Any, prefix: str, base_dir: Path, plugin: str | None = None):
    if not isinstance(values, dict):
        raise UserError("must be a table", key=prefix)
    try:
        return options_cls.model_validate(values, context={"base_dir": base_dir})
    except ValidationError as exc:
        raise _user_error(exc, options_cls, prefix, plugin) from None


def _user_error(exc: ValidationError, options_cls, prefix: str, plugin: str | None) -> UserError:
    errors = exc.errors()
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"])
    key = f"{prefix}.{loc}" if loc else prefix
    owner = f" of plugin {plugin!r}" if plugin else f" in [{prefix}]"
    if first["type"] == "extra_forbidden":
        names = [field.alias or name for name, field in options_cls.model_fields.items()]  # [init] `from`
        message = f"unknown option{owner}{did_you_mean(loc, names)}"
    else:
        message = first["msg"]
        if first["type"] != "missing":
            message += f" (got {first['input']!r})"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return UserError(message + more, key=key)
