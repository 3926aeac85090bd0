"""Masked language modelling: ``mlm``, BERT's objective with SpanBERT's span masking and per-region
mask rates.

BERT (Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers for Language
Understanding", section 3.1) chooses a share of the positions (15 %) of each sequence; of the chosen
ones 80 % are replaced by a [MASK] token, 10 % by a random token and 10 % left unchanged, and the model
predicts the original token at every chosen position, and nowhere else, attending bidirectionally.
Inputs and targets are aligned (target t is the original token t, not the next one). The unchanged
and random 10 % keep the model from learning that only [MASK] positions matter, since [MASK] never
occurs at fine-tuning time.

Span masking (SpanBERT, Joshi et al. 2020, "SpanBERT: Improving Pre-training by Representing and
Predicting Spans", section 3.1) masks contiguous spans instead of single tokens: span lengths are
geometric, ℓ ~ Geo(p) on {1, 2, ...}, clipped at ``span_max`` (SpanBERT: p = 0.2, i.e. ``span_mean``
= 5 before clipping, clipped at 10, 3.8 on average), and the 80/10/10 decision is made per span.
``span_mean = 1`` is BERT's token masking. Here spans start independently at each position with a
probability q and cover ℓ positions; q is solved (once, by bisection) so that the share of positions
covered, 1 - ∏_d (1 - q·P(ℓ > d)) with overlaps counted once, is exactly the mask rate. Starts are
drawn for span_max - 1 positions before the window too, so the first positions of a row are covered
as often as the others.

Per-region rates: ``code_mask_rate`` applies inside fenced code blocks (between a line of ``` and the
next one), ``mask_rate`` elsewhere, e.g. to mask code much more heavily than prose. Regions are found
from the token ids of the fence: when the run starts, one vectorised pass over each split finds the
fences (a run of backticks counts once); for a batch, the positions of its tokens are looked up with
binary searches: a token is inside a block when an odd number of complete fences lie between its
document's first token and itself (the fence tokens themselves are outside). Counting from the
document start, not from the window or the split start, is what makes this right: windows cut
documents anywhere, and a document that leaves a fence unclosed must not flip the regions of the next
one. Fences are found as the token sequence the tokenizer gives for the fence text on its own (exact
for character and byte tokenizers; a subword tokenizer that merges backticks with neighbouring text may
hide some). A span starting inside a block takes the block's rate even where it runs past its end.

The random choices come from the batch's own generator (``Windows.rand``), seeded by the run's seed and
the step, so a run is reproducible and resumes exactly; validation batches have fixed choices, so
every evaluation scores the same positions. The [MASK] id is the tokenizer's own "mask" token when it
has one, else an id past its vocabulary that the core reserves (the model's vocabulary grows by one);
random replacements are drawn from the tokenizer's ids.

The model is built bidirectional (``causal = False``): an attention plugin that supports it (mha, gqa,
mqa) is required, and the model cannot generate text left to right.
"""

import math

import numpy as np
import torch

from lmlab.api import IGNORE_INDEX, Batch, Field, Objective, TokenSplit, UserError, Vocabulary, Windows
from lmlab_objectives.causal_lm import CausalLMOptions, cross_entropy

CHUNK = 1 << 22  # tokens per piece of the fence scan: memory stays bounded on a corpus of any size


class MLMOptions(CausalLMOptions):
    mask_rate: float = Field(0.15, gt=0, le=1, help="share of positions chosen for prediction (BERT: 0.15)")
    code_mask_rate: float | None = Field(None, gt=0, le=1, help="share chosen inside fenced code blocks (``` ... "
                                                                 "```); unset: mask_rate everywhere")
    span_mean: float = Field(1.0, ge=1, help="mean span length of the geometric distribution before clipping "
                                             "(SpanBERT: 5); 1 = token masking (BERT)")
    span_max: int = Field(10, ge=1, help="longest span: lengths are clipped here (SpanBERT: 10)")
    mask_fraction: float = Field(0.8, ge=0, le=1, help="share of chosen spans replaced by [MASK] (BERT: 0.8)")
    random_fraction: float = Field(0.1, ge=0, le=1, help="share of chosen spans replaced by random tokens (BERT: "
                                                         "0.1); the rest stays unchanged")
    fence: str = Field("```", min_length=1, help="the text that opens and closes a code block")


def span_survival(span_mean: float, span_max: int) -> np.ndarray:
    """P(ℓ > d) for d = 0 .. L-1 of ℓ = min(Geo(1/span_mean), span_max); L = span_max (1 for token masking)."""
    if span_mean == 1:
        return np.ones(1)
    return (1 - 1 / span_mean) ** np.arange(span_max)


def start_probability(rate: float, survival: np.ndarray) -> float:
    """q such that spans starting with probability q at each position cover ``rate`` of the positions:
    1 - ∏_d (1 - q · P(ℓ > d)) = rate, solved by bisection (the left side increases with q)."""
    if rate >= 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        q = (lo + hi) / 2
        covered = 1 - np.prod(1 - q * survival)
        lo, hi = (q, hi) if covered < rate else (lo, q)
    return (lo + hi) / 2


def find_fences(tokens, pattern: np.ndarray, document_starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) int64 of the fences in ``tokens`` (any array-like of ids), scanned in chunks: the
    occurrences of ``pattern`` within one document, where overlapping or touching ones (a run of more
    backticks than the fence has) make one fence that ends where the last of them does. Documents
    may follow each other with no token between them (a tokenizer without an end-of-document id), so
    neither an occurrence nor a run may cross a document start."""
    k, n = len(pattern), len(tokens)
    found = []
    for a in range(0, max(n - k + 1, 0), CHUNK):
        piece = np.asarray(tokens[a:min(a + CHUNK + k - 1, n)])
        m = len(piece) - k + 1
        hit = np.ones(m, dtype=bool)
        for j in range(k):
            hit &= piece[j:j + m] == pattern[j]
        found.append(np.flatnonzero(hit) + a)
    hits = np.concatenate(found).astype(np.int64) if found else np.zeros(0, np.int64)
    documents = np.asarray(document_starts, dtype=np.int64)
    document = np.searchsorted(documents, hits, side="right")  # (n_hits,) which document (+1) holds each
    within = document == np.searchsorted(documents, hits + k - 1, side="right")
    hits, document = hits[within], document[within]
    if not len(hits):  # the ends below would still hold one (spurious) entry
        return hits, hits
    # a hit that does not continue a run of hits in its document starts a fence; one not continued ends it
    continues = (np.diff(hits) == 1) & (np.diff(document) == 0)
    first, last = np.append(True, ~continues), np.append(~continues, True)
    return hits[first], hits[last] + k


def code_regions(fences: np.ndarray, ends: np.ndarray, document_starts: np.ndarray):
    """positions (B, L) → uint8 (B, L), 1 inside a fenced block: an odd number of complete fences between
    the position's document start and the position, and the position not within a fence (fences
    [fences[i], ends[i]) are disjoint and sorted)."""
    documents = np.asarray(document_starts, dtype=np.int64)
    if len(documents) == 0 or documents[0] != 0:
        documents = np.concatenate([[0], documents])

    def regions(positions: np.ndarray) -> np.ndarray:
        doc_start = documents[np.searchsorted(documents, positions, side="right") - 1]
        before_document = np.searchsorted(fences, doc_start, side="left")  # fences of earlier documents
        completed = np.searchsorted(ends, positions, side="right")  # fences that end at or before the position
        within = np.searchsorted(fences, positions, side="right") > completed  # the position is part of a fence
        return (((completed - before_document) % 2 == 1) & ~within).astype(np.uint8)

    return regions


class MLM(Objective):
    """``mlm``: predict the tokens at chosen (masked, replaced or kept) positions, bidirectionally."""

    Options = MLMOptions
    api = ">=1.4,<2"  # causal, special_tokens, setup, token_labels, make_batch_from
    causal = False
    special_tokens = ("mask",)

    def __init__(self, options: MLMOptions | None = None):
        super().__init__(options)
        o = self.options
        if o.mask_fraction + o.random_fraction > 1:
            raise UserError(f"mask_fraction {o.mask_fraction} and random_fraction {o.random_fraction} add up to more "
                            "than 1", key="objective.random_fraction")
        self.survival = span_survival(o.span_mean, o.span_max)
        self.q_text = start_probability(o.mask_rate, self.survival)
        self.q_code = start_probability(o.code_mask_rate if o.code_mask_rate is not None else o.mask_rate,
                                        self.survival)
        self.mask_id: int | None = None
        self.random_high: int | None = None

    def setup(self, vocab: Vocabulary) -> None:
        self.mask_id = vocab.special["mask"]
        self.random_high = vocab.tokenizer_size

    def token_labels(self, split: TokenSplit):
        if self.options.code_mask_rate is None:
            return None
        try:
            pattern = np.asarray(split.tokenizer.encode(self.options.fence), dtype=np.int64)
        except UserError:  # the tokenizer never saw the fence's characters: the corpus has no code blocks
            return None
        if len(pattern) == 0:
            return None
        return code_regions(*find_fences(split.tokens, pattern, split.document_starts), split.document_starts)

    def chosen(self, windows: Windows, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen (B, T) bool, action (B, T) in [0, 1) shared by each span) for the first T tokens."""
        L = len(self.survival)
        code = windows.labels[:, :T].bool() if windows.labels is not None else None   # (B, T)
        if L == 1:  # token masking
            u, action = windows.rand(T), windows.rand(T)
            q = self.q_text if code is None else torch.where(code, self.q_code, self.q_text)
            return u < q, action
        # Span starts at T + L - 1 positions: the window's and the L - 1 before it (which take the
        # region of the window's first token), so every position can be covered by any span length.
        n = T + L - 1
        u_start, u_length, u_action = windows.rand(n), windows.rand(n), windows.rand(n)   # (B, n) each
        if code is None:
            starts = u_start < self.q_text
        else:
            code = torch.cat([code[:, :1].expand(-1, L - 1), code], dim=1)                 # (B, n)
            starts = u_start < torch.where(code, self.q_code, self.q_text)
        p = 1 / self.options.span_mean
        # Geometric on {1, 2, ...} by inversion; 1 - u is in (0, 1], so the log is finite.
        length = 1 + torch.floor(torch.log1p(-u_length) / math.log1p(-p))
        length = length.clamp(max=L).long()
        offset = torch.arange(-(L - 1), T, device=u_start.device)                          # (n,)
        end = torch.where(starts, offset + length, torch.zeros_like(length) - L)            # (B, n) exclusive ends
        reach, source = torch.cummax(end, dim=1)                                            # furthest span so far
        reach, source = reach[:, L - 1:], source[:, L - 1:]                                 # (B, T)
        chosen = reach > torch.arange(T, device=u_start.device)
        return chosen, u_action.gather(1, source)

    def make_batch_from(self, windows: Windows) -> Batch:
        if self.mask_id is None:
            raise RuntimeError("mlm: setup(vocab) must be called before make_batch_from (the core does)")
        tokens = windows.tokens[:, :-1]                                                    # (B, T)
        T = tokens.shape[1]
        chosen, action = self.chosen(windows, T)
        o = self.options
        masked = chosen & (action < o.mask_fraction)
        randomised = chosen & (action >= o.mask_fraction) & (action < o.mask_fraction + o.random_fraction)
        inputs = tokens.masked_fill(masked, self.mask_id)
        inputs = torch.where(randomised, windows.randint(self.random_high, T), inputs)
        return Batch(inputs, tokens.masked_fill(~chosen, IGNORE_INDEX))

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        return cross_entropy(logits, batch.targets, self.options.z_loss)
