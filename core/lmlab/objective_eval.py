"""A run's objective scored on held-out records: ``lmlab eval RUN_DIR --data FILE`` for objectives that
run the model themselves (a reward model's pair accuracy, DPO's implicit-reward accuracy, PPO's
reward and KL on held-out prompts).

The records are read by the run's own data plugin and tokenised here, in memory, exactly as ``lmlab
prepare`` would (segments one after another, the loss mask holding each scored segment's label, the
end-of-document token after each record), then batched the way the run's validation batches them:
every record once. The figures are the ones the closing evaluation of training writes to
summary.json (``val_loss`` and each ``val_<name>`` of ``Objective.report``), so a held-out file and
the run's own validation split are scored by the same code.
"""

from dataclasses import dataclass

import numpy as np
import torch

from lmlab.api import Record, TokenSplit
from lmlab.model import compute_loss
from lmlab.train.batches import FixedDocuments, FixedWindowBatches, FixedWindows
from lmlab.train.module import add_reports, reduce_reports


def record_split(records: list[Record], tokenizer) -> TokenSplit:
    """``records`` as one tokenised split: tokens, loss mask (each scored segment's label, 0 elsewhere;
    the end token after a record takes its last segment's label), document starts."""
    eos = tokenizer.eos_id
    ids: list[int] = []
    mask: list[int] = []
    starts = []
    for record in records:
        starts.append(len(ids))
        last = 1
        for segment in record.segments:
            piece = list(tokenizer.encode(segment.text))
            ids += piece
            mask += [segment.mask_value] * len(piece)
            last = segment.mask_value or 1
        if eos is not None:
            ids.append(eos)
            mask.append(last)
    dtype = np.uint32 if tokenizer.vocab_size > np.iinfo(np.uint16).max else np.uint16
    return TokenSplit(name="val", tokens=np.asarray(ids, dtype=dtype), loss_mask=np.asarray(mask, dtype=np.uint8),
                      document_starts=np.asarray(starts, dtype=np.int64), tokenizer=tokenizer)


@dataclass
class Scores:
    loss: float
    figures: dict[str, float]  # Objective.report's, averaged over the records
    records: int


@torch.no_grad()
def evaluate(model, objective, split: TokenSplit, block_size: int, batch_size: int = 32, seed: int = 0) -> Scores:
    """The objective's loss and reported figures over every record of ``split`` (model in eval mode)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rich = objective.wants_windows()
    labels = objective.token_labels(split) if rich else None
    if objective.sampling == "documents":
        batches = FixedDocuments(split.tokens, split.document_starts, block_size, batch_size, seed, None, labels)
    elif rich:
        batches = FixedWindowBatches(split.tokens, block_size, batch_size, seed, None, labels)
    else:
        windows = FixedWindows(split.tokens, block_size)
        batches = [torch.stack([windows[j] for j in range(i, min(i + batch_size, len(windows)))])
                   for i in range(0, len(windows), batch_size)]
    make = objective.make_batch_from if rich else objective.make_batch
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    reports: dict = {}
    objective.take_reports()  # nothing left over from before
    try:
        for i in range(len(batches)):
            batch = make(batches[i].to(device))
            loss = compute_loss(model, objective, batch).loss
            n = batch.n_scored()
            total += loss.double() * n
            count += n
            add_reports(reports, objective.take_reports())
    finally:
        model.train(was_training)
    return Scores((total / count.clamp(min=1)).item(), reduce_reports(reports, None, device),
                  len(split.document_starts))
