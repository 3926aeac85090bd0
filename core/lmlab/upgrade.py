"""Run folders recorded by an older lmlab, read by this one: their ``manifest.toml`` in today's terms.

Only a run's own recorded manifest is upgraded (an ``[init]`` source, a run loaded for ``generate``,
``eval``, ``serve``, ``compress``); a manifest a user writes is held to today's keys, and an old key
there is refused naming where it moved.
"""


def upgrade_recorded(recorded: dict) -> dict:
    """A run's recorded manifest in today's terms: with an ``[architecture]`` table, and its data order
    in ``[order]`` only."""
    return _order_from_replay(_order_from_curriculum(_early_exit_to_architecture(_architecture_from_model(recorded))))


def _early_exit_to_architecture(recorded: dict) -> dict:
    """A run recorded before API 1.19 kept early exit in the core's tables (``model.exit_layers``, at []
    in every run, ``train.exit_loss_weight``, ``train.train_only``, ``decoding.exit_threshold``). They
    leave those tables; a run that had exit heads gets them as its architecture's options."""
    from lmlab import discovery
    from lmlab.api.architecture import MOVED_EARLY_EXIT

    upgraded, moved = dict(recorded), {}
    for (table, key), option in MOVED_EARLY_EXIT.items():
        values = recorded.get(table)
        if isinstance(values, dict) and key in values:
            upgraded[table] = {k: v for k, v in upgraded[table].items() if k != key}
            moved[option] = values[key]
    if not moved.get("exit_layers"):
        return upgraded
    moved["train_only_exits"] = moved.get("train_only_exits") is not None
    moved = {k: v for k, v in moved.items() if v is not None}
    architecture = dict(upgraded.get("architecture") or {})
    fields = discovery.load("architecture", architecture["use"]).Options.model_fields
    upgraded["architecture"] = {**architecture, **{k: v for k, v in moved.items() if k in fields}}
    return upgraded


def _order_from_replay(recorded: dict) -> dict:
    """A run recorded before API 1.19 kept ``data.replay`` (every run, 0.0 when it replayed nothing).
    A share above 0 becomes the replaying order's table; a run that also had a curriculum (API 1.17
    and 1.18 allowed both) keeps its curriculum, as no first-party order does both."""
    from lmlab.api.data import MOVED_TO_REPLAY

    ((key, (use, option)),) = MOVED_TO_REPLAY.items()
    data = recorded.get("data")
    if not isinstance(data, dict) or key not in data:
        return recorded
    data = dict(data)
    share = data.pop(key)
    upgraded = {**recorded, "data": data}
    order = recorded.get("order")
    if share and (not isinstance(order, dict) or not _orders_documents(order.get("use"))):
        upgraded["order"] = {"use": use, option: share}
    return upgraded


def _orders_documents(name) -> bool:
    """Whether the installed order plugin ``name`` scores the documents (a curriculum)."""
    from lmlab import discovery
    from lmlab.api import Order

    if not isinstance(name, str) or name not in {p.name for p in discovery.installed().get("order", [])}:
        return False
    return discovery.load("order", name).scores is not Order.scores


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
    from lmlab.api.run import MOVED_TO_ARCHITECTURE
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
