"""No tracker: metrics go to the run folder only (``metrics.jsonl``, ``summary.json``).

The core writes the run folder whatever the tracker; this plugin is the explicit "nothing else",
for runs that must not create tracker files or start tracker processes.
"""

from typing import Any

from lmlab.api import RunInfo, Tracker


class NoTracker(Tracker):
    """Accepts every call and does nothing."""

    def start(self, info: RunInfo) -> None:
        pass

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def finish(self, summary: dict[str, Any], status: str) -> None:
        pass
