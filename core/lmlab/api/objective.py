"""The objective slot: what the model learns to predict, and how batches are drawn for it.

The simplest objective (``causal-lm``) takes windows of T+1 consecutive tokens through
[Objective.make_batch][lmlab.api.objective.Objective.make_batch] and scores every next token. An
objective that needs more (API 1.4) says so with class attributes and methods the core reads once,
when the run is built:

- ``causal = False``: the model is built with bidirectional attention
  ([MixerContext.causal][lmlab.api.attention.MixerContext.causal] False), which only attention plugins
  declaring [Attention.bidirectional][lmlab.api.attention.Attention.bidirectional] support; another
  is refused, naming ``attention.use``. Such a model cannot generate text left to right.
- ``special_tokens``: names of tokens the objective inserts (``("mask",)`` for BERT's [MASK]). Each
  gets the tokenizer's own id when it has one
  ([Tokenizer.special_id][lmlab.api.tokenizer.Tokenizer.special_id]), else an id past the
  tokenizer's vocabulary; the model's vocabulary grows to hold them (unless ``model.vocab_size``
  already leaves room). [Objective.setup][lmlab.api.objective.Objective.setup] receives the ids in a
  [Vocabulary][lmlab.api.objective.Vocabulary].
- ``sampling = "documents"``: each row of a batch is one document from its first token, truncated to
  block_size + 1 tokens and padded (training draws documents in a shuffled order per epoch, a pure
  function of seed and step; validation takes every validation document once).
- [Objective.token_labels][lmlab.api.objective.Objective.token_labels]: per-token labels sampled
  alongside the windows (the prepared loss mask of a corpus of Records, regions of code, ...),
  computed from a [TokenSplit][lmlab.api.objective.TokenSplit] once per split.
- [Objective.make_batch_from][lmlab.api.objective.Objective.make_batch_from]: overriding it is what
  asks for all of the above: it receives [Windows][lmlab.api.batch.Windows] (tokens, labels,
  padding, a seeded random stream) instead of a plain tensor. An objective that does not override it
  costs nothing extra per step.

Alignment and transfer objectives (API 1.10) need more than logits:

- [Objective.forward_loss][lmlab.api.objective.Objective.forward_loss]: overriding it runs the model
  itself (two sequences per pair, hidden states into a head, rollouts), instead of the core's one
  forward and [loss][lmlab.api.objective.Objective.loss].
- [Objective.heads][lmlab.api.objective.Objective.heads]: modules added to the model (a reward
  model's scalar head, PPO's value head), trained, saved and loaded with it.
- [Objective.needs_runs][lmlab.api.objective.Objective.needs_runs] with
  [check_runs][lmlab.api.objective.Objective.check_runs] and
  [prepare][lmlab.api.objective.Objective.prepare]: other run folders (a frozen reference, a reward
  model, a teacher; see [lmlab.api.runs][lmlab.api.runs]).
- [Objective.report][lmlab.api.objective.Objective.report]: named per-sample figures (preference
  accuracy, reward, KL) that reach metrics.jsonl and summary.json.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from lmlab.api.batch import Batch, Windows
from lmlab.api.plugin import Plugin
from lmlab.api.runs import ObjectiveContext, TrainedRun
from lmlab.api.shape import ModelShape

#: Names [Objective.report][lmlab.api.objective.Objective.report] cannot take: the core's own figures.
RESERVED_REPORTS = frozenset({"loss", "ppl", "exit_losses", "extra_losses"})


@dataclass(frozen=True)
class Vocabulary:
    """The token ids of a run, as [Objective.setup][lmlab.api.objective.Objective.setup] sees them
    (API 1.4)."""

    size: int
    """Rows of the model's embedding and head: at least ``tokenizer_size`` plus the special ids
    reserved past it (more when ``model.vocab_size`` says so)."""
    tokenizer_size: int
    """The tokenizer produces ids in ``[0, tokenizer_size)``."""
    special: Mapping[str, int] = field(default_factory=dict)
    """Name → id of each token of [Objective.special_tokens][lmlab.api.objective.Objective.special_tokens]:
    the tokenizer's own, or one reserved past its vocabulary (in the order the objective names them)."""
    eos_id: int | None = None
    """The tokenizer's end-of-document id ([Tokenizer.eos_id][lmlab.api.tokenizer.Tokenizer.eos_id]),
    or None."""
    decoder_start_id: int | None = None
    """In an encoder–decoder model (API 1.13), the id the decoder's input starts with (the architecture's
    ``Architecture.decoder_start_id``: ``architecture.decoder_start_id``, else ``eos_id``): an
    objective then makes [Seq2SeqBatch][lmlab.api.batch.Seq2SeqBatch]es. None for a decoder-only or
    encoder-only model."""


@dataclass(frozen=True)
class TokenSplit:
    """One split of the prepared corpus, as
    [Objective.token_labels][lmlab.api.objective.Objective.token_labels] sees it (API 1.4).

    ``tokens`` and ``loss_mask`` are array-likes (a numpy memmap, or a view of several shards)
    supporting ``len``, slicing and integer-array indexing of any shape; read them in chunks, not
    whole, as a corpus may not fit in memory.
    """

    name: Literal["train", "val"]
    """Which split this is."""
    tokens: Any
    """(N,) the split's token ids (an unsigned integer dtype wide enough for the vocabulary)."""
    loss_mask: Any | None
    """(N,) uint8, 1 where a prompt-masked objective scores the token (the scored segments of
    Records and each document's end token); None when the corpus has no unscored text."""
    document_starts: np.ndarray
    """(n_documents,) int64: the offset of each document's first token (documents are consecutive,
    each ending where the next starts)."""
    tokenizer: Any
    """The fitted [Tokenizer][lmlab.api.tokenizer.Tokenizer] the split was encoded with."""


LabelFunction = Callable[[np.ndarray], np.ndarray]
"""What [Objective.token_labels][lmlab.api.objective.Objective.token_labels] returns: token positions
(B, L) int64 in a split → their labels (B, L) uint8."""


class Objective(Plugin):
    """What the model learns: how a batch of token windows (or documents) becomes inputs and targets,
    and the loss over them. It also says what it needs of the model and the data: causal or not,
    special tokens, windows or padded documents, per-token labels (see the module's description).

    Per step the core calls [make_batch][lmlab.api.objective.Objective.make_batch] (or
    [make_batch_from][lmlab.api.objective.Objective.make_batch_from]) and then
    [loss][lmlab.api.objective.Objective.loss] on the model's logits for the batch's ``input_ids``,
    in training (``model.train()``, gradients on, under the precision's autocast) and in evaluation
    (``model.eval()``, under ``torch.inference_mode`` or ``torch.no_grad``), in every process, on
    the training device. Both should be pure functions of their inputs (and of the batch's random
    stream): a resumed run draws the same batches again and should get the same losses.
    """

    slot = "objective"

    causal: ClassVar[bool] = True
    """False: every position sees the whole window (bidirectional attention), e.g. masked LM
    (API 1.4). Such a run has no closing sample, and ``lmlab generate`` refuses it."""
    special_tokens: ClassVar[tuple[str, ...]] = ()
    """Names of the special tokens the objective needs ids for, e.g. ``("mask",)`` (API 1.4)."""
    architectures: ClassVar[tuple[str, ...] | None] = None
    """The model architectures this objective trains (API 1.13), of ``"decoder"``, ``"encoder"``
    and ``"encoder-decoder"``, its default first; the variant's family is the first of them that the
    ``[architecture]`` plugin builds (``Architecture.families``: the default ``decoder`` builds
    decoders and encoders). None (the default):
    ``("decoder",)`` when [causal][lmlab.api.objective.Objective.causal], else ``("encoder",)``.
    For ``"encoder-decoder"`` the objective makes [Seq2SeqBatch][lmlab.api.batch.Seq2SeqBatch]es
    whenever ``Vocabulary.decoder_start_id`` is set."""

    @classmethod
    def trains(cls) -> tuple[str, ...]:
        """The architectures this objective trains, its default first (read once by the core)."""
        return cls.architectures or (("decoder",) if cls.causal else ("encoder",))
    sampling: Literal["windows", "documents"] = "windows"
    """``"windows"``: rows are windows of block_size + 1 consecutive tokens at random (training) or
    fixed (validation) offsets; ``"documents"``: one document per row, truncated and padded, which
    needs [make_batch_from][lmlab.api.objective.Objective.make_batch_from] overridden (API 1.4). An
    instance may set it from its options."""

    drops_truncated: ClassVar[bool] = False
    """With ``sampling = "documents"``: True when a document longer than a row (``model.block_size``
    tokens and its end) is left out of the loss rather than trained on truncated, as a preference pair
    that lost its rejected answer is (API 1.16). The core then warns at the start of a run with how many
    are left out (the run's warnings.log), and refuses the run, naming ``model.block_size``, when none
    of a split's documents fit."""

    def setup(self, vocab: Vocabulary) -> None:
        """Receive the run's vocabulary and the ids of ``special_tokens`` (API 1.4).

        Called once whenever a variant is assembled, before any batch: by ``lmlab run`` in every
        process, and by ``lmlab check``, ``lmlab plan``, ``generate``, ``eval`` and ``merge``.
        Under ``lmlab check``, when the tokenizer learns its vocabulary from the data, the sizes and
        reserved ids are stand-ins (a vocabulary of 256). Default: nothing.

        Args:
            vocab: The sizes and the special ids.
        """

    def token_labels(self, split: TokenSplit) -> LabelFunction | None:
        """The per-token labels sampled with every batch of ``split`` (API 1.4).

        Called once per split (``"train"`` and ``"val"``) in every process when the run's data
        module is built, and only for objectives that override
        [make_batch_from][lmlab.api.objective.Objective.make_batch_from]. The sampler applies the
        returned function to the token positions of every batch it draws, in its loader, and hands
        the result to [make_batch_from][lmlab.api.objective.Objective.make_batch_from] as
        ``Windows.labels``. Vectorise it: it runs on every batch.

        Args:
            split: The prepared split: tokens, loss mask, document starts, tokenizer.

        Returns:
            A function from positions (B, L) int64 to labels (B, L) uint8, or None (the default)
            for no labels.

        Raises:
            UserError: The data cannot serve the objective (a prompt-masked objective on a corpus
                without masks).
        """
        return None

    def difficulty(self, split: TokenSplit) -> np.ndarray | None:
        """A difficulty score per training document (API 1.10), for ``[order] use = "difficulty"``:
        training starts on the lowest-scored documents and adds harder ones on the curriculum's
        schedule. Called once, on the training split, when the run's data is set up.

        Returns:
            (n_documents,) float, one per entry of ``split.document_starts``; None (the default):
            this objective has no score, and the curriculum is refused naming ``order.use``.
        """
        return None

    def make_batch(self, windows: torch.Tensor) -> Batch:
        """Turn token windows into model inputs and targets.

        Called for every micro-batch, in training and evaluation, when the objective does not
        override [make_batch_from][lmlab.api.objective.Objective.make_batch_from]. Default: predict
        the next token (``input_ids = windows[:, :-1]``, ``targets = windows[:, 1:]``).

        Args:
            windows: (B, T+1) int64 consecutive tokens of the corpus, on the training device; B is
                ``train.batch_size`` in training (one micro-batch of one data-parallel replica),
                at most ``train.eval_batch_size`` in evaluation; T is ``model.block_size``.

        Returns:
            The batch: ``input_ids`` and ``targets`` (B, T) int64.
        """
        return Batch(windows[:, :-1], windows[:, 1:])

    def make_batch_from(self, windows: Windows) -> Batch:
        """Turn [Windows][lmlab.api.batch.Windows] into model inputs and targets (API 1.4).

        Override it to receive Windows (labels, padding, a seeded random stream) instead of plain
        tensors; called where [make_batch][lmlab.api.objective.Objective.make_batch] would be. The
        default passes the tokens to [make_batch][lmlab.api.objective.Objective.make_batch].

        Args:
            windows: Tokens (B, block_size + 1) int64 on the training device, with what was sampled
                alongside them.

        Returns:
            The batch, whose ``input_ids`` have at most ``model.block_size`` columns.
        """
        return self.make_batch(windows.tokens)

    @classmethod
    def wants_windows(cls) -> bool:
        """Whether batches reach this objective as Windows (it overrides
        [make_batch_from][lmlab.api.objective.Objective.make_batch_from]); read once by the core."""
        return cls.make_batch_from is not Objective.make_batch_from

    needs_runs: ClassVar[tuple[str, ...]] = ()
    """Names of options whose values are other run folders (API 1.10): DPO's ``reference``, PPO's
    ``reward_run``. An option left unset (None) means the ``[init]`` run; with no ``[init]`` run
    either, the manifest is refused naming the option. Each run must share the run's tokenizer, id
    for id. See [lmlab.api.runs][lmlab.api.runs]."""

    def heads(self, shape: ModelShape) -> Mapping[str, torch.nn.Module]:
        """Modules the objective adds to the model (API 1.10), e.g. ``{"reward": nn.Linear(d_model, 1)}``.

        Called once whenever the model is built (training, and loading a trained run back, so its
        checkpoint's ``heads.<name>.*`` weights have a place); the core puts them in
        ``model.heads`` (an ``nn.ModuleDict``), where they are trained, saved and moved with the
        model. A run whose ``[init]`` lacks them starts them as built here; an ``[init]`` that has
        heads this run does not is loaded without them. Default: none (``model.heads`` is None)."""
        return {}

    def check_runs(self, runs: Mapping[str, TrainedRun]) -> None:
        """Refuse other runs that cannot serve (API 1.10): a reward run trained with another objective.

        Called by ``lmlab check`` and at the start of ``lmlab run``, after the core has read each run
        of [needs_runs][lmlab.api.objective.Objective.needs_runs] (manifest and tokenizer; no model)
        and checked its tokenizer. Default: nothing.

        Raises:
            UserError: naming the option (``key="objective.reward_run"``).
        """

    def prepare(self, context: ObjectiveContext) -> None:
        """Receive the other runs' frozen models and the run's generate function (API 1.10).

        Called once in every process of ``lmlab run``, after the model is built and its ``[init]``
        loaded, before the first batch (the models reach the training device before it). Default:
        nothing."""

    def forward_loss(self, model, batch: Batch) -> torch.Tensor:
        """Run the model on a batch and return the loss (API 1.10); overriding it replaces the core's
        ``loss(model(batch.input_ids), batch)``.

        Called where the core would have run the forward pass and
        [loss][lmlab.api.objective.Objective.loss]: in training and evaluation, in every process, as
        the module's mode says (``model.training``). ``model`` is the
        [LanguageModel][lmlab.api.model.LanguageModel] being trained: ``model(ids)`` gives logits,
        ``model(ids, hidden=True)`` the final hidden states (B, T, C), ``model.head`` maps those to
        logits and ``model.heads`` holds [heads][lmlab.api.objective.Objective.heads]. The core
        still adds the model's auxiliary losses. Runs the model as built (``train.compile`` does not
        apply), and cannot be split into pipeline stages.

        Returns:
            A 0-dim floating-point tensor: the loss to minimise and report.
        """
        return self.loss(model(batch.input_ids, **batch.model_inputs()), batch)

    @classmethod
    def runs_model(cls) -> bool:
        """Whether this objective overrides [forward_loss][lmlab.api.objective.Objective.forward_loss];
        read once by the core."""
        return cls.forward_loss is not Objective.forward_loss

    def report(self, name: str, values: torch.Tensor) -> None:
        """Record per-sample values of a named figure in this loss call (API 1.10).

        Call it from [loss][lmlab.api.objective.Objective.loss] or
        [forward_loss][lmlab.api.objective.Objective.forward_loss] with a 1-D tensor (one value per
        pair, sequence or token). The core averages the values over every sample of the logging
        interval (metrics.jsonl's ``train_<name>``) and of the whole evaluation (``val_<name>``, all
        processes together); the closing evaluation's go into summary.json. It adds no host sync:
        values are summed on the device. ``name`` is a lowercase identifier, not ``loss``, ``ppl``,
        ``exit_losses`` or ``extra_losses`` (a model's extra heads').
        """
        if name in RESERVED_REPORTS or not name.isidentifier() or name != name.lower():
            raise ValueError(f"objective {self.name!r} reports {name!r}: a figure's name is a lowercase identifier, "
                             f"not one of {sorted(RESERVED_REPORTS)}")
        values = values.detach().reshape(-1).float()
        reports = self.__dict__.setdefault("_reports", {})
        total, count = reports.get(name, (0.0, 0))
        reports[name] = (values.sum() + total, values.numel() + count)

    def take_reports(self) -> dict[str, tuple[torch.Tensor, int]]:
        """What [report][lmlab.api.objective.Objective.report] recorded since the last call, as
        name → (sum, count); emptied. Called by the core after every loss call."""
        return self.__dict__.pop("_reports", None) or {}

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The scalar loss to minimise, and to report as ``train_loss`` and ``val_loss``.

        Called once per micro-batch after the model's forward pass on ``batch.input_ids``: in
        training with gradients on (the core adds auxiliary losses, divides by ``train.grad_accum``
        and calls ``backward``), in evaluation without. A parallel plugin that runs the passes
        itself calls it on parts of the batch
        ([Parallel.forward_backward][lmlab.api.parallel.Parallel.forward_backward]).

        It must be the mean over the targets that are not
        [IGNORE_INDEX][lmlab.api.batch.IGNORE_INDEX]: evaluation weights each batch's loss by its
        number of such targets to get the loss of the whole validation set.

        Args:
            logits: (B, T, V) scores over the model's vocabulary, in the compute dtype (bfloat16 or
                float16 under the ``*-mixed`` precisions' autocast, else the parameters' dtype).
            batch: What [make_batch][lmlab.api.objective.Objective.make_batch] or
                [make_batch_from][lmlab.api.objective.Objective.make_batch_from] returned.

        Returns:
            A 0-dim floating-point tensor on the logits' device.
        """
        raise NotImplementedError
