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
"""

import torch

from lmlab.api import IGNORE_INDEX, Batch, Field, TokenSplit, UserError, Windows
from lmlab_objectives.causal_lm import CausalLM, CausalLMOptions, cross_entropy


class SFTOptions(CausalLMOptions):
    packing: bool = Field(False, help="true: random windows across the concatenated records, scoring response "
                                      "tokens; false: one record per row from its first token, padded")


class SFT(CausalLM):
    """``sft``: next-token loss on the response tokens of prompt/response records only."""

    Options = SFTOptions
    api = ">=1.6,<2"  # check, yields_records; token_labels, make_batch_from, sampling (1.4)

    def __init__(self, options: SFTOptions | None = None):
        super().__init__(options)
        self.sampling = "windows" if self.options.packing else "documents"

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
        tokens = windows.tokens                                   # (B, T+1)
        scored = windows.labels[:, 1:].bool()                     # (B, T): target t is token t + 1
        if windows.padding is not None:
            scored &= ~windows.padding[:, 1:]
        return Batch(tokens[:, :-1], tokens[:, 1:].masked_fill(~scored, IGNORE_INDEX))

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        return cross_entropy(logits, batch.targets, self.options.z_loss)
