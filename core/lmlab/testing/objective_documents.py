"""Objective checks over the documents of a split rather than one batch: a difficulty score is per
document and deterministic, and a data-parallel replica's rows are the global batch's rows.

The subject is :class:`lmlab.testing.objective.ObjectiveSubject`; these run from ``check_objective``.
"""

import dataclasses

import numpy as np
import torch

from lmlab.api import TokenSplit
from lmlab.testing.common import fail

ROWS = 4  # rows of the kit's global batch (lmlab.testing.objective draws its samples this size)


def difficulty(subject) -> None:
    """For an objective with a score (``difficulty`` not None, API 1.10): a float array of one finite
    score per document of the split; per document (the kit's documents in another order, and half of
    them, keep each document's score); deterministic (fresh instances under other global seeds give
    the same scores, and torch's global random state is left as it was)."""
    vocab = subject.vocabulary()
    split = subject.split(vocab)
    scores = []
    for global_seed in (1, 2):
        with subject.seeded(global_seed):
            state = torch.get_rng_state()
            scores.append(subject.objective(vocab).difficulty(split))
            if not torch.equal(state, torch.get_rng_state()):
                fail("difficulty drew from torch's global random state; a score must be a function of the document")
    if scores[0] is None:
        return
    n = len(split.document_starts)
    for got in scores:
        if not isinstance(got, np.ndarray) or got.shape != (n,) or got.dtype.kind not in "fiu":
            fail(f"difficulty returned {type(got).__name__} {getattr(got, 'shape', '')} "
                 f"{getattr(got, 'dtype', '')}: must be a numeric numpy array of shape (n_documents,) = ({n},)")
    first = scores[0].astype(np.float64)
    if not np.isfinite(first).all():
        bad = int(np.flatnonzero(~np.isfinite(first))[0])
        fail(f"difficulty of document {bad} is {first[bad]}: every score must be finite")
    if not np.array_equal(scores[0], scores[1]):
        fail("difficulty differs between two fresh instances under other global seeds: it must be deterministic")
    order = np.random.default_rng(subject.seed + 5).permutation(n)
    for label, chosen in (("in another order", order), ("half of them", np.arange(n // 2))):
        again = subject.objective(vocab).difficulty(_documents(split, chosen))
        if again is None or np.shape(again) != (len(chosen),):
            fail(f"difficulty of the documents {label} is {again!r:.80}, not one score per document")
        moved = np.flatnonzero(np.asarray(again, np.float64) != first[chosen])
        if len(moved):
            d = int(chosen[moved[0]])
            fail(f"difficulty of document {d} changed from {first[d]:.6g} to {again[moved[0]]:.6g} when given the "
                 f"documents {label}: a score must depend on its document alone")


def _documents(split: TokenSplit, chosen: np.ndarray) -> TokenSplit:
    """``split`` with only the documents ``chosen`` (indices), in that order."""
    ends = np.append(split.document_starts[1:], len(split.tokens))
    pieces = [np.arange(split.document_starts[d], ends[d]) for d in chosen]
    index = np.concatenate(pieces)
    starts = np.cumsum([0] + [len(p) for p in pieces[:-1]]).astype(np.int64)
    mask = None if split.loss_mask is None else np.asarray(split.loss_mask)[index]
    return dataclasses.replace(split, tokens=np.asarray(split.tokens)[index], loss_mask=mask, document_starts=starts)


def replica_slices(subject) -> None:
    """For an objective that takes Windows: rows 2..3 of a global batch of 4, given as their own Windows
    (``first_row`` 2, ``total_rows`` 4, the same seed), make rows 2..3 of the global batch's Batch: a
    data-parallel replica gets what one device would (``Windows.rand`` slices the global draw). A tensor
    field of k·4 rows is compared as k rows per window, k blocks of 4 (a pair batch's chosen rows, then
    its rejected ones) or k consecutive rows per window. The replicas of rows 0..1 and 2..3 have
    ``n_scored()`` that add up to the global batch's (evaluation sums every process's count)."""
    objective, windows, made = subject.sample()
    if not objective.wants_windows():
        return
    parts = [subject.batch(objective, dataclasses.replace(windows, first_row=rows.start, total_rows=ROWS, **{
        name: getattr(windows, name)[rows] for name in ("tokens", "labels", "padding")
        if getattr(windows, name) is not None})) for rows in (slice(0, 2), slice(2, ROWS))]
    mine, whole = ({f.name: getattr(b, f.name) for f in dataclasses.fields(b)} for b in (parts[1], made))
    for name, value in whole.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] % ROWS:
            continue  # not one or more rows per window
        k, rest = value.shape[0] // ROWS, value.shape[1:]
        expected = (value.reshape(k, ROWS, *rest)[:, 2:].reshape(-1, *rest),
                    value.reshape(ROWS, k, *rest)[2:].reshape(-1, *rest))
        if not (isinstance(mine.get(name), torch.Tensor) and any(
                mine[name].shape == e.shape and torch.equal(mine[name], e) for e in expected)):
            fail(f"rows 2..3 made as a replica's Windows (first_row 2 of 4) give other {name} than rows 2..3 of the "
                 "global batch: draw per-batch randomness with Windows.rand / randint, which slice the global draw")
    if int(parts[0].n_scored()) + int(parts[1].n_scored()) != int(made.n_scored()):
        fail(f"n_scored() of rows 0..1 and 2..3 made as replicas' Windows are {int(parts[0].n_scored())} and "
             f"{int(parts[1].n_scored())}, and the global batch's {int(made.n_scored())}: not their sum")
