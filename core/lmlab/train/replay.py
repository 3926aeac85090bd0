"""Replay: a share of the fine-tuning rows taken from the pretraining corpus, against forgetting.

Fine-tuning on a narrow task wears away what pretraining taught (catastrophic forgetting, McCloskey &
Cohen 1989); mixing a little of the pretraining data back into the fine-tuning batches is the
simplest remedy, and it is standard practice for continued pretraining and instruction tuning
(e.g. Ouyang et al. 2022, "PPO-ptx"; Ibrahim et al. 2024 replay 1–5 %). ``[data] replay = 0.05``
replaces each training row, with probability 0.05, by a random window of the ``[init]`` run's own
training split (its prepared tokens, through the same cache; the tokenizer is the init's, so the ids
agree). A replayed row is plain text, scored at every token, whatever the objective does with its
own rows (``sft`` scores only responses), and never padded.

The choice of rows and of windows is drawn for the whole global batch from a generator seeded by
(seed, step), like every other draw of a batch, so a resumed run replays exactly the same rows and
each data-parallel replica takes its slice of the global batch's draws.
"""


import numpy as np
import torch

from lmlab.api import UserError, Windows
from lmlab.train.batches import REPLAY_DRAWS, EndlessBatches


def replay_corpus(variant, objective):
    """The [init] run's training tokens when ``data.replay`` asks for them, else None."""
    fraction = variant.manifest["data"].get("replay") or 0.0
    if not fraction:
        return None
    from lmlab import manifest, pretrained
    from lmlab.prepare import tokens as token_cache

    source = variant.init_source
    if source is None:
        raise UserError("replays the [init] run's training corpus, and this run has no [init] from = <run>",
                        key="data.replay")
    if not objective.causal:
        raise UserError(f"replayed rows are plain text for next-token prediction; objective {objective.name!r} "
                        "is not causal", key="data.replay")
    if source.kind != pretrained.RUN:
        raise UserError(f"needs an lmlab run as [init] (its prepared corpus is what is replayed); "
                        f"{source.path} is a {source.kind} folder", key="data.replay")
    (init_variant,) = manifest.load(source.folder / "manifest.toml", recorded=True)
    return token_cache.load_tokens(init_variant).train


class Replayed(EndlessBatches):
    """The batches of ``inner`` (which has ``batch(index)``, plain tensors or Windows) with each row,
    with probability ``fraction``, replaced by a random window of ``corpus``."""

    def __init__(self, inner, corpus, fraction: float, block_size: int, batch_size: int, seed: int,
                 replica: int = 0, replicas: int = 1, start: int = 0, accum: int = 1):
        if len(corpus) <= block_size + 1:
            raise UserError(f"the [init] run's training split has {len(corpus)} tokens, too few for windows "
                            f"of {block_size + 1}", key="data.replay")
        self.inner, self.corpus, self.fraction = inner, corpus, fraction
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed
        self.replica, self.replicas, self.start, self.accum = replica, replicas, start, accum
        self._offsets = np.arange(block_size + 1)

    def rows(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows of this replica's micro-batch to replace, start of the replayed window of each)."""
        step, first, total = self.slot(index)
        rng = np.random.default_rng([self.seed, REPLAY_DRAWS, step])
        chosen = rng.random(total) < self.fraction
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
