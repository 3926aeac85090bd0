"""The parallel slot: how the run is laid out over devices and nodes (a Lightning strategy)."""

from typing import Any

from lmlab.api.plugin import Plugin


class Parallel(Plugin):
    slot = "parallel"

    def trainer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``lightning.Trainer``: ``strategy``, ``accelerator``, ``devices``,
        ``num_nodes``. Called once, when the trainer is built; import Lightning here, not at the top."""
        raise NotImplementedError
