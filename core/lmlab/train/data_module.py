"""The prepared tokens as Lightning batches: windows or documents, drawn as the objective asks,
and the checks that the data can fill a row at all."""

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from lmlab.api import UserError
from lmlab.train import curriculum
from lmlab.train.batches import (FixedDocuments, FixedWindowBatches, FixedWindows, RandomDocuments, RandomWindows,
                                 document_spans)
from lmlab.train.replay import Replayed


def count_too_long(tokens, block_size: int) -> dict[str, tuple[int, int]]:
    """For an objective that leaves out documents a row cannot hold whole (``drops_truncated``): per
    split, how many of its non-empty documents are longer than ``block_size`` tokens (a row of
    block_size + 1 holds one whole only with padding after it), and how many there are. Refused,
    naming model.block_size, when a split keeps none: its every batch would score nothing."""
    out = {}
    for split in ("train", "val"):
        starts, ends = document_spans(getattr(tokens, split), tokens.document_starts(split))
        long, total = int(((ends - starts) > block_size).sum()), len(starts)
        if total and long == total:
            raise UserError(f"every one of the {total:,} {split} documents is longer than model.block_size = "
                            f"{block_size} tokens, and the objective leaves such documents out of the loss: none "
                            f"would be scored; the shortest holds {int((ends - starts).min()):,}, so raise "
                            "model.block_size", key="model.block_size")
        out[split] = (long, total)
    return out


class TokenDataModule(L.LightningDataModule):
    """Batches of the prepared tokens, drawn as the objective asks (see :mod:`lmlab.train.batches`).

    With an ``objective`` that asks for Windows, its ``token_labels`` are set up here, once per split
    (which is where a corpus that cannot serve it is refused), and batches are Windows of random or
    fixed windows, or of padded documents; otherwise plain (B, T+1) tensors. That each split holds a
    window was checked where the tokens were loaded (``lmlab.assemble``).
    """

    def __init__(self, tokens, block_size: int, batch_size: int, eval_batch_size: int, eval_steps: int,
                 seed: int, grad_accum: int, objective=None, replay=None, order=None):
        super().__init__()
        self.replay, self.order = replay, order  # the [init] run's training tokens when the order replays
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.eval_batch_size, self.eval_steps, self.seed = eval_batch_size, eval_steps, seed
        self.grad_accum = grad_accum
        self.full_validation = False
        self.rich = objective is not None and objective.wants_windows()
        self.sampling = objective.sampling if objective is not None else "windows"
        if self.sampling not in ("windows", "documents"):
            raise ValueError(f"objective {objective.name!r}: sampling must be 'windows' or 'documents', "
                             f"not {self.sampling!r}")
        if self.sampling == "documents" and not self.rich:
            raise TypeError(f"objective {objective.name!r} samples padded documents, so it must override "
                            "make_batch_from (only Windows say where the padding is)")
        # split → (documents too long for a row, non-empty documents), where the objective drops those.
        self.too_long = (count_too_long(tokens, block_size)
                         if self.sampling == "documents" and objective.drops_truncated else {})
        self.labels = {split: objective.token_labels(tokens.split(split)) if self.rich else None
                       for split in ("train", "val")}
        self.curriculum, self.train_documents, self.weights = None, None, None
        weights = tokens.document_weights("train") if hasattr(tokens, "document_weights") else None
        # ``order``: the run's lmlab.api.Order plugin (the ``order`` slot), None for uniform draws.
        if order is not None or weights is not None:
            document_starts = tokens.document_starts("train")
            starts, ends = document_spans(tokens.train, document_starts)
            keep = np.diff(np.append(np.asarray(document_starts, dtype=np.int64), len(tokens.train))) > 0
            self.curriculum = curriculum.build(order, tokens, objective, starts, ends, keep)
            self.train_documents = (starts, ends)
            if weights is not None:
                self.weights = weights[keep]
                if not self.weights.sum() > 0:
                    raise UserError("the filters weighed every training document 0: training has nothing to draw",
                                    key="filter.use")

    def train_dataloader(self) -> DataLoader:
        # Called after a checkpoint is restored, so global_step already says where to continue.
        start = self.trainer.global_step * self.grad_accum
        # Data-parallel replicas, which are not all ranks under tensor or pipeline parallelism: ranks
        # that hold parts of one replica must see the same batch.
        sharding = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        replicas = {"replica": sharding.get("rank", 0), "replicas": sharding.get("num_replicas", 1), "start": start,
                    "accum": self.grad_accum}
        if self.sampling == "documents":
            windows = RandomDocuments(self.tokens.train, self.tokens.document_starts("train"), self.block_size,
                                      self.batch_size, self.seed, labels=self.labels["train"],
                                      curriculum=self.curriculum, weights=self.weights, **replicas)
        else:
            windows = RandomWindows(self.tokens.train, self.block_size, self.batch_size, self.seed,
                                    rich=self.rich, labels=self.labels["train"], curriculum=self.curriculum,
                                    documents=self.train_documents, weights=self.weights, **replicas)
        if self.replay is not None:
            windows = Replayed(windows, self.replay, self.order.replay_share, self.block_size, self.batch_size,
                               self.seed, **replicas)
        # Own generators: iterating a DataLoader draws a seed from its generator, and drawing it from
        # the global one would shift every later dropout mask when a resumed run re-creates it.
        return DataLoader(windows, batch_size=None, generator=torch.Generator())

    def val_dataloader(self) -> DataLoader:
        limit = None if self.full_validation else self.eval_steps * self.eval_batch_size
        if not self.rich:
            windows = FixedWindows(self.tokens.val, self.block_size, limit)
            return DataLoader(windows, batch_size=self.eval_batch_size, shuffle=False, generator=torch.Generator())
        if self.sampling == "documents":
            batches = FixedDocuments(self.tokens.val, self.tokens.document_starts("val"), self.block_size,
                                     self.eval_batch_size, self.seed, limit, labels=self.labels["val"])
        else:
            batches = FixedWindowBatches(self.tokens.val, self.block_size, self.eval_batch_size, self.seed, limit,
                                         labels=self.labels["val"])
        return DataLoader(batches, batch_size=None, shuffle=False, generator=torch.Generator())
