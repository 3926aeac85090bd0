"""A :class:`lmlab.api.RunSettings` for a plugin's own tests: a run with the tables and plugins a test
names, and every other value the default (no manifest, data or installed plugin needed)."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lmlab.api import Options
from lmlab.api.run import InitOptions, ModelOptions, ResolvedOptions, RunSettings, TrainOptions


@dataclass(frozen=True)
class StandInRun(RunSettings):
    experiment: str = "kit"
    name: str = "default"
    seed: int = 0
    model: ModelOptions = field(default_factory=ModelOptions)
    train: TrainOptions = field(default_factory=TrainOptions)
    resolved: ResolvedOptions | None = None
    init: InitOptions | None = None
    # slot → (plugin name, options), or for a many-valued slot (names, name → options)
    chosen: Mapping[str, tuple[str | tuple[str, ...], Any]] = field(default_factory=dict)

    def uses(self, slot: str) -> str | tuple[str, ...] | None:
        return self.chosen[slot][0] if slot in self.chosen else None

    def options(self, slot: str, plugin: str | None = None) -> Options:
        if slot not in self.chosen:
            raise KeyError(f"the stand-in run has no {slot} plugin: give stand_in_run({slot}=...)")
        names, options = self.chosen[slot]
        return options[plugin] if isinstance(names, tuple) else options

    @property
    def grad_clip(self) -> float:
        clip = self.train.grad_clip
        return self.resolved.grad_clip if self.resolved is not None else (0.0 if clip == "auto" else float(clip))

    @property
    def manifest(self) -> dict[str, Any]:
        out = {"name": self.experiment, "seed": self.seed, "model": self.model.model_dump(mode="json"),
               "train": self.train.model_dump(mode="json")}
        for slot, (name, options) in self.chosen.items():
            if isinstance(name, tuple):
                out[slot] = {"use": list(name), **{n: options[n].model_dump(mode="json") for n in name}}
            else:
                out[slot] = {"use": name, **options.model_dump(mode="json")}
        return out


def stand_in_run(*, model: dict | None = None, train: dict | None = None, experiment: str = "kit",
                 **slots: str | tuple[str, Options | dict] | list[str]) -> StandInRun:
    """A run with ``model`` and ``train`` tables (the rest defaults) and, for each slot given, its plugin:
    a name (the plugin's options are then plain ``lmlab.api.LaunchOptions`` for ``parallel``, empty
    otherwise), ``(name, options)``, or a list of names for a many-valued slot (``monitor``).
    ``stand_in_run(train={"max_steps": 20}, parallel="single", monitor=["grad-norm"])``."""
    chosen = {}
    for slot, given in slots.items():
        if isinstance(given, list):
            chosen[slot] = (tuple(given), {name: Options() for name in given})
            continue
        name, options = (given, None) if isinstance(given, str) else given
        if options is None:
            from lmlab.api import LaunchOptions

            options = LaunchOptions() if slot == "parallel" else Options()
        elif isinstance(options, dict):
            options = Options.model_validate(options) if not options else _loose(options)
        chosen[slot] = (name, options)
    return StandInRun(experiment=experiment, model=ModelOptions(**(model or {})), train=TrainOptions(**(train or {})),
                      chosen=chosen)


def _loose(values: dict) -> Options:
    """Options of a plugin the test does not load: the values as attributes."""
    fields = {key: (type(value), value) for key, value in values.items()}
    from pydantic import create_model

    return create_model("StandInOptions", __base__=Options, **fields)()
