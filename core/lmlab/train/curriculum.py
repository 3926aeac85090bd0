"""The run's data order (the ``order`` slot, :mod:`lmlab.api.order`) as the samplers ask for it.

The plugin scores the training documents once, here; the samplers of :mod:`lmlab.train.batches`
then ask :meth:`Schedule.pool` at each step which documents they may draw from, and do the seeded,
vectorised drawing themselves, so an order plugin cannot break resume, replicas or accumulation.
What the first-party curricula score (length, rarity, the objective's difficulty) is in the
``lmlab-order`` distribution.
"""

from dataclasses import dataclass

import numpy as np

from lmlab.api import TrainingDocuments, UserError


@dataclass(frozen=True)
class Schedule:
    """The training documents in the plugin's order, and the plugin that says how many each step gets."""

    order: np.ndarray  # (N,) int64: indices of the non-empty training documents, easiest first
    plugin: object  # the lmlab.api.Order

    def pool(self, step: int) -> np.ndarray | None:
        """The documents ``step`` draws from, or None for all of them (the ordinary sampling)."""
        return self.plugin.pool(step, self.order)


def build(order, tokens, objective, starts: np.ndarray, ends: np.ndarray, keep: np.ndarray) -> Schedule | None:
    """The schedule ``order`` (an lmlab.api.Order, or None) makes of the training split, or None for
    uniform draws. ``starts``/``ends``: the non-empty documents the sampler draws, ``keep`` which
    entries of ``document_starts`` they are (to pick the objective's score per document)."""
    if order is None:
        return None
    key = "order.use"

    def difficulty() -> np.ndarray | None:
        given = objective.difficulty(tokens.split("train")) if objective is not None else None
        if given is None:
            return None
        given = np.asarray(given, dtype=np.float64)
        if given.shape != keep.shape or not np.isfinite(given).all():
            raise UserError(f"objective {objective.name!r} scored {given.shape} documents (or some not finite); the "
                            f"training split has {keep.shape[0]}", key=key)
        return given[keep]

    documents = TrainingDocuments(tokens.train, starts, ends, difficulty)
    score = order.scores(documents)
    if score is None:
        return None
    if len(starts) < 2:
        raise UserError(f"a curriculum orders the training documents, and the training split holds {len(starts)}; "
                        "use a corpus of many documents (jsonl, alpaca, preferences) or no data order",
                        key=key)
    score = np.asarray(score, dtype=np.float64)
    if score.shape != starts.shape or not np.isfinite(score).all():
        raise UserError(f"order plugin {order.name!r} scored {score.shape} documents (or some not finite); the "
                        f"training split has {len(starts)}", key=key)
    return Schedule(np.argsort(score, kind="stable").astype(np.int64), order)
