"""LoRA on a 4-bit base model: ``qlora`` (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized
LLMs").

QLoRA stores the frozen base weights in 4 bits and trains LoRA adapters in 16 or 32 bits through them:
every linear layer of the transformer blocks becomes a bitsandbytes ``Linear4bit`` whose weight is
quantised blockwise (``blocksize`` weights share one absmax scale) to the 4-bit NormalFloat data type
(NF4: the 16 quantiles of a standard normal, information-theoretically right for normally distributed
weights), two codes packed per byte; with double quantisation the fp32 block scales are themselves
quantised to 8 bits in blocks of 256. In the forward pass each layer dequantises its weight to the
compute dtype and multiplies, and gradients flow through that to the adapters and the input; the base
never changes. Memory for the base: about 0.5 byte per weight (+ 0.127 bit of scales with double
quantisation, 0.5 without) instead of 4. Embeddings, norms and the head stay in full precision, as in
the paper's use of bitsandbytes.

bitsandbytes 0.50.2's CPU kernel dequantises a block that spans two rows of a weight wrongly (its
codes and scales are right; the dequantised weight is off by up to 40 % of the block's absmax), so on
the CPU every adapted layer's input width must be a multiple of ``blocksize`` (refused otherwise,
naming ``peft.blocksize``); widths of real models (multiples of 64) always are.

On the CPU, bitsandbytes (>= 0.49) runs NF4 and FP4 Linear4bit forward and backward with its own
dequantisation kernels; its avx512-bf16 inference repacking is turned off here so that training and
evaluation read the same storage. Merging folds the adapters into the *dequantised* weights, so the
merged model (full precision, no quantisation) computes what the adapted 4-bit model computes.
LoRA targets default to every role (the paper adapts all linear layers).
"""

from typing import Literal

import torch
from torch import nn

from lmlab.api import Field, Options, RunSettings, UserError
from lmlab_peft.library import ADAPTER, Targets, targets_field
from lmlab_peft.lora import LoRA


class QLoRAOptions(Options):
    r: int = Field(8, gt=0, help="rank of the update B·A")
    alpha: float = Field(16.0, gt=0, help="the update is scaled by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, help="dropout on the input of the update branch")
    targets: Targets = targets_field("all")
    rslora: bool = Field(False, help="rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski 2023)")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", help="4-bit data type of the base weights")
    double_quant: bool = Field(True, help="quantise the block scales too (8-bit, blocks of 256)")
    blocksize: Literal[32, 64, 128, 256] = Field(64, help="weights per absmax scale")
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", help="dtype the base weights are dequantised to for each matmul")


class QLoRA(LoRA):
    """``qlora``: LoRA adapters over 4-bit (NF4) frozen linear layers."""

    Options = QLoRAOptions
    dora = False

    def apply(self, model: nn.Module, run: RunSettings) -> None:
        bnb = import_bitsandbytes()
        o = self.options
        compute = getattr(torch, o.compute_dtype)
        linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and n.startswith("blocks.")]
        on_cpu = getattr(run.options("parallel"), "accelerator", "auto") == "cpu" or not torch.cuda.is_available()
        ragged = [(n, m.in_features) for n, m in linears if m.in_features % o.blocksize]
        if on_cpu and ragged:
            # Measured with bitsandbytes 0.50.2: its CPU dequantisation kernel returns wrong weights (off by up
            # to 40 % of a block's absmax) when a block spans two rows of the weight; codes and scales are right.
            raise UserError(f"{ragged[0][0]} has {ragged[0][1]} inputs, not a multiple of the blocksize "
                            f"{o.blocksize}: on the CPU, bitsandbytes dequantises blocks that span two rows wrongly; "
                            "choose a blocksize that divides every layer's input width", key="peft.blocksize")
        for name, linear in linears:
            quantised = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                          compute_dtype=compute, compress_statistics=o.double_quant,
                                          quant_type=o.quant_type, device=linear.weight.device)
            quantised.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, blocksize=o.blocksize,
                                                 compress_statistics=o.double_quant, quant_type=o.quant_type,
                                                 module=quantised)._quantize(linear.weight.device)
            quantised.support_avx512bf16_for_cpu = False  # one storage format in training and evaluation
            if linear.bias is not None:
                quantised.bias = nn.Parameter(linear.bias.data, requires_grad=False)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, quantised)
        # What peft reads to wrap Linear4bit layers with its 4-bit-aware LoRA layer.
        model.is_loaded_in_4bit = True
        super().apply(model, run)

    def merge(self, model: nn.Module) -> None:
        bnb = import_bitsandbytes()
        for name, layer in [(n, m) for n, m in model.named_modules() if hasattr(m, "base_layer")]:
            base = layer.base_layer
            weight = base.weight
            if isinstance(base, bnb.nn.Linear4bit):
                weight = bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
            merged = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                               device=weight.device, dtype=torch.float32)
            with torch.no_grad():
                merged.weight.copy_(weight.float() + layer.get_delta_weight(ADAPTER).float())
                if base.bias is not None:
                    merged.bias.copy_(base.bias.float())
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, merged)
        for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]:
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)  # not adapted
            with torch.no_grad():
                plain.weight.copy_(bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state))
                if module.bias is not None:
                    plain.bias.copy_(module.bias)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, plain)
        for attribute in ("is_loaded_in_4bit", "peft_config"):
            if hasattr(model, attribute):
                delattr(model, attribute)
        self.tuner = None


def import_bitsandbytes():
    from lmlab_peft.library import import_peft

    import_peft()  # silences bitsandbytes' import-time warning first
    try:
        import bitsandbytes
    except ImportError:
        raise UserError("qlora stores the base weights in 4 bits with bitsandbytes, which is not installed: "
                        "pip install 'lmlab-peft[qlora]'", key="peft.use") from None
    return bitsandbytes
