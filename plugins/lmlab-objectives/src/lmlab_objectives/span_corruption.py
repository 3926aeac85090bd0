"""Span corruption: ``span-corruption``, T5's pretraining objective, for an encoder–decoder model.

T5 (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer", section 3.1.4; ``random_spans_noise_mask`` in google-research/text-to-text-transfer-
transformer's preprocessors.py) drops spans of a sequence from the encoder's input, each replaced by a
sentinel, and has the decoder write the dropped spans back, each behind its sentinel::

    tokens           Thank you for inviting me to your party last week
    encoder_ids      Thank you <s0> me to your party <s1> <eos>
    targets          <s0> for inviting <s1> last week <eos>
    decoder input    <start> <s0> for inviting <s1> last week

Of n tokens, the counts are fixed; only the positions are random:

    noise    = clamp(round(n · noise_density), 1, n - 1)        tokens dropped
    spans    = max(1, round(noise / mean_span_length))          noise spans, each non-empty
    nonnoise = n - noise                                        tokens kept

The noise tokens are cut into ``spans`` non-empty spans and the non-noise tokens into as many, each
cut a uniformly random choice of ``spans - 1`` of the ``items - 1`` gaps (T5's
``_random_segmentation``): every segmentation is equally likely. The two interleave, non-noise first
and noise last (as in T5's code, though not in its paper's figure). Where there are fewer non-noise
tokens than spans (a density near 1 with short spans), T5 would leave empty non-noise segments and so
merge noise spans; here ``spans`` is capped at ``nonnoise`` to the same effect. Span i becomes
sentinel i (``sentinel_0`` .. ``sentinel_99``, T5's 100 extra ids), so

    encoder length = nonnoise + spans + 1        decoder length = noise + spans + 1

(the 1 is the end-of-document token; both are one shorter when the tokenizer has none). A row of
the sampled windows holds block_size + 1 tokens; n is the most of them for which both lengths are at
most block_size (at the defaults, all of them: at block_size 128, 129 tokens make 117 encoder and 26
decoder tokens). Every row has the same n, hence the same lengths: no padding.

The random choices come from the batch's own generator (``Windows.rand``), so a batch is a function
of its seed and data: runs resume exactly, validation corrupts the same spans at every evaluation,
and a data-parallel replica draws exactly its rows of the global batch. The loss is the mean float32
cross-entropy over the targets, with ``causal-lm``'s optional z-loss.
"""

from dataclasses import dataclass

import torch

from lmlab.api import Field, Objective, Seq2SeqBatch, UserError, Vocabulary, Windows
from lmlab_objectives.causal_lm import CausalLMOptions, cross_entropy

SENTINELS = 100  # T5's extra ids


class SpanCorruptionOptions(CausalLMOptions):
    noise_density: float = Field(0.15, gt=0, lt=1, help="share of the tokens dropped from the encoder's input "
                                                        "and written back by the decoder (T5: 0.15)")
    mean_span_length: float = Field(3.0, ge=1, help="mean length of a dropped span (T5: 3)")


@dataclass(frozen=True)
class Layout:
    """How one row is corrupted: the first ``n`` tokens, ``noise`` of them dropped in ``spans`` spans."""

    n: int
    noise: int
    spans: int
    eos: int  # 1: the encoder's and decoder's sequences end with the end-of-document token

    @property
    def encoder_length(self) -> int:
        return self.n - self.noise + self.spans + self.eos

    @property
    def decoder_length(self) -> int:
        return self.noise + self.spans + self.eos


def span_counts(n: int, density: float, mean_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of n tokens, as T5 counts them (spans capped at the non-noise tokens)."""
    noise = min(max(round(n * density), 1), n - 1)
    return noise, min(max(round(noise / mean_span_length), 1), n - noise)


def segment(windows: Windows, items: int, segments: int) -> torch.Tensor:
    """(B, segments) int64 positive lengths adding up to ``items``: the cuts are a uniformly random choice
    of ``segments - 1`` of the ``items - 1`` gaps between items, drawn per row."""
    B, device = windows.tokens.shape[0], windows.tokens.device
    # float64: ties among float32 draws are likely enough over millions of rows to bias the choice
    cuts = windows.rand(items - 1, dtype=torch.float64).argsort(dim=1)[:, :segments - 1]
    starts = cuts.sort(dim=1).values + 1                                         # (B, segments-1)
    zero, end = torch.zeros(B, 1, dtype=torch.long, device=device), torch.full((B, 1), items, device=device)
    return torch.cat([zero, starts, end], dim=1).diff(dim=1)


def collapse(tokens: torch.Tensor, dropped: torch.Tensor, first: torch.Tensor, sentinel: torch.Tensor,
             length: int) -> torch.Tensor:
    """(B, length): ``tokens`` (B, n) with each run of ``dropped`` positions replaced by the ``sentinel`` of
    its first position; every row keeps ``length`` positions."""
    keep = ~dropped | first
    # Scatter rather than boolean indexing, which would wait for the device to count the kept positions;
    # the positions not kept all land in a spare last column.
    slot = torch.where(keep, keep.long().cumsum(1) - 1, length)
    out = tokens.new_empty(tokens.shape[0], length + 1).scatter_(1, slot, torch.where(dropped, sentinel, tokens))
    return out[:, :length]


class SpanCorruption(Objective):
    """``span-corruption``: the encoder reads a row with spans replaced by sentinels, the decoder writes
    the spans back behind them."""

    Options = SpanCorruptionOptions
    api = ">=1.13,<2"  # architectures, Vocabulary.decoder_start_id, Seq2SeqBatch
    architectures = ("encoder-decoder",)
    special_tokens = tuple(f"sentinel_{i}" for i in range(SENTINELS))

    def __init__(self, options: SpanCorruptionOptions | None = None):
        super().__init__(options)
        self.sentinel_ids: torch.Tensor | None = None
        self.eos_id: int | None = None
        self.decoder_start_id: int | None = None
        self.layouts: dict[int, Layout] = {}  # window length → layout

    def setup(self, vocab: Vocabulary) -> None:
        self.sentinel_ids = torch.tensor([vocab.special[name] for name in self.special_tokens])
        self.eos_id, self.decoder_start_id = vocab.eos_id, vocab.decoder_start_id
        self.layouts.clear()

    def check(self, context) -> None:
        """Refuse a block that needs more spans than there are sentinels, or holds too few tokens."""
        self.layout(context.shape.block_size + 1)

    def layout(self, L: int) -> Layout:
        """The layout of rows of L = block_size + 1 tokens: the largest n whose encoder and decoder
        lengths both fit in the block (the lengths do not grow monotonically with n, hence the search)."""
        if L not in self.layouts:
            o, eos = self.options, int(self.eos_id is not None)
            layouts = (Layout(n, *span_counts(n, o.noise_density, o.mean_span_length), eos) for n in range(L, 1, -1))
            lay = next((lay for lay in layouts if max(lay.encoder_length, lay.decoder_length) <= L - 1), None)
            if lay is None:
                raise UserError(f"span-corruption cannot fit a corrupted row into model.block_size {L - 1}: the "
                                "encoder and the decoder each need room for a sentinel and the end token besides "
                                "the text; raise model.block_size", key="model.block_size")
            if lay.spans > SENTINELS:
                raise UserError(f"noise_density {o.noise_density} and mean_span_length {o.mean_span_length} make "
                                f"{lay.spans} noise spans of {lay.n} tokens (model.block_size {L - 1}), more than "
                                f"the {SENTINELS} sentinels; lower objective.noise_density, raise "
                                "objective.mean_span_length, or use a smaller model.block_size",
                                key="objective.noise_density")
            self.layouts[L] = lay
        return self.layouts[L]

    def make_batch_from(self, windows: Windows) -> Seq2SeqBatch:
        if self.sentinel_ids is None:
            raise RuntimeError("span-corruption: setup(vocab) must be called before make_batch_from (the core does)")
        if self.decoder_start_id is None:
            raise UserError("span-corruption trains an encoder-decoder model, and this one has no decoder start id "
                            "(a decoder-only or encoder-only model): set [architecture] use = \"encoder-decoder\"",
                            key="architecture.use")
        lay = self.layout(windows.tokens.shape[1])
        tokens = windows.tokens[:, :lay.n]                                           # (B, n)
        B, device = tokens.shape[0], tokens.device
        self.sentinel_ids = self.sentinel_ids.to(device)
        # One draw for the noise spans, then one for the non-noise: a fixed order keeps the stream stable.
        noise_lengths = segment(windows, lay.noise, lay.spans)                       # (B, S)
        kept_lengths = segment(windows, lay.n - lay.noise, lay.spans)                # (B, S)
        lengths = torch.stack([kept_lengths, noise_lengths], dim=2).view(B, 2 * lay.spans)
        first = torch.zeros(B, lay.n, dtype=torch.bool, device=device)
        first.scatter_(1, lengths.cumsum(1)[:, :-1], True)                           # where segments 1.. start
        index = first.long().cumsum(1)                                               # (B, n) segment of each token
        first[:, 0] = True
        noise, sentinel = index % 2 == 1, self.sentinel_ids[index // 2]              # kept 2i and noise 2i+1: span i

        tail = [] if self.eos_id is None else [torch.full((B, 1), self.eos_id, device=device)]
        kept, written = lay.n - lay.noise + lay.spans, lay.noise + lay.spans
        encoder_ids = torch.cat([collapse(tokens, noise, first, sentinel, kept), *tail], dim=1)
        targets = torch.cat([collapse(tokens, ~noise, first, sentinel, written), *tail], dim=1)
        start = torch.full((B, 1), self.decoder_start_id, device=device)
        return Seq2SeqBatch(input_ids=torch.cat([start, targets[:, :-1]], dim=1), targets=targets,
                            encoder_ids=encoder_ids, encoder_padding=None)

    def loss(self, logits: torch.Tensor, batch: Seq2SeqBatch) -> torch.Tensor:
        return cross_entropy(logits, batch.targets, self.options.z_loss)
