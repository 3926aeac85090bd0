"""Conformance checks of objective plugins (how windows of tokens become a batch, and the loss on it).

An objective is checked as a run uses it: set up with a :class:`~lmlab.api.Vocabulary`, its
``token_labels`` given a corpus split, fed what the core's samplers (``lmlab.train.batches``) draw
(plain windows, or :class:`~lmlab.api.Windows` of windows or padded documents), scored by the core's
``compute_loss`` with the kit's reference model (bidirectional when the objective is not causal).
The corpus never repeats a token within a row, so a target's value says which token it is. Setting
``corpus``: ``"segments"`` (the default), documents of 6 to 24 tokens, each a prompt (loss_mask 0) then
a response (1); ``"preferences"``, each a prompt (0), a chosen answer (1) and a rejected one (2).

The loss must be the mean cross-entropy of the scored targets (the core reports ``exp(val_loss)`` as
perplexity); one that adds to it (a z-loss) passes ``cross_entropy=False`` and is held to the rest.
One that runs the model itself (``forward_loss``) is held to :mod:`lmlab.testing.objective_runs`'
checks of its loss, heads and runs instead of those that need its logits.
"""

import dataclasses

import numpy as np
import torch

from lmlab.api import IGNORE_INDEX, Batch, Objective, Options, TokenSplit, UserError, Vocabulary, Windows
from lmlab.testing import generic
from lmlab.testing.common import Subject, fail, run_checks, select_checks
from lmlab.testing.objective_documents import ROWS, difficulty, replica_slices
from lmlab.testing.objective_runs import (hand_over, heads, ignore_index, loss, model_padding, preference_documents,
                                          reports, resolve_runs, runs)
from lmlab.testing.reference import ReferenceAttention, ReferenceFFN, ReferencePosition

SHORTCUT = 0.5  # a share of scored targets readable at one input offset that no real objective reaches


class KitTokenizer:
    """What ``TokenSplit.tokenizer`` offers an objective: ids, special ids, and encode/decode of text."""

    def __init__(self, vocab: Vocabulary):
        self.vocab_size, self.eos_id, self.pad_id = vocab.tokenizer_size, vocab.eos_id, None
        self._special = {name: i for name, i in vocab.special.items() if i < vocab.tokenizer_size}

    def special_id(self, name: str) -> int | None:
        return self._special.get(name)

    def encode(self, text: str) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]

    def decode(self, ids) -> str:  # text nobody reads: one character per id
        return "".join(chr(32 + i) for i in ids)


class ObjectiveSubject(Subject):
    slot = "objective"

    def __init__(self, plugin, options: dict | Options | None = None, *, cross_entropy: bool = True,
                 corpus: str = "segments", runs: dict | None = None, **settings):
        super().__init__(plugin, options, **settings)
        if corpus not in ("segments", "preferences"):
            raise ValueError(f"corpus must be 'segments' or 'preferences', got {corpus!r}")
        self.cross_entropy, self.corpus, self.runs = cross_entropy, corpus, resolve_runs(self.cls, runs)
        self.name = getattr(self.cls, "name", "") or self.cls.__name__

    # -- what a run gives the objective -------------------------------------------------------------
    def vocabulary(self, own_ids: bool = False) -> Vocabulary:
        """Special tokens past the tokenizer's ids, or (``own_ids``) among them, as a tokenizer's mask token.
        The tokenizer has few ids (enough for rows that never repeat one), the rest spare as a rounded-up
        model.vocab_size leaves them: an id hard-coded from either size, or drawn from all, shows."""
        V, names = self.shape.vocab_size, tuple(getattr(self.cls, "special_tokens", ()))
        size = min(V - len(names) - 1, self.shape.block_size + 2 + len(names))
        if own_ids:
            special = {name: 0 if name == "eos" else 1 + i for i, name in enumerate(names)}
            return Vocabulary(size=V, tokenizer_size=size, special=special, eos_id=0)
        return Vocabulary(size=V, tokenizer_size=size, special={n: size + i for i, n in enumerate(names)})

    def tokenizer(self, vocab: Vocabulary) -> KitTokenizer:
        return KitTokenizer(vocab)

    def objective(self, vocab: Vocabulary, runs=None) -> Objective:
        return self.prepared(vocab, runs)[0]

    def prepared(self, vocab: Vocabulary, runs=None, strict: bool = False) -> tuple[Objective, dict]:
        """(the objective set up and prepared with ``runs``, else the kit's runs, as by the core; its runs)."""
        objective = self.plugin()
        objective.setup(vocab)
        return objective, hand_over(self, objective, vocab, runs, strict)

    def split(self, vocab: Vocabulary, loss_mask: str | None = "corpus") -> TokenSplit:
        """The kit's corpus for ``vocab``; ``loss_mask`` "corpus" (the ``corpus`` setting's), "segments"
        (prompts 0, responses 1), "preferences" (prompt 0, chosen 1, rejected 2), "ones" or None."""
        loss_mask = self.corpus if loss_mask == "corpus" else loss_mask
        rng = np.random.default_rng(self.seed)
        ids = np.setdiff1d(np.arange(vocab.tokenizer_size), list(vocab.special.values()))
        if len(ids) <= self.shape.block_size:
            fail(f"the kit's corpus needs {self.shape.block_size + 1} ordinary token ids to fill a row without "
                 f"repeating one; shape.vocab_size {self.shape.vocab_size} leaves {len(ids)}")
        if loss_mask == "preferences":
            tokens, starts, mask = preference_documents(rng, rng.permutation(ids), self.shape.block_size, ROWS,
                                                        self.seed)
        else:
            tokens = np.tile(rng.permutation(ids), 40 * self.shape.block_size // len(ids) + 2)
            starts = np.cumsum(np.concatenate([[0], rng.integers(6, 25, size=len(tokens) // 6)]))
            starts = starts[starts < len(tokens)].astype(np.int64)
            mask = np.ones(len(tokens), dtype=np.uint8)
        if loss_mask == "segments":
            for start, end in zip(starts, np.append(starts[1:], len(tokens))):
                mask[start:start + max(1, (end - start) * 2 // 5)] = 0
        return TokenSplit(name="train", tokens=tokens, loss_mask=None if loss_mask is None else mask,
                          document_starts=starts, tokenizer=self.tokenizer(vocab))

    def draw(self, objective: Objective, split: TokenSplit) -> Windows:
        """What the core's sampler hands ``objective`` for its first training batch (plain windows as Windows)."""
        from lmlab.train.batches import RandomDocuments, RandomWindows

        shape = (self.shape.block_size, ROWS, self.seed)
        if not objective.wants_windows():
            return Windows(RandomWindows(split.tokens, *shape).batch(0))
        labels = objective.token_labels(split)
        if objective.sampling == "documents":
            return RandomDocuments(split.tokens, split.document_starts, *shape, labels=labels).batch(0)
        return RandomWindows(split.tokens, *shape, rich=True, labels=labels).batch(0)

    def batch(self, objective: Objective, windows: Windows) -> Batch:
        """The batch as the core asks for it: make_batch_from(Windows) if overridden, else make_batch(tokens)."""
        made = objective.make_batch_from(windows) if objective.wants_windows() else objective.make_batch(windows.tokens)
        if not isinstance(made, Batch):
            fail(f"make_batch{'_from' if objective.wants_windows() else ''} returned {type(made).__name__}, not an "
                 "lmlab.api.Batch")
        return made

    def sample(self, own_ids: bool = False) -> tuple[Objective, Windows, Batch]:
        """(the objective set up, the Windows drawn for it, the batch it made of them)."""
        vocab = self.vocabulary(own_ids)
        objective = self.objective(vocab)
        windows = self.draw(objective, self.split(vocab))
        return objective, windows, self.batch(objective, windows)

    def model(self, objective: Objective, seed: int | None = None):
        """The reference model the core would build for ``objective`` (with its heads), in eval mode."""
        from lmlab.model import LanguageModel

        with self.seeded(self.seed if seed is None else seed):
            model = LanguageModel(self.shape, position=ReferencePosition(), attention=ReferenceAttention(),
                                  ffn=ReferenceFFN(), causal=objective.causal, heads=objective.heads(self.shape))
        return model.to(self.device).eval()


def declarations(subject: ObjectiveSubject) -> None:
    """``causal`` is a bool, ``special_tokens`` a tuple of names, ``sampling`` "windows" or "documents",
    an objective sampling documents overrides ``make_batch_from`` (only Windows say where padding is),
    and ``needs_runs`` is a tuple of names of its options (the core reads each run folder from one)."""
    objective = subject.plugin()
    if not isinstance(objective.causal, bool):
        fail(f"causal must be a bool, got {objective.causal!r}")
    names = objective.special_tokens
    if not isinstance(names, tuple) or not all(isinstance(n, str) and n for n in names):
        fail(f"special_tokens must be a tuple of names, got {names!r}")
    if objective.sampling not in ("windows", "documents"):
        fail(f"sampling must be 'windows' or 'documents', got {objective.sampling!r}")
    if objective.sampling == "documents" and not objective.wants_windows():
        fail("sampling is 'documents' but make_batch_from is not overridden: make_batch would get padded rows "
             "without knowing where the padding is")
    needs, fields = objective.needs_runs, type(objective.options).model_fields
    if not isinstance(needs, tuple) or not all(isinstance(n, str) and n in fields for n in needs):
        fail(f"needs_runs must be a tuple of names of the objective's options {sorted(fields)}, got {needs!r}")


def batch(subject: ObjectiveSubject) -> None:
    """The batch the core gets (make_batch on plain windows (B, T+1), or make_batch_from on Windows of
    random windows or padded documents, labelled by token_labels) holds int64 ``input_ids`` (B, T) with
    1 ≤ T ≤ block_size and int64 ``targets`` of the same shape; input ids in [0, vocab.size), targets
    in [0, vocab.size) or IGNORE_INDEX (-100); at least one target scored. ``n_scored()`` (what evaluation
    weights the batch's loss by) is a 0-dim integer tensor ≥ 0, with ``cross_entropy`` the number of scored
    targets. An objective that runs the model may make N ≥ 1 rows (a pair objective 2B) scoring none."""
    objective, windows, made = subject.sample()
    B, V, block = windows.tokens.shape[0], subject.shape.vocab_size, subject.shape.block_size
    runs_model = objective.runs_model()
    for name in ("input_ids", "targets"):
        t = getattr(made, name)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
            fail(f"Batch.{name} is {getattr(t, 'dtype', type(t).__name__)}, not an int64 tensor")
    x, y = made.input_ids, made.targets
    if x.dim() != 2 or not (x.shape[0] == B or runs_model and x.shape[0]) or not 1 <= x.shape[1] <= block \
            or y.shape != x.shape:
        fail(f"input_ids {tuple(x.shape)} and targets {tuple(y.shape)}; expected both ({'N' if runs_model else B}, "
             f"T), 1 ≤ T ≤ {block}")
    if int(made.input_ids.min()) < 0 or int(made.input_ids.max()) >= V:
        fail(f"input ids outside [0, {V}): {sorted(set(made.input_ids.flatten().tolist()))}")
    scored = made.targets != IGNORE_INDEX
    bad = scored & ((made.targets < 0) | (made.targets >= V))
    if bool(bad.any()):
        fail(f"targets other than IGNORE_INDEX ({IGNORE_INDEX}) outside [0, {V}): "
             f"{sorted(set(made.targets[bad].tolist()))}")
    n = made.n_scored()
    if not (isinstance(n, torch.Tensor) and n.dim() == 0 and not n.is_floating_point() and int(n) >= 0):
        fail(f"n_scored() is {n!r}, not a 0-dim integer tensor ≥ 0")
    if subject.cross_entropy and not runs_model and int(n) != int(scored.sum()):
        fail(f"n_scored() is {int(n)} and {int(scored.sum())} targets are scored: evaluation would weight the "
             "mean cross-entropy of this batch by another count")
    if not runs_model and not bool(scored.any()):
        fail(f"every target of a batch of {B} rows is IGNORE_INDEX: nothing to learn from")


def special_tokens(subject: ObjectiveSubject) -> None:
    """Inserted ids are those ``setup`` gave: under a Vocabulary whose special tokens sit past the
    tokenizer's ids (one spare id after them) and under one where they are the tokenizer's own, every
    input id and every scored target is an id of the tokenizer (< tokenizer_size) or one of
    ``vocab.special``'s: an id hard-coded, or drawn from the whole vocab.size, shows."""
    for own_ids in (False, True):
        objective, _, made = subject.sample(own_ids=own_ids)
        vocab = subject.vocabulary(own_ids)
        allowed = set(range(vocab.tokenizer_size)) | set(vocab.special.values())
        where = ("the tokenizer's own special ids " if own_ids else "special ids past the tokenizer's ") + \
            f"{dict(vocab.special)}, tokenizer_size {vocab.tokenizer_size}, size {vocab.size}"
        for name, t in (("input", made.input_ids), ("scored target", made.targets[made.targets != IGNORE_INDEX])):
            stray = sorted(set(t.flatten().tolist()) - allowed)
            if stray:
                fail(f"with {where}: {name} ids {stray} are neither tokenizer ids nor special ids from setup")


def causal(subject: ObjectiveSubject) -> None:
    """The model cannot read a scored target off its own input: for every offset d it attends over
    (d ≤ 0 when ``causal``, any d when not), fewer than half the scored positions t have
    ``input_ids[t + d] == targets[t]``. The kit's rows never repeat a token, so a higher share means the
    objective hands the model its targets: next-token targets with ``causal = False``, or targets that
    are the inputs themselves under causal attention. It holds for objectives that run the model too:
    whatever they feed it, ``targets`` are what it predicts from ``input_ids`` (a pair's answer tokens)."""
    objective, _, made = subject.sample()
    x, y = made.input_ids, made.targets
    T = x.shape[1]
    for d in range(-(T - 1), (1 if objective.causal else T)):
        t = torch.arange(max(0, -d), min(T, T - d))
        scored = y[:, t] != IGNORE_INDEX
        if int(scored.sum()) < 8:
            continue
        share = ((x[:, t + d] == y[:, t]) & scored).sum().item() / scored.sum().item()
        if share >= SHORTCUT:
            fail(f"causal is {objective.causal}, and {share:.0%} of the scored targets t equal input_ids[t + {d}], "
                 f"which the model {'sees' if d <= 0 else 'sees, attending bidirectionally'}: it can copy them"
                 + ("" if objective.causal or d != 1 else " (next-token targets need causal = True)"))


def padding(subject: ObjectiveSubject) -> None:
    """For ``sampling = "documents"``: giving padded positions other ids (they hold arbitrary ones)
    changes neither which targets are scored nor their values, nor the inputs at unpadded positions
    (for an objective that runs the model: see ``objective_runs.model_padding``). Objectives sampling
    windows get no padding: nothing to check."""
    objective, windows, made = subject.sample()
    if windows.padding is None or not bool(windows.padding.any()):
        return
    if objective.runs_model():
        return model_padding(subject, objective, windows, made)
    other = dataclasses.replace(windows, tokens=windows.tokens.masked_fill(windows.padding, 1))
    again = subject.batch(objective, other)
    if not torch.equal(again.targets, made.targets):
        fail("changing the ids of padded positions (0 → 1) changed the targets: padding is scored, or decides "
             "what is")
    T = made.input_ids.shape[1]
    real = ~windows.padding[:, :T]
    if not torch.equal(again.input_ids[real], made.input_ids[real]):
        fail("changing the ids of padded positions changed inputs at unpadded positions")


def prompt_mask(subject: ObjectiveSubject) -> None:
    """For a prompt-masked objective (one whose ``token_labels`` refuses a corpus without a loss mask with
    a UserError, as the API asks, or whose targets change with the loss mask): a target is scored
    exactly where the token it names has loss_mask 1 and is no padding. No token of a prompt is a scored
    target, and every response token at row positions 1..T-1 is one. Others, and objectives that run
    the model (whose labels may mean more than scored or not: a preference's two answers), pass."""
    objective, windows, made = subject.sample()
    if not objective.wants_windows() or windows.labels is None or objective.runs_model():
        return
    vocab = subject.vocabulary()
    try:
        objective.token_labels(subject.split(vocab, loss_mask=None))
    except UserError:  # refuses a corpus without a loss mask: prompt-masked
        pass
    else:
        ones = subject.batch(objective, subject.draw(objective, subject.split(vocab, loss_mask="ones")))
        if torch.equal(ones.targets, made.targets):
            return
    T = made.input_ids.shape[1]
    pad = windows.padding if windows.padding is not None else torch.zeros_like(windows.labels, dtype=torch.bool)
    scoring = windows.labels.bool() & ~pad                                        # (B, L)
    for r in range(windows.tokens.shape[0]):
        tokens, targets = windows.tokens[r].tolist(), made.targets[r]
        scored = set(targets[targets != IGNORE_INDEX].tolist())
        for v in scored:
            at = [j for j, u in enumerate(tokens) if u == v]
            if not any(scoring[r, j] for j in at):
                fail(f"row {r}: target {v} (the token at row position {at[0] if at else '?'}) is scored, but its "
                     "loss_mask is 0 (a prompt token) or it is padding")
        for j in range(1, T):
            if scoring[r, j] and tokens[j] not in scored:
                fail(f"row {r}: the token at row position {j} has loss_mask 1 (a response token) but is not scored")


def token_labels(subject: ObjectiveSubject) -> None:
    """For an objective that takes Windows: ``token_labels`` of the kit's corpus, with and without a loss
    mask, is None, or a function from positions (B, L) int64 to labels (B, L) with values in 0..255; or
    it refuses the corpus with ``lmlab.api.UserError`` (any other exception is a failure). The core
    never calls it for an objective that takes plain windows: it passes."""
    objective = subject.objective(subject.vocabulary())
    if not objective.wants_windows():
        return
    positions = np.arange(2 * 5, dtype=np.int64).reshape(2, 5) * 3
    for loss_mask in ("corpus", None):
        try:
            labels = objective.token_labels(subject.split(subject.vocabulary(), loss_mask=loss_mask))
        except UserError:
            continue
        if labels is None:
            continue
        if not callable(labels):
            fail(f"token_labels returned {type(labels).__name__}, not None or a function of positions")
        out = np.asarray(labels(positions))
        if out.shape != positions.shape or not (np.issubdtype(out.dtype, np.integer) or out.dtype == bool):
            fail(f"token_labels' function maps positions {positions.shape} to {out.dtype} {out.shape}, not "
                 f"integer labels {positions.shape}")
        if out.size and (out.min() < 0 or out.max() > 255):
            fail(f"token_labels' labels must fit uint8, got values {out.min()}..{out.max()}")


def determinism(subject: ObjectiveSubject) -> None:
    """The same Windows (same seed) give the same batch twice (every field of it, and ``n_scored()``),
    whatever torch's global random state, and making it leaves that state as it was: a batch's
    randomness comes from ``Windows.rand`` / ``randint`` (seeded by run seed and step), so a resumed
    run sees the batches it would have."""
    objective, split, made = subject.objective(vocab := subject.vocabulary()), subject.split(vocab), []
    for global_seed in (1, 2):
        windows = subject.draw(objective, split)
        with subject.seeded(global_seed):
            state = torch.get_rng_state()
            made.append(subject.batch(objective, windows))
            if not torch.equal(state, torch.get_rng_state()):
                fail("making a batch drew from torch's global random state; draw from Windows.rand / randint")
    first, second = ({f.name: getattr(m, f.name) for f in dataclasses.fields(m)} | {"n_scored()": m.n_scored()}
                     for m in made)
    for name, value in first.items():
        same = torch.equal(value, second[name]) if isinstance(value, torch.Tensor) else value == second[name]
        if not same:
            fail(f"the same Windows gave different batches under different global random states (in {name})")


#: name → check, in the order ``check_objective`` runs them.
CHECKS = {
    "plugin_class": generic.plugin_class,
    "declarations": declarations,
    "batch": batch,
    "special_tokens": special_tokens,
    "causal": causal,
    "padding": padding,
    "prompt_mask": prompt_mask,
    "token_labels": token_labels,
    "loss": loss,
    "ignore_index": ignore_index,
    "heads": heads,
    "runs": runs,
    "reports": reports,
    "determinism": determinism,
    "difficulty": difficulty,
    "replica_slices": replica_slices,
}


def check_objective(plugin, options=None, **settings) -> None:
    """Run every objective check on ``plugin``; raise one ConformanceError listing the failures.

    Settings: those of every entry point (``shape``, ``seed``, ``device``, ``skip``), ``cross_entropy``
    (default True: the loss is the mean cross-entropy of the scored targets), ``corpus``
    (``"segments"`` or ``"preferences"``, see the module docstring) and ``runs`` (option of
    ``needs_runs`` → the objective, by name or class, whose heads that run's model has and which its
    manifest names, e.g. ``{"reward_run": "reward-model"}``; default: the objective under test)."""
    skip = settings.pop("skip", ())
    run_checks(select_checks(CHECKS, ObjectiveSubject(plugin, options, **settings), skip))
