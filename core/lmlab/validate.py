"""Validation of one variant: the core's tables and every named plugin's options, into a frozen
:class:`~lmlab.variant.Variant` with every default filled in.

Imports exactly the plugins the variant names (through discovery) and nothing heavier than torch.
"""

from pathlib import Path

from lmlab import discovery
from lmlab.config import CORE_TABLES, OPTIONAL_TABLES
from lmlab.errors import did_you_mean
from lmlab.errors import UserError
from lmlab.slots import MANY_SLOTS, SLOTS, TABLE
from lmlab.tables import NAME_PATTERN, TOP_LEVEL, validate_options
from lmlab.variant import Choice, Variant

#: Slots every variant has: named by the manifest, or given their default plugin.
REQUIRED_SLOTS = tuple(slot.name for slot in TABLE if slot.required or slot.default)


def validate_variant(variant_name: str, manifest: dict, base_dir: Path, point=None) -> Variant:
    """``manifest`` (a point of the grid, defaults merged in) as a Variant; ``point`` (an
    :class:`lmlab.manifest.Point`) says which keys the sweep set, which slots switched plugin and
    which keys the user gave. Errors name the key, and say when the sweep set it."""
    settings = point.settings if point is not None else {}
    try:
        return _validate(variant_name, manifest, base_dir, point)
    except UserError as exc:
        if exc.key and any(exc.key == k or exc.key.startswith(k + ".") or k.startswith(exc.key + ".")
                           for k in settings):
            raise UserError(f"in [sweep]: {exc}") from None
        raise


def _validate(variant_name: str, manifest: dict, base_dir: Path, point) -> Variant:
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
    description = manifest.get("description", "")
    if not isinstance(description, str):
        raise UserError("must be a string", key="description")

    init = source = None
    if "init" in manifest:
        # A fine-tune: the shape and tokenizer tables become the init's, before anything is validated.
        from lmlab import pretrained

        init = validate_options(CORE_TABLES["init"], manifest["init"], "init", base_dir)
        source = pretrained.locate(init.from_, init.checkpoint)
        manifest = pretrained.merge_tables(manifest, source, point.explicit if point else None, base_dir)
    tables = {}
    for table, options_cls in CORE_TABLES.items():
        if table in OPTIONAL_TABLES:
            continue
        values = manifest.get(table, {})
        if not isinstance(values, dict):
            raise UserError("must be a table", key=table)
        tables[table] = validate_options(options_cls, values, table, base_dir)

    slots, notes = {}, []
    switched = point.switched if point is not None else set()
    for slot in SLOTS:
        if slot not in manifest:
            if slot in REQUIRED_SLOTS:
                raise UserError(f"required: a [{slot}] table with use = \"<plugin>\"", key=slot)
            continue
        table = manifest[slot]
        if not isinstance(table, dict) or "use" not in table:
            raise UserError(f"[{slot}] needs use = \"<plugin name>\"", key=f"{slot}.use")
        if slot in MANY_SLOTS:
            slots[slot] = _many(slot, table, base_dir)
        else:
            slots[slot] = _single(slot, table, base_dir, slot in switched, notes)
    train = _resolve_train(tables["train"], slots.get("optimizer"))
    return Variant(variant_name, experiment=name, seed=seed, description=description, model=tables["model"],
                   train=train, slots=slots, base_dir=base_dir, init=init, init_source=source,
                   sweep=dict(point.settings) if point is not None else {}, notes=tuple(notes))


def _single(slot: str, table: dict, base_dir: Path, switched: bool, notes: list[str]) -> Choice:
    use = table["use"]
    if not isinstance(use, str):
        raise UserError(f"must name one plugin, got {use!r}", key=f"{slot}.use")
    cls = discovery.load(slot, use, key=f"{slot}.use")
    values = {k: v for k, v in table.items() if k != "use"}
    if switched:
        dropped = sorted(set(values) - set(cls.Options.model_fields))
        for key in dropped:
            del values[key]
            notes.append(f"{slot}.{key} does not apply to {slot} plugin {use!r}; ignored")
    return Choice(cls, validate_options(cls.Options, values, slot, base_dir, plugin=use))


def _many(slot: str, table: dict, base_dir: Path) -> tuple[Choice, ...]:
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
    chosen = []
    for use in uses:
        cls = discovery.load(slot, use, key=f"{slot}.use")
        options = validate_options(cls.Options, table.get(use, {}), f"{slot}.{use}", base_dir, plugin=use)
        chosen.append(Choice(cls, options))
    return tuple(chosen)


def _resolve_train(train, optimizer: Choice | None):
    """[train] with the values its defaults stand for written in: a run and its manifest.toml agree
    on them, and the planner reads the same ones."""
    filled = {}
    if train.decay_steps is None:
        filled["decay_steps"] = train.max_steps
    if train.eval_batch_size is None:
        filled["eval_batch_size"] = 4 * train.batch_size
    lr = getattr(optimizer.options, "lr", None) if optimizer is not None else None
    if train.min_lr is None and isinstance(lr, (int, float)):
        filled["min_lr"] = lr / 10
    return train.model_copy(update=filled) if filled else train
