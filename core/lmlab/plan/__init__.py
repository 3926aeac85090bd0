"""A training run's memory and communication per device, before it runs (``lmlab plan``).

What the model needs is measured, not modelled: the variant's own model is built at its real size on
fake tensors (torch's ``FakeTensorMode``: every tensor has its shape, dtype and device but no
storage, so a 13B-parameter model costs nothing to build and to run forward), and

- **parameters** are counted on it (tied weights once; buffers such as RoPE tables added);
- **optimizer states** are what the optimizer plugin holds after one step on the fake parameters
  (AdamW: two moments, 8 bytes per fp32 parameter; a factored or 8-bit optimizer holds what it holds);
- **activations** are the bytes of every tensor autograd saves for backward during one training
  forward of a micro-batch (``batch_size × block_size``), parameters excepted, counted with
  saved-tensor hooks (each storage once), under the run's precision (torch.autocast for ``*-mixed``,
  whose 16-bit copies of the weights are saved by the matmuls and so counted here) and its
  ``[train] checkpointing`` policy. That is exactly what backward keeps alive, whatever the blocks
  are (MHA, GQA, MoE, Mamba). For comparison, Korthikanti et al. 2022 ("Reducing Activation
  Recomputation in Large Transformer Models", https://arxiv.org/abs/2205.05198) derive
  sbh(34 + 5as/h) bytes per layer for 16-bit GPT blocks with dropout and materialised attention
  scores. lmlab's block has no dropout by default (2 sbh bytes of masks fewer) and SDPA's fused
  attention saves no s × s scores (no 5as/h term): what the planner measures for it is 32 sbh bytes
  per layer under bf16 autocast (plus the 16-bit weight copies, 2 bytes per parameter) and 64 sbh in
  fp32, Korthikanti's count less those two terms. Other blocks (GQA, MoE, Mamba) measure as they are.

The parallel plugin describes how its strategy lays the state out (``Parallel.memory_layout``: the
fraction of parameters, gradients and optimizer states each device holds, the dtypes, gathered or
bucket buffers, the collectives of a step; see ``lmlab.api.layout``) and ``lmlab.plan.arithmetic``
does the arithmetic. Per device:

    parameters  = P × bytes(param dtype) × params fraction (+ buffers)
    gradients   = P_trainable × bytes(grad dtype) × grads fraction
    optimizer   = (measured states + 4 bytes/param of fp32 master weights, if kept) × optimizer fraction
    activations = measured × activations multiple

The peak is the largest of three moments of a Lightning training step:

- **training** (the end of the forward pass): parameters + optimizer states + activations + gathered
  parameters + gradients. Lightning zeroes gradients after the forward pass, so the previous step's
  gradients are still allocated when the activations peak; once backward starts, the gradient of the
  largest activation (the logits, usually) and, under checkpointing, one block's recomputed
  activations come on top (strategies with persistent gradient buffers, DDP's, hold both);
- **optimizer step**: parameters + gradients + optimizer states (+ an fp32 copy of the gradient shard
  when the optimizer steps fp32 master weights);
- **evaluation**: parameters + optimizer states + gradients + one evaluation batch's logits and
  their log-softmax (no activations are saved under no_grad).

Communication, per device and optimizer step, for ring collectives (NCCL's and gloo's large-message
algorithms): an all-reduce of S bytes among g devices sends 2(g−1)/g·S, an all-gather or a
reduce-scatter (g−1)/g·S, a send-recv S. DDP: one all-reduce of the gradients, 2Ψ per device;
ZeRO-1/2: reduce-scatter of gradients + all-gather of parameters, also 2Ψ; ZeRO-3/FSDP: parameters
gathered in forward and again in backward, gradients reduce-scattered, 3Ψ (Rajbhandari et al. 2020,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", https://arxiv.org/abs/1910.02054).

Bytes are decimal here (1 GB = 10⁹ bytes), as in the ZeRO paper: Ψ = 7.5B parameters, Adam in mixed
precision (K = 12 bytes/param of optimizer state), 64 devices → 120 GB of model states per device
for plain data parallelism, 31.4 GB under ZeRO-1, 16.6 GB under ZeRO-2, 1.9 GB under ZeRO-3.
"""

from lmlab.plan.arithmetic import (AUTOCAST_DTYPE, DTYPE_BYTES, STORAGE_DTYPE, DevicePlan, ModelFacts,
                                   communication_bytes, dtype_bytes, estimate, human, parse_size, pick_unit,
                                   resolve_dtypes)
from lmlab.plan.measure import VariantPlan, fake_mode, measure_model, plan_variant

__all__ = ["AUTOCAST_DTYPE", "DTYPE_BYTES", "STORAGE_DTYPE", "DevicePlan", "ModelFacts", "VariantPlan",
           "communication_bytes", "dtype_bytes", "estimate", "fake_mode", "human", "measure_model", "parse_size",
           "pick_unit", "plan_variant", "resolve_dtypes"]
