"""Supervised fine-tuning on prompt/response records: ``sft``, next-token prediction scored on the
response only.

Instruction tuning (Stanford Alpaca, Taori et al. 2023; InstructGPT's SFT stage, Ouyang et al. 2022)
trains a causal LM on records of a prompt (an instruction, maybe an input) and a response, and counts
the loss only on the response: the model should learn to answer, not to write prompts. A data source
that yields ``lmlab.api.Record``s (``alpaca``) marks the prompt unscored, and ``lmlab prepare`` writes
the loss mask beside the tokens: 1 on response tokens and on each record's end-of-document token (so
the model learns to stop), 0 on the prompt.

Inputs are ``w[:, :-1]`` and targets ``w[:, 1:]`` as for ``causal-lm``; target t is the token at
position t + 1 of the row, so it is scored exactly when the mask *at t + 1* is 1: the model is
trained to produce each response token from everything before it, prompt included, and never to
produce a prompt token.

Two ways to fill a batch (``packing``):

- ``packing = false`` (Alpaca's way): each row is one record from its first token, truncated to
  block_size + 1 tokens and padded; padding is never scored, and under causal attention no real token
  sees it. Training draws records in a fresh shuffled order each epoch; validation takes every
  validation record once. Records longer than the block lose their end.
- ``packing = true``: rows are random windows of the concatenated records, as ``causal-lm`` draws
  them, scoring where the mask says; no padding is computed, but a row may begin mid-record and its
  tokens attend to the records before them in the row (the packing of T5, Raffel et al. 2020, and of
  TRL's SFT trainer without per-record attention masks).

The loss is the mean cross-entropy over scored targets (0 for a batch with none), in float32, with
``causal-lm``'s optional z-loss.

On an encoder–decoder model (``[architecture] use = "encoder-decoder"``, API 1.18) the prompt goes into
the encoder and the decoder produces the response: each record's unscored tokens, left-aligned and
padded, become the encoder's input, and its scored tokens (the response and its end-of-document
token) the decoder's targets, read behind the model's decoder start id (T5's fine-tuning). Such runs
take one record per row (``packing = false``).
"""

import torch

from lmlab.api import IGNORE_INDEX, Batch, Field, Seq2SeqBatch, TokenSplit, UserError, Vocabulary, Windows
from lmlab_objectives.causal_lm import CausalLM, CausalLMOptions, cross_entropy


class SFTOptions(CausalLMOptions):
    packing: bool = Field(False, help="true: random windows across the concatenated records, scoring response "
                                      "tokens; false: one record per row from its first token, padded")


class SFT(CausalLM):
    """``sft``: next-token loss on the response tokens of prompt/response records only."""

    Options = SFTOptions
    api = ">=1.13,<2"  # architectures, decoder_start_id; check, yields_records (1.6); make_batch_from (1.4)
    architectures = ("decoder", "encoder-decoder")

    def __init__(self, options: SFTOptions | None = None):
        super().__init__(options)
        self.sampling = "windows" if self.options.packing else "documents"
        self.decoder_start_id: int | None = None

    def setup(self, vocab: Vocabulary) -> None:
        self.decoder_start_id = vocab.decoder_start_id
        if self.decoder_start_id is not None and self.options.packing:
            raise UserError("an encoder-decoder model reads one record per row (its prompt in the encoder); set it "
                            "false", key="objective.packing")

    def check(self, context) -> None:
        """Before the data is read (API 1.6): a data source that says it yields plain text leaves
        nothing to mask."""
        data = context.plugins.get("data")
        if getattr(data, "yields_records", None) is False:
            raise UserError(f"sft scores only the response tokens of prompt/response records, and data plugin "
                            f"{data.name!r} yields plain text; use a data source that yields Records, such as "
                            "alpaca", key="objective.use")

    def token_labels(self, split: TokenSplit):
        if split.loss_mask is None:
            raise UserError("sft scores only the response tokens of prompt/response records, and this corpus has "
                            "no loss mask (its data source yields plain text, or records without an unscored "
                            "prompt); use a data source that yields Records, such as alpaca", key="objective.use")
        mask = split.loss_mask
        return lambda positions: mask[positions]

    def make_batch_from(self, windows: Windows) -> Batch:
        if self.decoder_start_id is not None:
            return self._seq2seq(windows)
        tokens = windows.tokens                                   # (B, T+1)
        scored = windows.labels[:, 1:].bool()                     # (B, T): target t is token t + 1
        if windows.padding is not None:
            scored &= ~windows.padding[:, 1:]
        return Batch(tokens[:, :-1], tokens[:, 1:].masked_fill(~scored, IGNORE_INDEX))

    def _seq2seq(self, windows: Windows) -> Seq2SeqBatch:
        tokens, real = windows.tokens, torch.ones_like(windows.tokens, dtype=torch.bool)
        if windows.padding is not None:
            real = ~windows.padding
        response = windows.labels.bool() & real
        # Each side reads at most block_size tokens: a row holds block_size + 1.
        width = tokens.shape[1] - 1
        prompt, prompt_padding = _left_aligned(tokens, real & ~response, width)
        answer, answer_padding = _left_aligned(tokens, response, width)
        start = torch.full_like(answer[:, :1], self.decoder_start_id)
        return Seq2SeqBatch(torch.cat([start, answer[:, :-1]], dim=1), answer.masked_fill(answer_padding, IGNORE_INDEX),
                            encoder_ids=prompt, encoder_padding=prompt_padding)

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        return cross_entropy(logits, batch.targets, self.options.z_loss)


def _left_aligned(tokens: torch.Tensor, keep: torch.Tensor, most: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept tokens moved to its front, in order, as (B, W) ids (0 past them) and the padding
    mask; W is the longest row's count, at least 1 and at most ``most`` (longer rows lose their end)."""
    counts = keep.sum(1).clamp(max=most)
    width = max(int(counts.max()), 1)
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :width]  # kept positions first
    padding = torch.arange(width, device=tokens.device)[None, :] >= counts[:, None]
    return tokens.gather(1, order).masked_fill(padding, 0), padding
