"""Run folders recorded by an older lmlab, read by this one: their ``manifest.toml`` in today's terms.

Only a run's own recorded manifest is upgraded (an ``[init]`` source, a run loaded for ``generate``,
``eval``, ``serve``, ``compress``); a manifest a user writes is held to today's keys, and an old key
there is refused naming where it moved.
"""


def upgrade_recorded(recorded: dict) -> dict:
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
