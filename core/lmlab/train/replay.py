"""Rows of the ``[init]`` run's own training split mixed into a run's batches, as its data order asks
(``Order.replay_share``, the first-party ``replay`` order in ``lmlab-order``).

The choice of rows and of windows is drawn for the whole global batch from a generator seeded by
(seed, step), like every other draw of a batch, so a resumed run replays exactly the same rows and
each data-parallel replica takes its slice of the global batch's draws. A replayed row is plain text,
scored at every token (whatever the objective does with its own rows) and never padded.
"""

import numpy as np
import torch

from lmlab.api import UserError, Windows
from lmlab.train.batches import REPLAY_DRAWS, EndlessBatches

KEY = "order.use"


def check(variant, order, objective) -> None:
    """An order that replays needs an ``[init] from`` an lmlab run (its prepared corpus is what is
    replayed) and a causal objective (replayed rows are next-token text)."""
    from lmlab import pretrained

    if order is None or not order.replays:
        return
    source = variant.init_source
    if source is None:
        raise UserError(f"order {order.name!r} replays the [init] run's training corpus, and this run has no "
                        "[init] from = <run>", key=KEY)
    if not objective.causal:
        raise UserError(f"replayed rows are plain text for next-token prediction; objective {objective.name!r} "
                        "is not causal", key=KEY)
    if source.kind != pretrained.RUN:
        raise UserError(f"order {order.name!r} needs an lmlab run as [init] (its prepared corpus is what is "
                        f"replayed); {source.path} is a {source.kind} folder", key=KEY)


def replay_corpus(variant, order):
    """The [init] run's training tokens when the run's order replays, else None (:func:`check` has
    passed: ``run_variant`` checks every variant first)."""
    if order is None or not order.replays:
        return None
    from lmlab import manifest
    from lmlab.prepare import tokens as token_cache

    (init_variant,) = manifest.load(variant.init_source.folder / "manifest.toml", recorded=True)
    return token_cache.load_tokens(init_variant).train


class Replayed(EndlessBatches):
    """The batches of ``inner`` (which has ``batch(index)``, plain tensors or Windows) with each row,
    with probability ``share(step)``, replaced by a random window of ``corpus``."""

    def __init__(self, inner, corpus, share, block_size: int, batch_size: int, seed: int,
                 replica: int = 0, replicas: int = 1, start: int = 0, accum: int = 1):
        if len(corpus) <= block_size + 1:
            raise UserError(f"the [init] run's training split has {len(corpus)} tokens, too few for windows "
                            f"of {block_size + 1}", key=KEY)
        self.inner, self.corpus, self.share = inner, corpus, share
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed
        self.replica, self.replicas, self.start, self.accum = replica, replicas, start, accum
        self._offsets = np.arange(block_size + 1)

    def rows(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows of this replica's micro-batch to replace, start of the replayed window of each)."""
        step, first, total = self.slot(index)
        rng = np.random.default_rng([self.seed, REPLAY_DRAWS, step])
        chosen = rng.random(total) < self.share(step)
        starts = rng.integers(0, len(self.corpus) - self.block_size - 1, size=total)
        mine = slice(first, first + self.batch_size)
        rows = np.flatnonzero(chosen[mine])
        return rows, starts[mine][rows]

    def batch(self, index: int):
        out = self.inner.batch(index)
        rows, starts = self.rows(index)
        if len(rows) == 0:
            return out
        windows = torch.from_numpy(self.corpus[starts[:, None] + self._offsets].astype(np.int64))
        index_t = torch.from_numpy(rows)
        if not isinstance(out, Windows):
            out[index_t] = windows
            return out
        out.tokens[index_t] = windows
        if out.labels is not None:
            out.labels[index_t] = 1  # every token of a replayed row is scored
        if out.padding is not None:
            out.padding[index_t] = False
        return out
