"""The tracker slot: where metrics go besides the run folder (W&B, ...)."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmlab.api.plugin import Plugin


@dataclass
class RunInfo:
    """One variant's identity, as a tracker needs it.

    ``group`` is the manifest's name and ``name`` the variant's; ``variant`` the name without its seed
    (what a variant's seeds share). ``config`` is the resolved manifest (nested) and ``flat_config``
    the same with dotted keys, lists joined into strings, ``None`` for keys only other variants of the
    sweep have, and ``variant``. ``plugins`` maps slot → {name, distribution, version};
    ``environment`` holds lmlab's version and git revision, torch's and Lightning's versions and the
    device (since API 1.2). ``resume`` is True when this continues an interrupted run, in which case
    the tracker should continue the same remote run (keep its id under ``run_dir``).
    """

    run_dir: Path
    group: str
    name: str
    config: dict[str, Any]
    flat_config: dict[str, Any]
    plugins: dict[str, Any] = field(default_factory=dict)
    resume: bool = False
    variant: str = ""
    environment: dict[str, Any] = field(default_factory=dict)


class Tracker(Plugin):
    """Called on the main process only."""

    slot = "tracker"

    def start(self, info: RunInfo) -> None:
        raise NotImplementedError

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def finish(self, summary: dict[str, Any], status: str) -> None:
        """``status`` is ``completed``, ``failed`` or ``interrupted``."""

    def closing_note(self, run_dirs: list[Path]) -> str | None:
        """Called once after ``lmlab run`` has gone through all its variants (their folders given),
        in the main process; what it returns is printed, e.g. how to upload offline runs (API 1.2)."""
        return None
