"""The data-order slot (API 1.17): which training documents each step's global batch draws from.

An [Order][lmlab.api.order.Order] plugin scores the training documents once, when a run builds its
batches, and says at each optimizer step which of them training may draw from; the core keeps the
drawing itself (vectorised, seeded by (seed, step), sliced per data-parallel replica and
micro-batch), so whatever a plugin decides, a resumed run, N replicas and k accumulated
micro-batches see exactly the batches one device would. Window starts inside the allowed documents
are uniform, weighted by the filters' sample weights when there are any; whole-document sampling
(``Objective.sampling = "documents"``) draws the allowed documents without repeats while they suffice.

The default schedule is the competence curriculum of Platanios et al. 2019: at step s training draws
from the easiest ⌈c(s)·N⌉ documents, c growing from ``start`` at step 0 to 1 at ``steps`` (linearly,
or as c(s) = min(1, sqrt(s·(1 − c0²)/S + c0²)) for ``root``). A plugin that only brings a difficulty
score overrides [scores][lmlab.api.order.Order.scores]; one with its own sampling policy (a cyclic
curriculum, a held-out band, self-paced learning on a fixed schedule) overrides
[pool][lmlab.api.order.Order.pool], which must be a pure function of the step.

An order may also draw part of each batch from the ``[init]`` run's own training split (API 1.19):
[replay_share][lmlab.api.order.Order.replay_share] says how much at each step, and the core draws
those rows, like the others, from (seed, step).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np

from lmlab.api.options import Field, Options
from lmlab.api.plugin import Plugin


class OrderOptions(Options):
    """The pacing every order plugin has; a plugin's options subclass these."""

    start: float = Field(0.2, gt=0, le=1, help="share of the training documents, the easiest, that training draws "
                                               "from at step 0")
    steps: int | None = Field(None, ge=1, help="the step from which training draws from every document (the share "
                                               "grows until then); unset: train.max_steps, the whole run")
    pacing: Literal["linear", "root"] = Field(
        "root", help="how the share grows: linear, or root (sqrt; Platanios et al. 2019's competence, which adds "
                     "hard documents sooner)")


@dataclass(frozen=True)
class TrainingDocuments:
    """The non-empty documents of the training split, as training draws them."""

    tokens: object
    """The split's token ids (a 1-D array or memory map; read it in chunks for a large corpus)."""
    starts: np.ndarray
    """(N,) int64: where each non-empty document starts in ``tokens``."""
    ends: np.ndarray
    """(N,) int64: where each ends (exclusive)."""
    _difficulty: Callable[[], np.ndarray | None] = field(default=lambda: None, repr=False)

    def __len__(self) -> int:
        return len(self.starts)

    def difficulty(self) -> np.ndarray | None:
        """The objective's own score of each of these documents (``Objective.difficulty``, e.g. a
        teacher's loss), or None when the objective gives none. Computed on the first call."""
        return self._difficulty()


class Order(Plugin):
    """Decides which training documents each optimizer step draws from (API 1.17).

    Called in each training process when the run builds its batches: [scores][lmlab.api.order.Order.scores]
    once, then [pool][lmlab.api.order.Order.pool] once per step (keep it cheap: a slice). Both must
    be pure functions of their inputs and the options, so that every process and a resumed run agree.
    """

    slot = "order"
    Options = OrderOptions
    uses_difficulty: ClassVar[bool] = False
    """True when [scores][lmlab.api.order.Order.scores] reads the objective's ``difficulty``: an
    objective without one is refused at ``lmlab check``."""
    replays: ClassVar[bool] = False
    """True when [replay_share][lmlab.api.order.Order.replay_share] can be above 0 (API 1.19): the
    core then loads the ``[init]`` run's training split, and ``lmlab check`` refuses a run without an
    ``[init] from`` an lmlab run, or with an objective that is not causal."""

    def scores(self, documents: TrainingDocuments) -> np.ndarray | None:
        """A difficulty per document, lower first; ties keep corpus order.

        Returns:
            (N,) finite floats, or None for no ordering at all: training draws uniformly over the
            corpus, as with no order plugin (the default, ``uniform``).

        Raises:
            UserError: The documents or the objective cannot be scored (naming the manifest key).
        """
        return None

    def competence(self, step: int) -> float:
        """The share of the documents, the easiest, that training draws from at ``step``."""
        steps, c0 = self.options.steps, self.options.start
        if steps is None or step >= steps:
            return 1.0
        t = step / steps
        if self.options.pacing == "linear":
            return min(1.0, c0 + (1.0 - c0) * t)
        return min(1.0, math.sqrt(t * (1.0 - c0 * c0) + c0 * c0))

    def pool(self, step: int, order: np.ndarray) -> np.ndarray | None:
        """The documents (indices into the training documents) that ``step`` draws from.

        Args:
            step: The optimizer step (every micro-batch and replica of it gets the same answer).
            order: (N,) int64, the documents sorted by [scores][lmlab.api.order.Order.scores].

        Returns:
            A non-empty int64 array, or None for every document (the ordinary sampling). Default: the
            easiest ⌈competence(step)·N⌉ (at least one), None once that is all of them.
        """
        n = len(order)
        available = max(1, min(n, math.ceil(self.competence(step) * n)))
        return None if available >= n else order[:available]

    def replay_share(self, step: int) -> float:
        """The share of ``step``'s global batch taken instead from the ``[init]`` run's own training
        split (API 1.19; read only when [replays][lmlab.api.order.Order.replays] is True).

        The core replaces each row of the global batch with this probability by a random window of
        that split (tokenised by the init's tokenizer, which is this run's), drawn from (seed, step)
        and sliced per replica like every other draw. A replayed row is plain text, scored at every
        token and never padded, whatever the objective does with its own rows. Must be a pure
        function of ``step`` in [0, 1). Default 0: no row is replaced.
        """
        return 0.0
