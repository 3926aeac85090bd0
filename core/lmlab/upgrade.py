"""Run folders recorded by an older lmlab, read by this one: their ``manifest.toml`` in today's terms.

Only a run's own recorded manifest is upgraded (an ``[init]`` source, a run loaded for ``generate``,
``eval``, ``serve``, ``compress``); a manifest a user writes is held to today's keys, and an old key
there is refused naming where it moved.
"""


def upgrade_recorded(recorded: dict) -> dict:
    """A run's recorded manifest in today's terms: with an ``[architecture]`` table, and its data order
    in ``[order]`` only."""
    return _order_from_curriculum(_architecture_from_model(recorded))


def _order_from_curriculum(recorded: dict) -> dict:
    """A run recorded before API 1.18 kept ``data.curriculum`` and its ``curriculum_*`` pacing (every
    run, at their defaults when it had no curriculum); one recorded before API 1.17 ordered its data
    only that way. The keys leave ``[data]``, and a curriculum becomes the ``[order]`` table when the
    record has none (from API 1.17 on, the record's ``[order]`` already says it)."""
    from lmlab.api.data import CURRICULUM_ORDERS, MOVED_TO_ORDER

    data = recorded.get("data")
    if not isinstance(data, dict) or not any(key in data for key in MOVED_TO_ORDER):
        return recorded
    data = dict(data)
    old = {new: data.pop(key) for key, new in MOVED_TO_ORDER.items() if key in data}
    kind = old.pop("use", "none")
    upgraded = {**recorded, "data": data}
    if kind != "none" and "order" not in recorded:
        upgraded["order"] = {"use": CURRICULUM_ORDERS.get(kind, kind), **old}
    return upgraded


def _architecture_from_model(recorded: dict) -> dict:
    """A run's recorded manifest with an ``[architecture]`` table: a run recorded before API 1.18 kept
    the family (``model.architecture``) and the encoder-decoder's options in ``[model]``. The family
    names the plugin when one of that name builds it (an encoder-decoder); else the slot's default
    builds it (a decoder, or an encoder under its objective)."""
    from lmlab import discovery
    from lmlab.config import MOVED_TO_ARCHITECTURE
    from lmlab.slots import DEFAULT_PLUGINS

    model = recorded.get("model")
    if "architecture" in recorded or not isinstance(model, dict):
        return recorded
    model = dict(model)
    moved = {key: model.pop(key) for key in MOVED_TO_ARCHITECTURE if key in model}
    family = moved.pop("architecture", None)
    names = {p.name for p in discovery.installed().get("architecture", [])}
    use = family if family in names and family in discovery.load("architecture", family).families \
        else DEFAULT_PLUGINS["architecture"]
    fields = discovery.load("architecture", use).Options.model_fields
    table = {"use": use, **{k: v for k, v in moved.items() if k in fields}}
    return {**recorded, "model": model, "architecture": table}
