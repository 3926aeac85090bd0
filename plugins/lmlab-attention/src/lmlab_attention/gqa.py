"""Softmax self-attention with grouped key/value heads: ``gqa``, and its two ends ``mha``, ``mqa``.

Multi-head attention (Vaswani et al. 2017, "Attention Is All You Need") gives every query head its own
key and value head. Multi-query attention (Shazeer 2019, "Fast Transformer Decoding: One Write-Head is
All You Need") shares one key/value head among all query heads, which shrinks the KV cache by a factor
of ``n_heads`` and makes decoding memory-bound work cheaper. Grouped-query attention (Ainslie et al.
2023, "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints") sits in
between: ``n_kv_heads`` key/value heads, each shared by a group of ``n_heads / n_kv_heads`` consecutive
query heads. MHA is GQA with ``n_kv_heads = n_heads``; MQA is GQA with ``n_kv_heads = 1``, so all three
run the same code below.

The query, key and value projections are separate layers (``q_proj``, ``k_proj``, ``v_proj``, as in
Hugging Face's Llama) rather than one fused matmul: a PEFT method can then adapt queries and values
alone (LoRA's ``q``/``v`` roles), tensor parallelism splits each column-wise with torch's own
``ColwiseParallel``, and Llama weights map one to one.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): :meth:`SelfAttention.tensor_parallel_plan`
splits the heads over the ranks, the query/key/value projections column-wise and the output projection
row-wise; each rank then computes ``n_heads / t`` query heads with their ``n_kv_heads / t`` key/value
heads, and its slice of a position scheme's per-head bias.

Causal by default; all three also attend bidirectionally (``bidirectional = True``, API 1.4) when the
model is built for an objective that is not causal, such as masked language modelling (BERT, Devlin
et al. 2019): then no mask is applied at all, and a position scheme's bias covers keys on both sides
of the query (ALiBi's is symmetric in the distance).

The decoding state is a plain key/value cache, so the module gives its ``kv_layout`` (API 1.8) and the
core may decode sequences of different lengths in one batch: each row then has its own positions and
the core's ``key_mask`` takes the place of the causal mask.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.api import (Attention, AttentionModule, CrossAttentionModule, Field, KVCache, MixerContext, ModelShape,
                       Options, UserError)
from lmlab.api.architecture import build_norm


def _add_projections(module: nn.Module, shape: ModelShape, n_kv_heads: int, qkv_bias: bool | None = None) -> None:
    """The four projections self- and cross-attention share (names included: PEFT roles, weight maps);
    ``qkv_bias``: biases on the query, key and value projections (None: as every linear, ``model.bias``)."""
    module.n_heads, module.n_kv_heads, module.head_dim = shape.n_heads, n_kv_heads, shape.head_dim
    inner, kv_inner = shape.n_heads * shape.head_dim, n_kv_heads * shape.head_dim
    bias = shape.bias if qkv_bias is None else qkv_bias
    module.q_proj = nn.Linear(shape.d_model, inner, bias=bias)
    module.k_proj = nn.Linear(shape.d_model, kv_inner, bias=bias)
    module.v_proj = nn.Linear(shape.d_model, kv_inner, bias=bias)
    module.out_proj = nn.Linear(inner, shape.d_model, bias=shape.bias)
    # No dropout after out_proj: the model applies residual dropout to every mixer's output.
    module.dropout = shape.dropout


class SelfAttention(AttentionModule):
    """Scaled dot-product attention of ``n_heads`` query heads over ``n_kv_heads`` key/value heads,
    causal or (in a model built for a bidirectional objective) over the whole window."""

    def __init__(self, shape: ModelShape, n_kv_heads: int, qkv_bias: bool | None = None, qk_norm_eps: float = 0.0):
        super().__init__()
        _add_projections(self, shape, n_kv_heads, qkv_bias)
        # Query-key normalisation (Qwen3, OLMo 2): each head's query and key RMS-normalised, with a
        # learned scale per dimension shared by the heads, before the position scheme rotates them.
        self.q_norm = build_norm("rmsnorm", dataclasses.replace(shape, d_model=self.head_dim), qk_norm_eps) \
            if qk_norm_eps else None
        self.k_norm = build_norm("rmsnorm", dataclasses.replace(shape, d_model=self.head_dim), qk_norm_eps) \
            if qk_norm_eps else None
        # Tensor parallelism: this rank computes heads [rank·H/size, (rank+1)·H/size) (and the matching
        # key/value heads); 1 and 0 without it.
        self.tp_size, self.tp_rank = 1, 0
        # After prune_heads: the original index of each remaining query head, so a position scheme's
        # per-head bias (built for the model's original heads) is read at the heads that remain. Not
        # persistent: a pruned run's loader calls prune_heads again with the same list.
        self.register_buffer("kept_heads", None, persistent=False)
        self.reset_parameters(shape)

    def forward(self, x: torch.Tensor, ctx: MixerContext, state: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, hs = self.n_heads // self.tp_size, self.n_kv_heads // self.tp_size, self.head_dim  # this rank's
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, H, hs).transpose(1, 2)                                # (B, H, T, hs)
        k = k.view(B, T, Hkv, hs).transpose(1, 2)                              # (B, Hkv, T, hs)
        v = v.view(B, T, Hkv, hs).transpose(1, 2)                              # (B, Hkv, T, hs)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if ctx.position.rotates:
            q, k = ctx.position.rotate(q, k, ctx.positions)
        if state is not None:
            k, v = state.update(k, v, ctx.start)                                # (B, Hkv, S, hs), S = start + T
        mask, is_causal = self._mask(ctx, T, k.shape[2], q.dtype)
        # enable_gqa lets SDPA share each kv head across its query group without materialising copies;
        # on CPU it measured faster than repeat_interleave, and it is a no-op for MHA.
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0, enable_gqa=True)  # (B, H, T, hs)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, H * hs))       # (B, T, C)

    def _mask(self, ctx: MixerContext, T: int, S: int, dtype: torch.dtype):
        """(attn_mask, is_causal) for T queries that are the last T of S keys, or, in ragged decoding,
        that ``ctx.key_mask`` says which keys each row's queries see.

        SDPA takes either ``is_causal`` or ``attn_mask``, and its ``is_causal`` aligns the triangle to
        the top left, so it only fits when queries and keys are the same tokens (training, prefill).
        Bidirectional (``ctx.causal`` False): no mask, only the position scheme's bias if it has one.
        """
        device = ctx.positions.device
        ragged = ctx.key_mask is not None
        bias = None
        if ctx.position.biases:
            if ragged:  # rows differ in length, so slot s holds position s and the mask hides the rest
                k_positions = torch.arange(S, device=device)
            else:  # cached keys hold consecutive positions ending at the last query's
                k_positions = ctx.positions if S == T else ctx.positions[0] - ctx.start + torch.arange(S, device=device)
            bias = ctx.position.attention_bias(ctx.positions, k_positions)         # (H, T, S); (B, H, T, S) ragged
            if self.kept_heads is not None:  # pruned: the remaining heads' rows of the original heads' bias
                bias = bias.index_select(-3, self.kept_heads)
            if self.tp_size > 1:  # this rank's heads only
                local = self.n_heads // self.tp_size
                bias = bias[..., self.tp_rank * local:(self.tp_rank + 1) * local, :, :]
        if ragged:  # the core's mask holds causality and every row's length, even for one new token
            if bias is None:
                return ctx.key_mask, False
            return bias.to(dtype).masked_fill(~ctx.key_mask, float("-inf")), False
        if T == 1 or not ctx.causal:  # one new token sees everything cached before it; or no mask at all
            return (None if bias is None else bias.to(dtype)), False
        if bias is None and S == T:
            return None, True
        causal = torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=S - T)  # query t sees keys ≤ start + t
        if bias is None:
            return causal, False
        return bias.to(dtype).masked_fill(~causal, float("-inf")), False

    def new_state(self, batch_size: int, max_len: int, device, dtype) -> KVCache:
        return KVCache(batch_size, self.n_kv_heads // self.tp_size, max_len, self.head_dim, device=device,
                       dtype=dtype)

    def kv_layout(self) -> tuple[int, int]:
        return self.n_kv_heads // self.tp_size, self.head_dim

    def tensor_parallel_plan(self, tp_size: int) -> dict:
        if self.n_heads % tp_size or self.n_kv_heads % tp_size:
            raise ValueError(f"{tp_size} tensor-parallel ranks must each compute whole heads, so their number must "
                             f"divide the {self.n_heads} query heads and the {self.n_kv_heads} key/value head(s)")
        from lmlab_attention.tensor_parallel import HeadColwiseParallel
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"q_proj": HeadColwiseParallel(on_apply=self._take_local_heads), "k_proj": ColwiseParallel(),
                "v_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}

    def peft_roles(self) -> dict[str, str]:
        return {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"}

    def head_groups(self) -> tuple[int, int]:
        if self.tp_size > 1:
            raise UserError("head pruning needs whole attention modules; this one is split over "
                            f"{self.tp_size} tensor-parallel ranks (compress a single-device copy)", key="parallel.use")
        return self.n_heads, self.n_kv_heads

    def prune_heads(self, keep: list[int]) -> None:
        """Keep query heads ``keep`` (ascending) and the key/value heads they read: the rows of
        ``q_proj`` (and ``k_proj``/``v_proj``) for those heads and the matching input columns of
        ``out_proj`` stay; everything else goes, so the module is what ``len(keep)`` heads would build.
        Query head h reads key/value head ``h // g``; after pruning every remaining key/value head must
        still serve the same number of query heads (``ValueError`` otherwise: the grouping could not be
        expressed by ``n_kv_heads`` alone)."""
        self.head_groups()  # refuses a tensor-parallel module
        H, hs = self.n_heads, self.head_dim
        group = H // self.n_kv_heads
        if not keep or list(keep) != sorted(set(keep)) or keep[0] < 0 or keep[-1] >= H:
            raise ValueError(f"keep must list distinct query heads of 0..{H - 1} in ascending order; got {keep}")
        kv_keep = sorted({h // group for h in keep})
        per_group = len(keep) // len(kv_keep)
        if per_group * len(kv_keep) != len(keep) or any(
                sum(1 for h in keep if h // group == g) != per_group for g in kv_keep):
            raise ValueError(f"keeping query heads {keep} would leave key/value groups of different sizes "
                             f"(each of the {self.n_kv_heads} key/value heads serves {group} query heads)")
        q_rows = _head_rows(keep, hs, self.q_proj.weight.device)
        kv_rows = _head_rows(kv_keep, hs, self.k_proj.weight.device)
        _take_rows(self.q_proj, q_rows)
        _take_rows(self.k_proj, kv_rows)
        _take_rows(self.v_proj, kv_rows)
        _take_columns(self.out_proj, q_rows)
        previous = self.kept_heads.tolist() if self.kept_heads is not None else range(H)
        self.kept_heads = torch.tensor([previous[h] for h in keep], device=self.q_proj.weight.device)
        self.n_heads, self.n_kv_heads = len(keep), len(kv_keep)

    def _take_local_heads(self, mesh) -> None:
        self.tp_size, self.tp_rank = mesh.size(), mesh.get_local_rank()

    def reset_parameters(self, shape: ModelShape) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=shape.init_std)
        nn.init.normal_(self.out_proj.weight, mean=0.0, std=shape.residual_init_std)
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        for norm in (getattr(self, "q_norm", None), getattr(self, "k_norm", None)):  # cross-attention has none
            if norm is not None:
                norm.reset_parameters()


class CrossAttention(CrossAttentionModule):
    """Queries from the decoder's tokens, keys and values from the encoder's output, with ``n_kv_heads``
    key/value heads: every query sees every unpadded encoder position (no mask beyond the padding,
    no position scheme, as in T5 and BART). Its projections have the self-attention's names, so PEFT
    roles and a converter's weight map treat both alike."""

    def __init__(self, shape: ModelShape, n_kv_heads: int):
        super().__init__()
        _add_projections(self, shape, n_kv_heads)
        self.reset_parameters(shape)

    def memory_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, S, _ = memory.shape
        k = self.k_proj(memory).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, S, hs)
        v = self.v_proj(memory).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return k, v

    def forward(self, x: torch.Tensor, ctx: MixerContext, state=None) -> torch.Tensor:
        B, T, _ = x.shape
        H, hs = self.n_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, hs).transpose(1, 2)                  # (B, H, T, hs)
        k, v = self.memory_kv(ctx.memory) if state is None else state          # (B, Hkv, S, hs)
        mask = None
        if ctx.memory_padding is not None:
            mask = ~ctx.memory_padding[:, None, None, :]                        # (B, 1, 1, S): True = attend
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                                           enable_gqa=True)                    # (B, H, T, hs)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, H * hs))

    def peft_roles(self) -> dict[str, str]:
        return {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"}

    def reset_parameters(self, shape: ModelShape) -> None:
        SelfAttention.reset_parameters(self, shape)


def _head_rows(heads: list[int], head_dim: int, device) -> torch.Tensor:
    """The feature indices of ``heads``, each ``head_dim`` wide: rows of a projection into heads."""
    heads = torch.tensor(heads, device=device)
    return (heads[:, None] * head_dim + torch.arange(head_dim, device=device)).flatten()


def _take_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    """``linear`` shrunk in place to output features ``rows`` (a new Linear would draw an initialisation
    from the global generator, moving the run's random stream just to be overwritten)."""
    linear.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=linear.weight.requires_grad)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=linear.bias.requires_grad)
    linear.out_features = len(rows)


def _take_columns(linear: nn.Linear, columns: torch.Tensor) -> None:
    """``linear`` shrunk in place to input features ``columns`` (its bias, per output, unchanged)."""
    linear.weight = nn.Parameter(linear.weight.detach()[:, columns].clone(), requires_grad=linear.weight.requires_grad)
    linear.in_features = len(columns)


class ProjectionOptions(Options):
    """What mha, gqa and mqa share: how the heads are projected."""

    qkv_bias: bool | None = Field(
        None, help="biases on the query, key and value projections (Qwen2); default (unset): model.bias")
    qk_norm: bool = Field(False, help="RMS-normalise each query and key head before the position scheme (Qwen3)")
    qk_norm_eps: float = Field(1e-6, gt=0, help="qk_norm: the epsilon of those norms")


class GroupedQueryAttentionOptions(ProjectionOptions):
    n_kv_heads: int | None = Field(
        None, ge=1, help="key/value heads, each shared by n_heads / n_kv_heads query heads; must divide "
                         "model.n_heads; default (unset) = model.n_heads, as in Hugging Face's Llama")


class GroupedQueryAttention(Attention):
    """``gqa``: ``n_kv_heads`` key/value heads shared by groups of query heads (Ainslie et al. 2023)."""

    Options = GroupedQueryAttentionOptions
    api = ">=1.20,<2"  # ModelShape.explicit_head_dim; build_cross (1.13); head_groups, prune_heads (1.9); kv_layout, key_mask (1.8); causal (1.4)
    bidirectional = True
    cross_attention = True

    def kv_heads(self, shape: ModelShape) -> int:
        n_kv_heads = self.options.n_kv_heads or shape.n_heads
        if shape.n_heads % n_kv_heads:
            raise UserError(f"must divide model.n_heads = {shape.n_heads}; got {n_kv_heads}",
                            key="attention.n_kv_heads")
        return n_kv_heads

    def build(self, shape: ModelShape, layer: int) -> SelfAttention:
        o = self.options
        return SelfAttention(shape, self._checked_kv_heads(shape), o.qkv_bias, o.qk_norm_eps if o.qk_norm else 0.0)

    def build_cross(self, shape: ModelShape, layer: int) -> CrossAttention:
        return CrossAttention(shape, self._checked_kv_heads(shape))

    def _checked_kv_heads(self, shape: ModelShape) -> int:
        if shape.explicit_head_dim is None and shape.d_model % shape.n_heads:
            raise UserError(f"must divide model.d_model = {shape.d_model}; got {shape.n_heads}", key="model.n_heads")
        return self.kv_heads(shape)


class MultiHeadAttention(GroupedQueryAttention):
    """``mha``: one key/value head per query head (Vaswani et al. 2017)."""

    Options = ProjectionOptions  # no key/value heads to choose

    def kv_heads(self, shape: ModelShape) -> int:
        return shape.n_heads


class MultiQueryAttention(GroupedQueryAttention):
    """``mqa``: a single key/value head shared by every query head (Shazeer 2019)."""

    Options = ProjectionOptions  # no key/value heads to choose

    def kv_heads(self, shape: ModelShape) -> int:
        return 1
