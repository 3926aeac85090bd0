"""The conformance kit (lmlab.testing): every installed first-party attention, position and ffn plugin
passes it, and plugins broken in one specific way each fail it, with a message naming the check."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmlab import discovery
from lmlab.api import (FFN, Attention, AttentionModule, Field, FFNModule, KVCache, MixerContext, ModelShape, Options, Position,
                       PositionModule, UserError)
from lmlab.testing import (ConformanceError, check_attention, check_ffn, check_names, check_plugin,
                           check_plugin_class, check_position, iter_checks)

SLOTS = ("attention", "position", "ffn")
INSTALLED = [(slot, name) for slot in SLOTS for name in sorted({p.name for p in discovery.installed()[slot]})]
WITH_OPTIONS = [("attention", "gqa", {"n_kv_heads": 2}), ("attention", "gqa", {"n_kv_heads": 2, "qkv_bias": True, "qk_norm": True}),
                ("position", "rope", {"scaling": "llama3", "factor": 4.0, "original_max_positions": 8})]


@pytest.mark.parametrize("slot, name, options", [(s, n, None) for s, n in INSTALLED] + WITH_OPTIONS,
                         ids=[f"{s}/{n}" for s, n in INSTALLED] + [f"{s}/{n}{o}" for s, n, o in WITH_OPTIONS])
def test_installed_first_party_plugin_passes_the_kit(slot, name, options):
    check_plugin(discovery.load(slot, name), options)


# -- a small correct attention, and attentions broken in one way each -------------------------------

class TinyAttentionModule(AttentionModule):
    """Causal multi-head attention with a KV cache that honours the position scheme: correct."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.n_heads, self.head_dim = shape.n_heads, shape.head_dim
        self.qkv = nn.Linear(shape.d_model, 3 * shape.d_model, bias=False)
        self.out = nn.Linear(shape.d_model, shape.d_model, bias=False)

    def forward(self, x, ctx, state=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).split(C, dim=-1))
        if ctx.position.rotates:
            q, k = ctx.position.rotate(q, k, self.rotary_positions(ctx))
        if state is not None:
            k, v = self.write_cache(state, k, v, ctx.start)
        S = k.shape[2]
        k_positions = ctx.positions[-1] - S + 1 + torch.arange(S)
        mask = self.mask(ctx.positions, k_positions)                           # (T, S) True = may attend
        if ctx.position.biases:
            mask = torch.zeros(T, S).masked_fill(~mask, float("-inf")) + ctx.position.attention_bias(
                ctx.positions, k_positions)
            mask = mask.to(q.dtype)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)           # (B, H, T, hs)
        return self.out(y.transpose(1, 2).reshape(B, T, C))

    def rotary_positions(self, ctx):
        return ctx.positions

    def write_cache(self, state, k, v, start):
        return state.update(k, v, start)

    def mask(self, q_positions, k_positions):
        return k_positions[None, :] <= q_positions[:, None]

    def new_state(self, batch_size, max_len, device, dtype):
        return KVCache(batch_size, self.n_heads, max_len, self.head_dim, device=device, dtype=dtype)

    def reset_parameters(self, shape):
        nn.init.normal_(self.qkv.weight, 0.0, shape.init_std)
        nn.init.normal_(self.out.weight, 0.0, shape.residual_init_std)


class TinyAttention(Attention):
    name = "tiny"
    module = TinyAttentionModule

    def build(self, shape, layer):
        return self.module(shape)


def broken_attention(name: str, **overrides):
    """A TinyAttention plugin called ``name`` whose module overrides some methods."""
    module = type(f"{name.title()}Module", (TinyAttentionModule,), overrides)
    return type(name.title(), (TinyAttention,), {"name": name, "module": module})


def no_causal_mask(self, q_positions, k_positions):
    return torch.ones(len(q_positions), len(k_positions), dtype=torch.bool)


def forget_cache(self, state, k, v, start):
    return k, v  # attends to the new tokens only


def positions_from_zero(self, ctx):
    return torch.arange(len(ctx.positions))  # every chunk rotated as if it started the sequence


def extra_parameter_init(self, shape):
    TinyAttentionModule.__init__(self, shape)
    self.unused = nn.Parameter(torch.zeros(shape.d_model))


def noisy_forward(self, x, ctx, state=None):
    return TinyAttentionModule.forward(self, x, ctx, state) + 0.1 * torch.rand_like(x)


def float32_forward(self, x, ctx, state=None):
    return TinyAttentionModule.forward(self, x, ctx, state).float()


def unregistered_init(self, shape):
    TinyAttentionModule.__init__(self, shape)
    self.gain = torch.rand(shape.d_model)  # a plain attribute: not in the state dict


def unregistered_forward(self, x, ctx, state=None):
    return TinyAttentionModule.forward(self, x, ctx, state) * self.gain


def compile_sensitive_forward(self, x, ctx, state=None):
    y = TinyAttentionModule.forward(self, x, ctx, state)
    return 2 * y if torch.compiler.is_compiling() else y


def refuse_position_schemes(self, x, ctx, state=None):
    if ctx.position.rotates or ctx.position.biases:
        raise UserError("no queries to rotate or scores to bias", key="position.use")
    return TinyAttentionModule.forward(self, x, ctx, state)


def rows_as_one_forward(self, x, ctx, state=None):
    if ctx.key_mask is not None:  # ignores the key mask: every row is masked as row 0 is
        ctx = MixerContext(position=ctx.position, positions=ctx.positions[0], start=ctx.start)
    return TinyAttentionModule.forward(self, x, ctx, state)


def failures(plugin, **settings) -> dict[str, str]:
    """check name → message, for every check the plugin fails."""
    found = {}
    for check in iter_checks(plugin, **settings):
        try:
            check()
        except ConformanceError as exc:
            found[check.name] = str(exc)
    return found


def test_a_correct_small_attention_passes_and_leaves_the_callers_random_state_alone():
    rng = torch.get_rng_state()
    check_attention(TinyAttention, skip=["compile"])
    assert torch.equal(torch.get_rng_state(), rng)


BROKEN_ATTENTIONS = [
    (broken_attention("leaky", mask=no_causal_mask), "causality",
     "outputs up to position 0 changed when only inputs after 0 did"),
    (broken_attention("forgetful", write_cache=forget_cache), "incremental_decoding",
     "the cached single step of positions 5..5 differs from the full forward (no position scheme): "
     "first at position 5"),
    (broken_attention("offset", rotary_positions=positions_from_zero), "incremental_decoding",
     "differs from the full forward (a rotating and biasing position scheme)"),
    (broken_attention("unused", __init__=extra_parameter_init), "gradients", "unused got no gradient"),
    (broken_attention("noisy", forward=noisy_forward), "determinism", "two eval-mode forwards of one module"),
    (broken_attention("upcast", forward=float32_forward), "output_bf16",
     "has dtype torch.float32, expected torch.bfloat16"),
    (broken_attention("unregistered", __init__=unregistered_init, forward=unregistered_forward), "state_dict",
     "after loading another build's state dict, the output differs"),
    (broken_attention("maskless", forward=rows_as_one_forward, kv_layout=lambda self: (self.n_heads, self.head_dim)),
     "ragged_decoding", "decoding rows of lengths"),
]


def test_a_mixer_may_refuse_a_rotating_or_biasing_scheme_with_a_user_error():
    check_attention(broken_attention("positionless", forward=refuse_position_schemes), skip=["compile"])


@pytest.mark.parametrize("plugin, check, observed", BROKEN_ATTENTIONS, ids=[p.name for p, _, _ in BROKEN_ATTENTIONS])
def test_a_broken_attention_fails_the_check_that_observes_its_bug(plugin, check, observed):
    found = failures(plugin, skip=["compile"])
    assert check in found, found
    assert found[check].startswith(f"{plugin.name}: {check}: ") and observed in found[check], found[check]
    with pytest.raises(ConformanceError, match=f"(?m)^{plugin.name}: {check}: "):
        check_attention(plugin, skip=["compile"])


def test_an_attention_that_compiles_to_something_else_fails_the_compile_check():
    plugin = broken_attention("shapeshifter", forward=compile_sensitive_forward)
    found = failures(plugin, skip=[n for n in check_names("attention") if n not in ("compile", "output_fp32")])
    assert set(found) == {"compile"}, found
    assert found["compile"].startswith("shapeshifter: compile: the output compiled with backend 'aot_eager' differs "
                                       "from the eager output")


def test_a_failing_compile_check_leaves_no_torch_trace_records_in_the_test_report(caplog):
    # torch's "torch.__trace" logger stays at DEBUG and pytest captures non-propagating loggers too: a
    # failing kit test used to print some 80 empty DEBUG lines of it.
    trace = logging.getLogger("torch.__trace")
    level = trace.level
    plugin = broken_attention("shapeshifter", forward=compile_sensitive_forward)
    with caplog.at_level(logging.DEBUG):
        found = failures(plugin, skip=[n for n in check_names("attention") if n != "compile"])
    assert set(found) == {"compile"}, found
    assert [r for r in caplog.records if r.name.startswith("torch.__trace")] == []
    assert trace.level == level  # restored for whoever traces after the kit


# -- position and ffn plugins broken in one way each ------------------------------------------------

class MeanPositionModule(PositionModule):
    """Adds the mean over the whole sequence: position t sees tokens after t."""

    adds_embedding = True

    def embed(self, x, positions):
        return x + x.mean(dim=1, keepdim=True)


class MeanPosition(Position):
    name = "mean"

    def build(self, shape):
        return MeanPositionModule()


class MixingMLP(FFNModule):
    """An MLP plus the sequence mean of its input: tokens interact."""

    def __init__(self, shape):
        super().__init__()
        self.fc = nn.Linear(shape.d_model, shape.d_model)

    def forward(self, x):
        return self.fc(x) + x.mean(dim=1, keepdim=True)


class MixingFFN(FFN):
    name = "mixing"

    def build(self, shape, layer):
        return MixingMLP(shape)


class BatchNormMLP(FFNModule):
    """An MLP whose outputs are batch-normalised over all the tokens of the batch (Ioffe and Szegedy
    2015): position-wise in eval mode, with running statistics, but in training every output depends
    on the later tokens' statistics."""

    def __init__(self, shape):
        super().__init__()
        self.fc = nn.Linear(shape.d_model, shape.d_model)
        self.norm = nn.BatchNorm1d(shape.d_model)

    def forward(self, x):
        B, T, C = x.shape
        return self.norm(self.fc(x).view(B * T, C)).view(B, T, C)


class BatchNormFFN(FFN):
    name = "batchnorm"

    def build(self, shape, layer):
        return BatchNormMLP(shape)


def test_a_position_scheme_that_leaks_the_future_fails_causality():
    found = failures(MeanPosition, skip=["compile"])
    assert "embed outputs up to position 0 changed when only inputs after 0 did" in found["causality"]
    assert found["causality"].startswith("mean: causality: ")
    with pytest.raises(ConformanceError, match="(?m)^mean: causality: "):
        check_position(MeanPosition, skip=["compile"])


def test_an_ffn_that_mixes_positions_fails_position_wise_independence():
    found = failures(MixingFFN, skip=["compile"])
    assert set(found) == {"position_wise", "training_causality"}, found  # it mixes in both modes
    assert found["position_wise"].startswith("mixing: position_wise: changing the input at row 0, position 0 "
                                             "changed the output at row 0, position ")
    with pytest.raises(ConformanceError, match="(?m)^mixing: position_wise: "):
        check_ffn(MixingFFN, skip=["compile"])


def test_an_ffn_whose_training_outputs_see_later_tokens_fails_training_causality():
    found = failures(BatchNormFFN, skip=["compile"])
    assert set(found) == {"training_causality"}, found
    assert found["training_causality"].startswith("batchnorm: training_causality: in training mode, outputs up to "
                                                  "position 0 changed when only inputs after 0 did")
    with pytest.raises(ConformanceError, match="^batchnorm: training_causality: "):
        check_ffn(BatchNormFFN, skip=["compile"])


# -- the kit's own surface --------------------------------------------------------------------------

def test_checks_are_named_for_pytest_ids_and_can_be_skipped():
    checks = iter_checks(TinyAttention, skip=["compile"])
    assert [c.__name__ for c in checks] == [n for n in check_names("attention") if n != "compile"]
    with pytest.raises(ValueError, match="no check named compiled"):
        iter_checks(TinyAttention, skip=["compiled"])


class NeedsAnOption(Options):
    width: int = Field(help="no default")


class Unconstructible(FFN):
    Options = NeedsAnOption


class FutureApi(MixingFFN):
    api = ">=2"


def test_plugin_class_basics_are_checked_with_a_message_naming_the_plugin():
    check_plugin_class(TinyAttention, "attention")
    with pytest.raises(ConformanceError, match="^tiny: plugin_class: .* not a subclass of lmlab.api.FFN"):
        check_plugin_class(TinyAttention, "ffn")
    with pytest.raises(ConformanceError, match="excludes this lmlab.api"):
        check_plugin_class(FutureApi)
    with pytest.raises(ConformanceError, match="every option needs a default"):
        check_plugin_class(Unconstructible)
    check_plugin_class(Unconstructible, options={"width": 3})
    with pytest.raises(ConformanceError, match=r"^tiny \(n_kv_heads=2\): plugin_class: options .* are refused"):
        check_attention(TinyAttention, {"n_kv_heads": 2})


@pytest.mark.exclusive
def test_a_parallel_check_fails_when_fewer_processes_train_than_were_to(tmp_path):
    from lmlab.testing import check_parallel_matches_single

    # `single` trains on one process: with one replica its losses equal the reference's exactly, so
    # only the count of processes that took part can tell it from a working two-process layout.
    with pytest.raises(AssertionError, match="2 processes were to train, 1 took part"):
        check_parallel_matches_single('use = "single"\naccelerator = "cpu"', tmp_path, replicas=1, processes=2,
                                      steps=4)


# -- options the default shape never exercises: a sliding window of 32 in 16 positions --------------

class WindowOptions(Options):
    window: int = Field(32, ge=2, help="each query attends to itself and the window - 1 positions before it")


class WindowCache:
    """The keys and values of the last ``keep`` positions: all that a later query may see."""

    def __init__(self, keep: int):
        self.keep, self.k, self.v = keep, None, None

    def append(self, k, v):
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        first = max(0, k.shape[2] - self.keep)
        self.k, self.v = k[:, :, first:], v[:, :, first:]
        return k, v

    def reorder(self, index):
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


class SlidingWindowModule(TinyAttentionModule):
    """Sliding-window attention (Mistral's) with its own cache of the last window - 1 keys; ``evict_early``
    keeps one key fewer, so decoding drops a key the full forward still attends to."""

    def __init__(self, shape, window: int, evict_early: bool = False):
        super().__init__(shape)
        self.window, self.evict_early = window, evict_early

    def write_cache(self, state, k, v, start):
        return state.append(k, v)

    def mask(self, q_positions, k_positions):
        before = k_positions[None, :] <= q_positions[:, None]
        return before & (k_positions[None, :] > q_positions[:, None] - self.window)

    def new_state(self, batch_size, max_len, device, dtype):
        return WindowCache(self.window - (2 if self.evict_early else 1))


class SlidingWindow(TinyAttention):
    name = "sliding"
    Options = WindowOptions
    evict_early = False

    def build(self, shape, layer):
        return SlidingWindowModule(shape, self.options.window, self.evict_early)


class EarlyEvictingWindow(SlidingWindow):
    name = "early-evicting"
    evict_early = True


def test_a_window_larger_than_the_default_block_is_exercised_at_the_plugins_own_options():
    # At the default block_size of 16 the cache never holds 30 keys, so the early eviction went unseen.
    found = failures(EarlyEvictingWindow, skip=["compile"])
    assert set(found) == {"incremental_decoding", "cache_reorder"}, found
    assert found["incremental_decoding"].startswith(
        "early-evicting: incremental_decoding: at block_size 67, past option window = 32: the cached "), found
    with pytest.raises(ConformanceError, match="(?m)^early-evicting: incremental_decoding: at block_size 67, "):
        check_attention(EarlyEvictingWindow)  # its default options: a window of 32
    check_attention(SlidingWindow)


def test_a_window_the_default_block_fills_is_checked_there_alone():
    with pytest.raises(ConformanceError,
                       match=r"(?m)^early-evicting \(window=5\): incremental_decoding: the cached single step"):
        check_attention(EarlyEvictingWindow, {"window": 5}, skip=["compile"])
    check_attention(SlidingWindow, {"window": 5}, skip=["compile"])


@pytest.mark.parametrize("window", [180, 200, 255])
def test_a_window_past_the_third_of_the_longest_block_is_stepped_through_where_it_fills(window):
    # The schedule used to step singly only up to a third of the block, then chunk to the end: a cache
    # that evicts one key early was never stepped past its window there (it passed at 180, 200, 255).
    found = failures(EarlyEvictingWindow, options={"window": window}, skip=["compile"])
    assert "incremental_decoding" in found and set(found) <= {"incremental_decoding", "cache_reorder"}, found
    assert f"at block_size {2 * window + 3}, past option window = {window}: the cached single step" in \
        found["incremental_decoding"], found
    assert failures(SlidingWindow, options={"window": window}, skip=["compile"]) == {}


class BoundedWindowOptions(Options):
    window: int = Field(32, ge=2, le=256, help="each query attends to itself and the window - 1 positions before it")


class FixedBufferWindow(SlidingWindow):
    """A cache of at most 190 keys, whatever the window: right at its default window of 32, wrong for
    the windows from 192 up to the 256 its Options accept."""

    name = "fixed-buffer"
    Options = BoundedWindowOptions

    def build(self, shape, layer):
        module = SlidingWindowModule(shape, self.options.window)
        module.new_state = lambda batch_size, max_len, device, dtype: WindowCache(min(module.window - 1, 190))
        return module


class BoundedWindow(SlidingWindow):
    name = "bounded"
    Options = BoundedWindowOptions


def test_an_int_option_is_checked_up_to_its_declared_maximum():
    found = failures(FixedBufferWindow, skip=["compile"])  # its default options: a window of 32
    assert "incremental_decoding" in found and set(found) <= {"incremental_decoding", "cache_reorder"}, found
    assert found["incremental_decoding"].startswith(
        "fixed-buffer: incremental_decoding: with option window = 256 (its declared maximum), at block_size 515: "
        "the cached single step"), found
    assert failures(BoundedWindow, skip=["compile"]) == {}


def test_an_int_option_is_checked_up_to_the_range_the_test_states():
    # Unbounded in its Options: only the author can say how far it is meant to go.
    assert failures(EarlyEvictingWindow, options={"window": 5}, skip=["compile", "cache_reorder"],
                    ranges={"window": (2, 40)})["incremental_decoding"].startswith(
        "early-evicting (window=5): incremental_decoding: the cached single step")
    found = failures(FixedBufferWindow, options={"window": 5}, skip=["compile"], ranges={"window": (2, 200)})
    assert "with option window = 200 (the top of the range the test states), at block_size 403" in \
        found["incremental_decoding"], found
    assert failures(FixedBufferWindow, options={"window": 5}, skip=["compile"], ranges={"window": (2, 150)}) == {}
