"""Causal language modelling: predict every next token, minimise the mean cross-entropy.

The objective of GPT (Radford et al. 2018) and of nanoGPT: a window of T+1 tokens becomes inputs
``w[:, :-1]`` and targets ``w[:, 1:]`` (the base class's ``make_batch``), and the loss is the mean
negative log-likelihood of the targets, skipping positions whose target is ``IGNORE_INDEX``.

The loss is computed in float32 even when the logits are bf16/fp16: the log-softmax over a large
vocabulary loses too much precision in 8 mantissa bits. The optional z-loss of PaLM (Chowdhery et
al. 2022, https://arxiv.org/abs/2204.02311, section 5) adds ``z_loss * log(Z)^2`` per token, where
Z is the softmax normaliser; it keeps the logits from drifting large, which stabilises low-precision
training (PaLM uses 1e-4).
"""

import torch
import torch.nn.functional as F

from lmlab.api import IGNORE_INDEX, Batch, Field, Objective, Options


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """Mean float32 cross-entropy of ``logits`` (B, T, V) against ``targets`` (B, T) over the positions
    whose target is not IGNORE_INDEX, plus ``z_loss`` · mean log(Z)² over them; 0 (with a gradient of
    0) when no position counts, which a batch of prompt-masked or sparsely masked rows can give."""
    flat, targets = logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)  # (N, V), (N,)
    counted = targets != IGNORE_INDEX  # (N,)
    n = counted.sum().clamp(min=1)
    loss = F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX, reduction="sum") / n
    if z_loss > 0:
        loss = loss + z_loss * (torch.logsumexp(flat, dim=-1).square() * counted).sum() / n
    return loss


class CausalLMOptions(Options):
    z_loss: float = Field(0.0, ge=0, help="coefficient of PaLM's z-loss, mean log(Z)^2 (0 turns it off; PaLM: 1e-4)")


class CausalLM(Objective):
    Options = CausalLMOptions

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        logits = logits.float()  # (B, T, V)
        flat, targets = logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1)  # (B*T, V), (B*T,)
        loss = F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX)
        if self.options.z_loss > 0:
            counted = targets != IGNORE_INDEX  # (B*T,)
            log_z = torch.logsumexp(flat, dim=-1)  # (B*T,)
            loss = loss + self.options.z_loss * (log_z.square() * counted).sum() / counted.sum().clamp(min=1)
        return loss
