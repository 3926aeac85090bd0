"""Knowledge distillation (``distill``): a student trained on a frozen teacher run's soft targets.

Hinton, Vinyals and Dean 2015 ("Distilling the Knowledge in a Neural Network",
https://arxiv.org/abs/1503.02531) train a small model to match the whole output distribution of a
large one, not only its top choice: the probabilities the teacher gives to the wrong tokens say
which mistakes are near misses, and carry far more information per example than a one-hot label.
Both distributions are softened by a temperature T, p = softmax(z / T), so that those small
probabilities matter. Per scored target token, with teacher logits t and student logits s:

    loss = alpha · T² · KL(softmax(t / T) ‖ softmax(s / T)) + (1 − alpha) · CE(s, target)

DistilBERT (Sanh et al. 2019, https://arxiv.org/abs/1910.01108) mixes the soft loss with the usual
hard cross-entropy on the corpus in the same way (alpha weighs the soft part; alpha = 1 is pure
distillation, alpha = 0 plain next-token training).

Why T²: the gradient of the soft term with respect to a student logit is (1/T) · (p_s − p_t) for the
KL alone, and p_s − p_t itself shrinks like 1/T for large T (Hinton et al., section 2.1), so the
soft gradients scale as 1/T². Multiplying by T² keeps the soft and hard terms' relative
contributions roughly unchanged when the temperature is changed, and makes the soft gradient
exactly T · (p_s − p_t) per token.

Choices:

- KL rather than the soft cross-entropy −Σ p_t log p_s: the two differ by the teacher's entropy,
  which does not depend on the student, so they have the same gradients; the KL is 0 when the
  student matches the teacher, so ``soft_loss`` reads the same at every temperature and corpus.
- Which tokens are scored: targets are the next tokens, as ``causal-lm``'s; on a corpus with a loss
  mask (Records, from ``alpaca``) only those the mask scores (as ``sft``: the response and the end
  token), on plain text every token. Both terms are taken on the same tokens.
- ``packing`` (as ``sft``): true, random windows across the concatenated documents; false, one
  record per row from its first token, padded. The default is true because plain text is often one
  long document, of which one-record-per-row would only ever train the first block.
- ``task_weights``: instruction prefix → weight. A document whose text starts with a prefix (the
  longest that matches) has every token weighted by it in the training loss (a weighted mean,
  normalised by the sum of the weights); other documents weigh 1. The prefix is matched by token
  ids, so it must tokenise as the start of the documents does (always true for ``char`` and
  ``byte``; a BPE tokenizer may merge its last token with what follows); a prefix that starts no
  training document is refused. Evaluation is unweighted, so ``val_loss`` stays comparable between
  runs with different weights.
- The teacher is named by ``teacher`` (no default: the ``[init]`` run a student starts from is not a
  teacher). The core checks that it shares the run's tokenizer id by id; a teacher trained
  bidirectionally (``mlm``) or as a reward model has no next-token distribution to teach, and is
  refused, as is one whose model has another vocabulary size or a shorter context.
- Teacher logits are computed under ``torch.no_grad()`` in the same forward precision as the
  student's; both losses are computed in float32 over all positions of the batch and masked, rather
  than on the scored rows gathered out (which would wait on the device for their count).

Reported per scored token (``val_*`` in the summary): ``soft_loss`` (T² · KL), ``hard_loss`` (the
student's plain cross-entropy: ``val_hard_loss`` is comparable with the ``val_loss`` of a run
trained without a teacher) and ``teacher_hard_loss`` (the teacher's cross-entropy on the same
tokens, the floor the student is pulled towards).
"""

from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import torch
from pydantic import field_validator

from lmlab.api import IGNORE_INDEX, Batch, Field, Objective, Options, TokenSplit, UserError, Vocabulary, Windows

MAX_TASKS = 127  # the task index shares a uint8 label with the scored bit
NOT_LANGUAGE_MODELS = frozenset({"reward-model"})  # their trunk feeds a scalar head; the LM head is untrained
DOCUMENT_CHUNK = 1 << 16  # documents whose first tokens are read at a time


class DistillOptions(Options):
    teacher: Path | None = Field(None, help="the frozen teacher run folder (required; it must share this run's "
                                            "tokenizer)")
    temperature: float = Field(2.0, gt=0, help="T: both distributions are softmax(logits / T); higher T gives the "
                                               "teacher's small probabilities more weight")
    alpha: float = Field(0.5, ge=0, le=1, help="weight of the soft loss T²·KL; 1 - alpha weighs the hard "
                                               "cross-entropy on the corpus")
    packing: bool = Field(True, help="true: random windows across the concatenated documents; false: one record "
                                     "per row from its first token, padded")
    task_weights: dict[str, float] = Field(
        default_factory=dict, help='instruction prefix → weight of the tokens of documents that start with it in the '
                                   'training loss (others weigh 1), e.g. {"Who speaks this line?" = 4.0}')

    @field_validator("task_weights")
    @classmethod
    def _weights_fit_the_labels(cls, value: dict[str, float]) -> dict[str, float]:
        if len(value) > MAX_TASKS:
            raise ValueError(f"at most {MAX_TASKS} prefixes, got {len(value)}")
        for prefix, weight in value.items():
            if not prefix:
                raise ValueError("an empty prefix would match every document")
            if not weight >= 0:
                raise ValueError(f"the weight of {prefix!r} is {weight}; weights are >= 0")
        return value


@dataclass
class DistillBatch(Batch):
    """A next-token batch with the per-target training weights of ``task_weights``."""

    weights: torch.Tensor | None = None
    """(B, T) float32 weight of each target (None: all weigh 1); meaningful where targets are scored."""


def distill_terms(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position float32 terms (N,) from logits (..., V) and targets (...): the soft loss
    T² · KL(softmax(teacher/T) ‖ softmax(student/T)), the student's cross-entropy and the teacher's.
    Positions whose target is IGNORE_INDEX get a cross-entropy of 0 (their soft term is computed
    regardless: the caller masks it)."""
    V = student.shape[-1]
    s, t, y = student.float().reshape(-1, V), teacher.float().reshape(-1, V), targets.reshape(-1)
    T = float(temperature)
    log_ps, log_pt = (s / T).log_softmax(-1), (t / T).log_softmax(-1)  # (N, V)
    soft = (log_pt.exp() * (log_pt - log_ps)).sum(-1) * T * T
    counted = y != IGNORE_INDEX
    index = y.clamp(min=0)[:, None]
    # At T = 1 the softened student distribution is the one the cross-entropy needs: no second pass.
    log_ps1 = log_ps if T == 1.0 else s.log_softmax(-1)
    hard = -log_ps1.gather(1, index).squeeze(1) * counted
    with torch.no_grad():
        teacher_hard = (t.logsumexp(-1) - t.gather(1, index).squeeze(1)) * counted
    return soft, hard, teacher_hard


def _mean(per_token: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The mean of ``per_token`` (N,) over the targets that are not IGNORE_INDEX, weighted by ``weights``
    and normalised by their sum when given; 0, with a gradient of 0, when nothing is scored."""
    counted = (targets.reshape(-1) != IGNORE_INDEX).float()
    w = counted if weights is None else counted * weights.reshape(-1).float()
    # where(), not multiplication: an unscored position's soft term may be anything (a padded row).
    total = torch.where(w > 0, per_token * w, 0.0).sum()
    # The smallest normal float, not 1: weights may sum to less than 1 (a batch of down-weighted tasks),
    # and a sum of 0 has a numerator of 0.
    return total / w.sum().clamp(min=torch.finfo(torch.float32).tiny)


def document_tasks(split: TokenSplit, prefixes: list[str]) -> np.ndarray:
    """(n_documents,) uint8: 1 + the index in ``prefixes`` of the longest prefix each document of
    ``split`` starts with (by token ids), 0 for none."""
    starts = np.asarray(split.document_starts, dtype=np.int64)
    n_tokens = len(split.tokens)
    ends = np.append(starts[1:], n_tokens)
    task = np.zeros(len(starts), dtype=np.uint8)
    encoded = [np.asarray(split.tokenizer.encode(p), dtype=np.int64) for p in prefixes]
    # Shorter prefixes first, so that a longer one that also matches ("Who speaks" within "Who speaks
    # this line?") overwrites it.
    order = sorted(range(len(prefixes)), key=lambda i: len(encoded[i]))
    width = max((len(e) for e in encoded), default=0)
    if width == 0 or len(starts) == 0:
        return task
    offsets = np.arange(width, dtype=np.int64)
    for first in range(0, len(starts), DOCUMENT_CHUNK):
        chunk = slice(first, first + DOCUMENT_CHUNK)
        s, e = starts[chunk], ends[chunk]
        positions = np.minimum(s[:, None] + offsets, max(n_tokens - 1, 0))  # (D, width)
        head = np.asarray(split.tokens[positions], dtype=np.int64)  # one gather per chunk, not per document
        for i in order:
            ids = encoded[i]
            if len(ids) == 0:
                continue
            hit = (e - s >= len(ids)) & (head[:, :len(ids)] == ids).all(axis=1)
            task[chunk][hit] = i + 1
    return task


class Distill(Objective):
    """``distill``: alpha · T² · KL to a frozen teacher's softened distribution + (1 − alpha) · CE."""

    Options = DistillOptions
    api = ">=1.10,<2"  # forward_loss, needs_runs, check_runs, prepare, report
    needs_runs = ("teacher",)

    def __init__(self, options: DistillOptions | None = None):
        super().__init__(options)
        self.sampling = "windows" if self.options.packing else "documents"
        self.teacher = None
        self.vocab_size = None
        self.block_size = None
        self._weight_table = None  # (1 + tasks,) on the training device, built at the first batch

    def check(self, context) -> None:
        if self.options.teacher is None:
            raise UserError("distill needs a teacher: the folder of a trained run with this run's tokenizer "
                            "(e.g. teacher = \"runs/big/default\")", key="objective.teacher")
        self.block_size = context.shape.block_size  # the same instance trains: prepare compares the teacher's

    def check_runs(self, runs) -> None:
        run = runs["teacher"]
        name = run.objective
        if name in NOT_LANGUAGE_MODELS:
            raise UserError(f"the run in {run.path} was trained with objective {name!r}, which does not model the "
                            "next token; a teacher must be a language model (causal-lm, sft, distill, ...)",
                            key="objective.teacher")
        if not _objective_is_causal(name):
            raise UserError(f"the run in {run.path} was trained with objective {name!r}, which sees both sides of "
                            "each token (bidirectional): it has no next-token distribution to teach; use a causal "
                            "language model", key="objective.teacher")

    def setup(self, vocab: Vocabulary) -> None:
        self.vocab_size = vocab.size

    def prepare(self, context) -> None:
        run = context.runs["teacher"]
        teacher = run.model
        if self.vocab_size is not None and teacher.vocab_size != self.vocab_size:
            raise UserError(f"the run in {run.path} has a vocabulary of {teacher.vocab_size} logits and this run's "
                            f"model {self.vocab_size}; the soft targets must cover the same ids (set model.vocab_size "
                            "as the teacher's)", key="objective.teacher")
        context_length = teacher.max_context
        if self.block_size is not None and context_length is not None and context_length < self.block_size:
            raise UserError(f"the run in {run.path} reads at most {context_length} tokens and this run's rows are "
                            f"{self.block_size} long; lower model.block_size or use a teacher with a longer context",
                            key="objective.teacher")
        self.teacher = teacher

    def token_labels(self, split: TokenSplit):
        mask = split.loss_mask
        prefixes = list(self.options.task_weights)
        if not prefixes:
            return None if mask is None else (lambda positions: (mask[positions] != 0).astype(np.uint8))
        task = document_tasks(split, prefixes)
        if split.name == "train":
            found = np.bincount(task, minlength=len(prefixes) + 1)[1:]
            missing = [p for p, n in zip(prefixes, found) if n == 0]
            if missing:
                raise UserError(f"no training document starts with {missing[0]!r} (matched by token ids: the "
                                "prefix must be the exact start of the text, as the data source writes it)",
                                key="objective.task_weights")
        starts = np.asarray(split.document_starts, dtype=np.int64)
        shifted = (task << 1).astype(np.uint8)

        def labels(positions: np.ndarray) -> np.ndarray:
            doc = np.maximum(np.searchsorted(starts, positions, side="right") - 1, 0)
            scored = np.uint8(1) if mask is None else (mask[positions] != 0).astype(np.uint8)
            return shifted[doc] | scored

        return labels

    def make_batch_from(self, windows: Windows) -> DistillBatch:
        tokens = windows.tokens  # (B, T+1)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        labels = windows.labels
        # Target t is token t + 1: its own label says whether it is scored and which task it belongs to.
        scored = torch.ones_like(targets, dtype=torch.bool) if labels is None else (labels[:, 1:] & 1).bool()
        if windows.padding is not None:
            scored &= ~windows.padding[:, 1:]
        weights = None
        if self.options.task_weights and labels is not None:
            weights = self._weights(tokens.device)[(labels[:, 1:] >> 1).long()]  # (B, T)
        return DistillBatch(inputs, targets.masked_fill(~scored, IGNORE_INDEX), weights=weights)

    def _weights(self, device) -> torch.Tensor:
        if self._weight_table is None or self._weight_table.device != device:
            self._weight_table = torch.tensor([1.0, *self.options.task_weights.values()], dtype=torch.float32,
                                              device=device)
        return self._weight_table

    def forward_loss(self, model, batch: DistillBatch) -> torch.Tensor:
        if self.teacher is None:
            raise RuntimeError("distill: prepare() was not called with the teacher run")
        student = model(batch.input_ids)  # (B, T, V)
        with torch.no_grad():
            teacher = self.teacher(batch.input_ids)
        o = self.options
        soft, hard, teacher_hard = distill_terms(student, teacher, batch.targets, o.temperature)
        weights = batch.weights if model.training else None  # evaluation stays comparable between runs
        loss = _mean(o.alpha * soft + (1.0 - o.alpha) * hard, batch.targets, weights)
        counted = batch.targets.reshape(-1) != IGNORE_INDEX
        self.report("soft_loss", soft[counted])
        self.report("hard_loss", hard[counted])
        self.report("teacher_hard_loss", teacher_hard[counted])
        return loss


def _objective_is_causal(name: str) -> bool:
    """Whether the installed objective ``name`` trains left to right (its class's ``causal``); an objective
    that is not installed here is given the benefit of the doubt (the core loaded the run already)."""
    for ep in entry_points(group="lmlab.objective", name=name):
        try:
            return bool(getattr(ep.load(), "causal", True))
        except Exception:  # noqa: BLE001 — a plugin that fails to import says nothing about direction
            return True
    return True
