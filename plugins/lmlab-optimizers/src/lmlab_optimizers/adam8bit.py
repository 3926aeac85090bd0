"""8-bit AdamW: Adam's moments stored in 8 bits (Dettmers et al. 2022, "8-bit Optimizers via
Block-wise Quantization", ICLR, https://arxiv.org/abs/2110.02861).

AdamW keeps two float32 moments per weight, 8 bytes, twice the weights' own memory. bitsandbytes'
``AdamW8bit`` keeps them as one byte each: every block of 256 values is quantised against its own
largest magnitude (block-wise quantisation: an outlier spoils only its block) with a *dynamic* code,
256 values spread like floating-point numbers (a sign, an exponent, a mantissa), which keeps small
moments precise. A step dequantises a block, applies the usual AdamW update in float32 and
quantises the moments back: about 2 bytes of state per weight plus 4 bytes per block, a quarter of
AdamW's. The paper finds it matches 32-bit Adam on language models, with a "stable embedding" layer
(not used here) for word embeddings.

Tensors with fewer than ``min_8bit_size`` elements (4096, bitsandbytes' default: norms, biases)
keep 32-bit moments, where quantisation would save little and cost precision. Weight decay is
decoupled and, as in the ``adamw`` plugin, only for parameters the core marks ``decay``; the
defaults are the ``adamw`` plugin's (GPT-3's). bitsandbytes' own clipping (``percentile_clipping``,
``max_unorm``) is left off: the core clips the gradients.

bitsandbytes is imported when the optimizer is built, never when the plugin is listed or checked;
``check`` only looks whether it is installed (``pip install 'lmlab-optimizers[adam8bit]'``). It runs
on CUDA and on the CPU (checked with bitsandbytes 0.50.2). It steps real tensors only: its step reads
values (``.item()``), which ``lmlab plan``'s fake tensors do not have.
"""

import importlib.util
import logging

import torch
from pydantic import field_validator

from lmlab.api import Field, Optimizer, OptimizerOptions, ParamInfo, UserError

from lmlab_optimizers._common import check_betas, decay_groups

INSTALL = "pip install 'lmlab-optimizers[adam8bit]'"


class Adam8bitOptions(OptimizerOptions):
    betas: tuple[float, float] = Field((0.9, 0.95), help="decay rates of the first and second moment estimates")
    eps: float = Field(1e-8, gt=0, help="added to the denominator for numerical stability")
    weight_decay: float = Field(0.1, ge=0, help="decoupled weight decay of the parameters marked decay")
    min_8bit_size: int = Field(4096, ge=1, help="tensors with fewer elements keep 32-bit moments")

    @field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, betas: tuple[float, float]) -> tuple[float, float]:
        return check_betas(betas)


class Adam8bit(Optimizer):
    Options = Adam8bitOptions
    api = ">=1.6,<2"  # check

    def check(self, context) -> None:
        """Refuse the variant when bitsandbytes is not installed (found without importing it)."""
        if importlib.util.find_spec("bitsandbytes") is None:
            raise UserError(f"adam8bit keeps AdamW's moments in 8 bits with bitsandbytes, which is not installed: "
                            f"{INSTALL}", key="optimizer.use")

    def build(self, params: list[ParamInfo]) -> torch.optim.Optimizer:
        o = self.options
        # bitsandbytes warns at import that an optional CPU kernel package is missing; it then uses its own.
        logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
        try:
            import bitsandbytes
        except ImportError:
            raise UserError(f"adam8bit needs bitsandbytes, which is not installed: {INSTALL}",
                            key="optimizer.use") from None
        return bitsandbytes.optim.AdamW8bit(decay_groups(params, o.weight_decay), lr=o.lr, betas=o.betas, eps=o.eps,
                                            min_8bit_size=o.min_8bit_size)
