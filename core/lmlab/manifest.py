"""TOML manifest → validated, fully resolved variants (:class:`lmlab.variant.Variant`).

Order of resolution: the slot table's defaults (plugin names only), then the manifest, then ``--set``
overrides, then one variant per point of the ``[sweep]`` grid. Each variant is validated on its own
(:mod:`lmlab.validate`), against the core's tables and the options of the plugins it names, and every
error names the key.
"""

import copy
import itertools
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmlab.errors import did_you_mean
from lmlab.errors import UserError
from lmlab.slots import DEFAULT_PLUGINS, SLOTS
from lmlab.tables import CORE_TABLE_NAMES, TOP_LEVEL, read_toml

LINKED = "linked"  # the [sweep] axis whose entries each set several keys together
DEFAULT_SEED = 1337
MAX_VARIANTS = 10_000  # beyond this a grid is a mistake, and expanding it would exhaust memory
NAME_MAX = 255  # bytes in a folder name on Linux and macOS file systems


@dataclass
class Point:
    """What resolution knows of one point of the grid besides its manifest: how it came about."""

    settings: dict[str, Any] = field(default_factory=dict)  # the [sweep] keys set at this point
    switched: set[str] = field(default_factory=set)  # slots whose plugin an override or the sweep changed
    explicit: list[str] = field(default_factory=list)  # dotted keys the user set (not the defaults)
    # slot → every plugin the manifest gives it: its table's own `use`, a --set, the sweep's values.
    # A switched slot drops (with a note) only the options one of these has; the rest are refused.
    uses: dict[str, set[str]] = field(default_factory=dict)


def load(path: str | Path, overrides: list[str] = (), resolve_init: bool = True, recorded: bool = False) -> list:
    """Every variant of the manifest at ``path`` with ``overrides`` ("dotted.key=value") applied.

    ``recorded``: ``path`` is a run folder's own manifest.toml, which an older lmlab may have written;
    it is read in today's terms (:mod:`lmlab.upgrade`), where a manifest a user writes is held to them.
    ``resolve_init=False`` (implies ``recorded``) leaves out the ``[init]`` table: for a run folder's
    own manifest.toml, whose tables are resolved already and whose weights come from its own
    checkpoints (``lmlab generate``), so that the run still loads when the run it was fine-tuned from
    has moved.
    """
    import dataclasses

    from lmlab.validate import validate_variant  # imports the named plugins, pydantic and torch

    path = Path(path)
    raw = read_toml(path)
    if recorded or not resolve_init:
        from lmlab.upgrade import upgrade_recorded

        raw = upgrade_recorded(raw)
    if not resolve_init:
        raw.pop("init", None)
    merged = _deep_merge(defaults(), raw)
    # What the user set, as opposed to the defaults: [init] refuses only values the user gave that
    # contradict the init (lmlab.pretrained); the sweep's keys are added per variant.
    base = Point(explicit=_dotted_keys(raw), uses=_uses(merged, {}))  # the file's own, before --set
    for item in overrides:
        key, value = _parse_override(item)
        if _set_dotted(merged, key, value, source=f"--set {item}"):
            base.switched.add(key.split(".")[0])
        base.explicit.append(key)
    sweep = merged.pop("sweep", {})
    if not isinstance(sweep, dict):
        raise UserError("must be a table of dotted keys to lists", key="sweep")
    base.uses = _uses(merged, sweep, base.uses)
    base_dir = path.resolve().parent
    variants = [validate_variant(name, manifest, base_dir, point) for name, manifest, point in _expand(merged, sweep, base)]
    peer_keys = tuple(sorted({key for v in variants for key in _dotted_keys(v.manifest)}))
    return [dataclasses.replace(v, peer_keys=peer_keys) for v in variants]


def defaults() -> dict:
    """What a manifest gets for what it leaves out: the seed, and each slot's default plugin (names
    only: a plugin's options default in its own Options class)."""
    return {"seed": DEFAULT_SEED, **{slot: {"use": plugin} for slot, plugin in DEFAULT_PLUGINS.items()}}


def _uses(tree: dict, sweep: dict, uses: dict | None = None) -> dict[str, set[str]]:
    """slot → the plugin names ``tree`` (a manifest's tables) and the ``[sweep]`` give it, added to
    ``uses``. Malformed values are left for validation to name."""
    uses = {slot: set(names) for slot, names in (uses or {}).items()}

    def add(key: str, value) -> None:
        if "." not in key and isinstance(value, dict):  # a whole table per point
            key, value = f"{key}.use", value.get("use")
        slot, _, option = key.partition(".")
        if option == "use" and isinstance(value, str):
            uses.setdefault(slot, set()).add(value)

    for slot, table in tree.items():
        if slot in SLOTS and isinstance(table, dict):
            add(f"{slot}.use", table.get("use"))
    for key, values in sweep.items():
        for value in values if isinstance(values, list) else ():
            if key == LINKED and isinstance(value, dict):
                for sub, linked in value.items():
                    add(sub, linked)
            elif key != LINKED:
                add(key, value)
    return uses


def _dotted_keys(tree: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in tree.items():
        if isinstance(value, dict):
            keys += _dotted_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def _deep_merge(base: dict, top: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set takes key=value, got {item!r}")
    return key.strip(), parse_value(text.strip())


def parse_value(text: str) -> Any:
    """A TOML literal (1, 1e-3, true, [1, 2], "x") or else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_dotted(tree: dict, key: str, value: Any, source: str) -> bool:
    """Set ``key`` in ``tree``; True when it switches a slot's plugin (``<slot>.use`` to another one):
    validation then keeps the table's options the new plugin declares and drops (with a note) those it
    does not, so `n_kv_heads` survives a sweep over mha/gqa/mqa."""
    parts = key.split(".")
    known = (*TOP_LEVEL, *SLOTS, *CORE_TABLE_NAMES)
    if parts[0] not in known:
        raise UserError(f"unknown slot or table {parts[0]!r} in {source}{did_you_mean(parts[0], known)}", key=key)
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"{part!r} is not a table ({source})", key=key)
        node = child
    switched = len(parts) == 2 and parts[1] == "use" and node.get("use") != value
    node[parts[-1]] = value
    return switched


def _expand(merged: dict, sweep: dict, base: Point):
    """(variant name, manifest, Point) for each point of the sweep grid, seeds innermost."""
    seeds = sweep.get("seeds")
    axes = {k: v for k, v in sweep.items() if k != "seeds"}
    for key, values in axes.items():
        if not isinstance(values, list) or not values:
            raise UserError("a sweep axis must be a non-empty list", key=f"sweep.{key!r}")
        if key == LINKED:
            for i, entry in enumerate(values):
                if not isinstance(entry, dict) or not entry:
                    raise UserError("each entry must be a non-empty table of dotted keys to values, set together",
                                    key=f"sweep.linked[{i}]")
                for sub in entry:
                    _check_axis_key(sub, f"sweep.linked[{i}].{sub!r}")
                    if sub in axes:  # one key, two axes: which value wins would be an accident
                        raise UserError(f"{sub!r} is also a sweep axis of its own; set it in one place",
                                        key=f"sweep.linked[{i}].{sub!r}")
        else:
            _check_axis_key(key, f"sweep.{key!r}")
    if seeds is not None and (not isinstance(seeds, list) or not seeds
                              or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
        raise UserError("must be a non-empty list of integers", key="sweep.seeds")
    size = math.prod(len(values) for values in axes.values()) * len(seeds or [None])
    if size > MAX_VARIANTS:
        shape = " × ".join(str(len(v)) for v in (*axes.values(), *([seeds] if seeds else [])))
        raise UserError(f"{shape} = {size:,} variants; a sweep holds at most {MAX_VARIANTS:,} (split it into "
                        "several manifests, or sample the grid)", key="sweep")
    grid = list(itertools.product(*axes.values())) or [()]
    for values in grid:
        for seed in seeds or [None]:
            manifest = copy.deepcopy(merged)
            point = Point(switched=set(base.switched), explicit=list(base.explicit), uses=base.uses)
            parts = []
            for key, value in zip(axes, values):
                # A `linked` entry is one point of several keys at once, e.g. a learning rate tuned
                # per method: {peft = {use = "lora", r = 8}, "optimizer.lr" = 2e-3}.
                point.settings.update(value if key == LINKED else {key: value})
            for key, value in point.settings.items():
                if isinstance(value, dict) and "." not in key:
                    # A whole table per point: linked options that a product of axes cannot
                    # express, e.g. {use = "moe", top_k = 2, hidden = 256} against {use = "mlp"}.
                    manifest[key] = copy.deepcopy(value)
                elif _set_dotted(manifest, key, value, source=f"[sweep] {key!r}"):
                    point.switched.add(key.split(".")[0])
                parts.append(f"{key}={_short(value)}")
            point.explicit += point.settings
            if seed is not None:
                manifest["seed"] = seed
                parts.append(f"seed={seed}")
            name = ",".join(parts) or "default"
            if len(name.encode()) > NAME_MAX:  # the variant's folder could not be created
                raise UserError(f"the variant name {name[:60]}... is {len(name.encode())} bytes long, more than a "
                                f"folder name may be ({NAME_MAX}); sweep over shorter values", key="sweep")
            yield name, manifest, point


def _check_axis_key(key: str, where: str) -> None:
    if key.split(".")[0] not in (*SLOTS, *CORE_TABLE_NAMES, "seed"):
        raise UserError(f"sweep key {key!r} names no slot or table", key=where)


def _short(value: Any) -> str:
    if isinstance(value, dict):  # a table: its plugin, then its options: moe+top_k=2+hidden=256
        items = [str(value["use"])] if "use" in value else []
        items += [f"{k}={_short(v)}" for k, v in value.items() if k != "use"]
        return "+".join(items)
    text = value if isinstance(value, str) else repr(value).replace(" ", "")
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", str(text))
