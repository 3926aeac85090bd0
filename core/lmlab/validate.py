"""Validation of one variant: the core's tables and every named plugin's options, into a frozen
:class:`~lmlab.variant.Variant` with every default filled in.

Imports exactly the plugins the variant names (through discovery) and nothing heavier than torch.
"""

from pathlib import Path

from lmlab import composition, discovery
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
            others = point.uses.get(slot, set()) if slot in switched else set()
            slots[slot] = _single(slot, table, base_dir, slot in switched, notes, others)
    scored = None
    if "eval" in manifest:
        if not isinstance(manifest["eval"], dict):
            raise UserError("must be a table", key="eval")
        scored = validate_options(CORE_TABLES["eval"], manifest["eval"], "eval", base_dir)
    resolved = derive(tables["train"], tables["model"], slots.get("optimizer"), slots.get("parallel"))
    if "resolved" in manifest:
        _check_resolved(manifest["resolved"], resolved, tables["train"], tables["model"], base_dir)
    notes += _rule_notes(tables["train"], tables["model"], resolved)
    train = _resolve_train(tables["train"], slots.get("optimizer"), resolved)
    _resolve_order(slots, train.max_steps)
    return Variant(variant_name, experiment=name, seed=seed, description=description, model=tables["model"],
                   train=train, resolved=resolved, slots=slots, base_dir=base_dir, init=init, init_source=source,
                   eval=scored,
                   sweep=dict(point.settings) if point is not None else {}, notes=tuple(notes))


def _single(slot: str, table: dict, base_dir: Path, switched: bool, notes: list[str],
            others: set[str] = frozenset()) -> Choice:
    """``switched``: the sweep or a --set changed the slot's plugin; an option the plugin lacks is then
    dropped with a note when one of ``others`` (every plugin the manifest gives the slot) has it, and
    refused like any unknown option when none does: it could act in no variant."""
    use = table["use"]
    if not isinstance(use, str):
        raise UserError(f"must name one plugin, got {use!r}", key=f"{slot}.use")
    cls = discovery.load(slot, use, key=f"{slot}.use")
    values = {k: v for k, v in table.items() if k != "use"}
    if switched:
        fields = [_fields(slot, name) for name in sorted(others - {use})]
        dropped = sorted(k for k in set(values) - set(cls.Options.model_fields) if any(k in f for f in fields))
        for key in dropped:
            del values[key]
            notes.append(f"{slot}.{key} does not apply to {slot} plugin {use!r}; ignored")
    try:
        return composition.resolve(Choice(cls, validate_options(cls.Options, values, slot, base_dir, plugin=use)),
                                   slot, base_dir)
    except UserError as exc:
        if exc.message.startswith("unknown option") and exc.key and exc.key.count(".") == 1:
            raise UserError(exc.message + _owners(slot, use, exc.key.split(".")[-1]), key=exc.key) from None
        raise


def _fields(slot: str, name: str) -> set[str]:
    """The options of ``slot`` plugin ``name``; none for a name that does not load (the variant that
    uses it is refused for it)."""
    try:
        return set(discovery.load(slot, name).Options.model_fields)
    except Exception:  # noqa: BLE001 - a UserError, or a broken plugin that its own variant reports
        return set()


def _owners(slot: str, use: str, option: str) -> str:
    """Which other installed plugins of ``slot`` have ``option`` (an optimizer's option given to another
    optimizer). Only on this error path are the slot's other plugins imported."""
    owners = []
    for info in discovery.installed().get(slot, []):
        if info.name == use or info.name in owners:
            continue
        try:
            other = discovery.load(slot, info.name)
        except Exception:  # noqa: BLE001 - a broken plugin says nothing about this option
            continue
        if option in other.Options.model_fields:
            owners.append(info.name)
    if not owners:
        return ""
    return f"; it is an option of {slot} plugin{'s' if len(owners) > 1 else ''} {', '.join(map(repr, owners))}"


def _many(slot: str, table: dict, base_dir: Path) -> tuple[Choice, ...]:
    uses = table["use"]
    if isinstance(uses, str):
        uses = [uses]
    if not isinstance(uses, list) or not all(isinstance(u, str) for u in uses):
        raise UserError("must be a list of plugin names", key=f"{slot}.use")
    twice = next((u for i, u in enumerate(uses) if u in uses[:i]), None)
    if twice is not None:  # one [slot.<name>] table for both: the second copy could only repeat the first
        raise UserError(f"names {twice!r} twice; list each plugin once", key=f"{slot}.use")
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


def derive(train, model, optimizer: Choice | None, parallel: Choice | None):
    """The [resolved] numbers: the global batch in tokens, the learning-rate factor of
    ``train.lr_scaling`` (and the peak learning rate it gives), the gradient clip of ``grad_clip``."""
    from lmlab.config import ResolvedOptions

    batch_tokens = train.batch_size * train.grad_accum * model.block_size * _replicas(parallel)
    ratio = batch_tokens / train.base_batch_tokens if train.base_batch_tokens else 1.0
    factor = {"none": 1.0, "sqrt": ratio ** 0.5, "linear": ratio}[train.lr_scaling]
    lr = getattr(optimizer.options, "lr", None) if optimizer is not None else None
    clip = 0.1 * model.n_layers ** 0.5 if train.grad_clip == "auto" else float(train.grad_clip)
    return ResolvedOptions(batch_tokens=batch_tokens, lr_factor=factor,
                           lr=lr * factor if isinstance(lr, (int, float)) else None, grad_clip=clip)


def _rule_notes(train, model, resolved) -> list[str]:
    """What the scaling rules made of this variant, said where the run and lmlab check say notes."""
    notes = []
    if train.lr_scaling != "none" and resolved.lr is not None:
        notes.append(f"train.lr_scaling = \"{train.lr_scaling}\": peak learning rate {resolved.lr / resolved.lr_factor:g} × "
                     f"{resolved.lr_factor:.4g} = {resolved.lr:.4g} for {resolved.batch_tokens:,} tokens per step "
                     f"(base {train.base_batch_tokens:,})")
    if train.grad_clip == "auto":
        notes.append(f"train.grad_clip = \"auto\": {resolved.grad_clip:.4g} (0.1·sqrt({model.n_layers} layers))")
    return notes


def _replicas(parallel: Choice | None) -> int:
    """Data-parallel replicas (``Parallel.data_parallel_replicas``); 1 without a parallel plugin."""
    return int(parallel.build().data_parallel_replicas()) if parallel is not None else 1


def _check_resolved(given, derived, train, model, base_dir: Path) -> None:
    """A [resolved] table given back (a run folder's manifest.toml) must hold what the rules give."""
    from lmlab.config import ResolvedOptions

    if not isinstance(given, dict):
        raise UserError("must be a table", key="resolved")
    unknown = set(given) - set(ResolvedOptions.model_fields)
    if unknown:
        key = sorted(unknown)[0]
        raise UserError(f"unknown key{did_you_mean(key, list(ResolvedOptions.model_fields))}", key=f"resolved.{key}")
    why = {"grad_clip": (f"train.grad_clip = \"auto\", which gives 0.1·sqrt(model.n_layers = {model.n_layers})"
                         if train.grad_clip == "auto" else f"train.grad_clip = {train.grad_clip}"),
           "lr_factor": f"train.lr_scaling = \"{train.lr_scaling}\"", "lr": "optimizer.lr × lr_factor",
           "batch_tokens": "batch_size × grad_accum × block_size × data-parallel replicas"}
    for key, value in given.items():
        want = getattr(derived, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or want is None \
                or abs(value - want) > 1e-9 * max(1.0, abs(want)):
            raise UserError(f"{value!r} contradicts {why[key]} = {want!r}; [resolved] is written by lmlab from "
                            "those rules: remove it, or change the rule's own keys", key=f"resolved.{key}")


def _resolve_order(slots: dict, max_steps: int) -> None:
    """``order.steps`` unset stands for the whole run; one past ``train.max_steps`` would end the run
    before the hardest documents are ever drawn, so it is refused rather than trained."""
    order = slots.get("order")
    if order is None:
        return
    steps = getattr(order.options, "steps", None)
    if steps is None and "steps" in type(order.options).model_fields:
        order = Choice(order.plugin, order.options.model_copy(update={"steps": max_steps}))
    elif steps is not None and steps > max_steps:
        raise UserError(f"{steps} is past train.max_steps = {max_steps}: the run would end before training draws "
                        "from the hardest documents; leave it unset (the whole run) or lower it", key="order.steps")
    slots["order"] = order


def _resolve_train(train, optimizer: Choice | None, resolved=None):
    """[train] with the values its defaults stand for written in: a run and its manifest.toml agree
    on them, and the planner reads the same ones."""
    filled = {}
    if train.decay_steps is None:
        filled["decay_steps"] = train.max_steps
    if train.eval_batch_size is None:
        filled["eval_batch_size"] = 4 * train.batch_size
    lr = getattr(optimizer.options, "lr", None) if optimizer is not None else None
    if train.min_lr is None and isinstance(lr, (int, float)):
        filled["min_lr"] = lr * (resolved.lr_factor if resolved is not None else 1.0) / 10
    return train.model_copy(update=filled) if filled else train
