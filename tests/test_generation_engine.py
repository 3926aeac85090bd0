"""The generation engine: rows of different lengths in one cache, contiguous or paged, equal to decoding alone."""

import pytest
import torch

from lmlab import discovery
from lmlab.api import ModelShape
from lmlab.generation.token_ids import generate_tensor
from lmlab.generation.engine import Engine, RowEngine, make_engine
from lmlab.generation.outputs import Outputs
from lmlab.model import LanguageModel

SHAPE = ModelShape(n_layers=2, d_model=32, n_heads=4, block_size=64, vocab_size=23, dropout=0.0, bias=False)


def model_with(position: str, attention: str = "gqa", block_size: int = 64, **options):
    torch.manual_seed(0)
    shape = ModelShape(**{**SHAPE.__dict__, "block_size": block_size}) if block_size != 64 else SHAPE
    attn_cls = discovery.load("attention", attention)
    attn = attn_cls(attn_cls.Options(**options)) if options else attn_cls()
    model = LanguageModel(shape, position=discovery.load("position", position)(), attention=attn,
                          ffn=discovery.load("ffn", "mlp")(), tie_embeddings=False)
    # Sharpen an untrained model's nearly flat logits so that greedy choices are clear.
    with torch.no_grad():
        model.head.weight.mul_(40)
    return model.eval()


def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SHAPE.vocab_size, (n,), generator=g).tolist() for n in lengths]


def greedy():
    return discovery.load("decoding", "greedy")()


def alone(model, ids, n):
    return generate_tensor(greedy(), model, torch.tensor([ids]), n)[0, len(ids):].tolist()


@pytest.mark.parametrize("position", ["rope", "learned", "alibi", "sinusoidal"])
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_a_batch_of_prompts_of_different_lengths_equals_each_generated_alone(position, cache):
    model = model_with(position, n_kv_heads=2)
    assert isinstance(make_engine(model, 1, 8), Engine)  # the shared cache, not row by row
    batch = prompts([3, 11, 6, 1, 17])
    engine = make_engine(model, len(batch), 17 + 20, cache=cache, block_size=4)
    outputs = Outputs(None, [20] * len(batch))
    from lmlab.generation.token_ids import run_decoder

    for _ in run_decoder(greedy(), engine, batch, outputs):
        pass
    for ids, c in zip(batch, outputs.completions):
        assert c.tokens == alone(model, ids, 20)


def _trace(model, cache: str, lengths, limits, joins):
    """Greedy over rows that end at different steps while new ones join; every step's logits per sequence."""
    engine = make_engine(model, 3, 80, cache=cache, block_size=4, n_blocks=40 if cache == "paged" else None)
    waiting = list(zip(prompts(lengths, seed=3), limits))
    live, logits_of, made = {}, {}, {}
    seq = 0
    step = 0
    while waiting or live:
        while waiting and engine.rows_free and (step >= joins[seq] if seq < len(joins) else True):
            ids, limit = waiting.pop(0)
            (row,), first = engine.add([ids])
            live[seq] = [row, limit, first[0]]
            logits_of[seq], made[seq] = [first[0]], []
            seq += 1
        if not live:
            step += 1
            continue
        order = sorted(live)
        tokens = torch.stack([live[s][2].argmax() for s in order])
        for s, t in zip(order, tokens.tolist()):
            made[s].append(t)
        ended = [s for s in order if len(made[s]) == live[s][1]]
        engine.release([live[s][0] for s in ended])
        keep = [i for i, s in enumerate(order) if s not in ended]
        for s in ended:
            del live[s]
        if keep:
            out = engine.step([live[order[i]][0] for i in keep], tokens[keep][:, None])[:, -1]
            for i, row_logits in zip(keep, out):
                live[order[i]][2] = row_logits
                logits_of[order[i]].append(row_logits)
        step += 1
    return {s: torch.stack(v) for s, v in logits_of.items()}, made


def test_paged_and_contiguous_caches_give_the_same_logits_over_a_long_batched_generation():
    model = model_with("rope", n_kv_heads=2)
    # Five sequences through three rows: rows end at different steps and their blocks serve the next.
    args = ([5, 9, 2, 14, 7], [40, 13, 27, 33, 21], [0, 0, 4, 9, 15])
    contiguous, made_c = _trace(model, "contiguous", *args)
    paged, made_p = _trace(model, "paged", *args)
    assert made_c == made_p
    for s in contiguous:
        torch.testing.assert_close(paged[s], contiguous[s], rtol=0, atol=1e-5)
    for s, ids in enumerate(prompts(args[0], seed=3)):
        assert made_c[s] == alone(model, ids, args[1][s])


def test_paged_blocks_are_freed_when_a_sequence_ends_and_shared_until_written():
    model = model_with("rope")
    engine = make_engine(model, 4, 64, cache="paged", block_size=4, n_blocks=16)
    store = engine.store
    (a,), _ = engine.add([list(range(10))])  # 3 blocks
    assert store.available() == 13
    (b,) = engine.fork([a])  # shares a's blocks
    assert store.available() == 13
    logits_b = engine.step([b], torch.tensor([[5]]))  # writes into the shared third block: one copy
    assert store.available() == 12
    logits_a = engine.step([a], torch.tensor([[5]]))
    torch.testing.assert_close(logits_a, logits_b, rtol=0, atol=0)
    engine.release([a, b])
    assert store.available() == 16


def test_rewind_drops_tokens_as_if_never_fed():
    model = model_with("alibi")
    for cache in ("contiguous", "paged"):
        engine = make_engine(model, 2, 64, cache=cache, block_size=4)
        rows, _ = engine.add(prompts([6, 3]))
        engine.step(rows, torch.tensor([[1, 2, 3], [4, 5, 6]]))
        engine.rewind(rows, [2, 1])
        redo = engine.step(rows, torch.tensor([[7], [8]]))
        fresh = make_engine(model, 2, 64, cache=cache, block_size=4)
        rows2, _ = fresh.add(prompts([6, 3]))
        fresh.step([rows2[0]], torch.tensor([[1]]))
        fresh.step([rows2[1]], torch.tensor([[4, 5]]))
        torch.testing.assert_close(redo, fresh.step(rows2, torch.tensor([[7], [8]])), rtol=0, atol=1e-5)


def test_a_sequence_past_a_learned_table_slides_its_window_like_the_stepper():
    model = model_with("learned", block_size=16)
    ids = prompts([20])[0]  # longer than the table
    engine_out = alone(model, ids, 30)
    rows = RowEngine(model, 50)  # lmlab.api.Stepper's sliding window, row by row
    outputs = Outputs(None, [30])
    from lmlab.generation.token_ids import run_decoder

    for _ in run_decoder(greedy(), rows, [ids], outputs):
        pass
    assert engine_out == outputs.completions[0].tokens


def test_a_model_whose_attention_keeps_its_own_state_decodes_row_by_row_with_the_same_tokens():
    class NoLayout(type(discovery.load("attention", "mha")())):
        def build(self, shape, layer):
            module = super().build(shape, layer)
            module.kv_layout = lambda: None
            return module

    shared = model_with("rope", attention="mha")
    torch.manual_seed(0)
    rows = LanguageModel(SHAPE, position=discovery.load("position", "rope")(), attention=NoLayout(),
                         ffn=discovery.load("ffn", "mlp")(), tie_embeddings=False).eval()
    rows.load_state_dict(shared.state_dict())
    assert isinstance(make_engine(rows, 2, 32), RowEngine) and isinstance(make_engine(shared, 2, 32), Engine)
    batch = prompts([4, 9])
    padded = [ids + [0] * (9 - len(ids)) for ids in batch]  # generate takes a (B, T) tensor
    out_rows = generate_tensor(greedy(), rows, torch.tensor(padded), 12)
    out_shared = generate_tensor(greedy(), shared, torch.tensor(padded), 12)
    assert out_rows.tolist() == out_shared.tolist()


def test_a_model_that_supplies_its_own_engine_is_decoded_through_it():
    from lmlab.api.decoding import SharedCacheEngine, engine_supports_rows

    class CountingEngine(SharedCacheEngine):
        """A third party's engine: every pass goes through its forward_rows."""

        def __init__(self, model, rows, max_len, **settings):
            super().__init__(model, rows, max_len, **settings)
            self.passes = 0

        def forward_rows(self, rows, tokens):
            self.passes += 1
            return super().forward_rows(rows, tokens)

    class OwnEngineModel(LanguageModel):  # no `encode`: nothing but make_engine marks it
        def make_engine(self, rows, max_len, **settings):
            assert engine_supports_rows(self)
            self.asked = settings
            return CountingEngine(self, rows, max_len, **settings)

    plain = model_with("rope")
    torch.manual_seed(0)
    model = OwnEngineModel(SHAPE, position=discovery.load("position", "rope")(),
                           attention=discovery.load("attention", "gqa")(), ffn=discovery.load("ffn", "mlp")(),
                           tie_embeddings=False).eval()
    model.load_state_dict(plain.state_dict())
    engine = make_engine(model, 2, 24, cache="paged", block_size=4)
    assert type(engine) is CountingEngine
    assert model.asked == dict(cache="paged", block_size=4, n_blocks=None, cuda_graph=False, compile=False)
    assert type(engine.companion(plain)) is Engine  # a draft model without its own engine gets the core's
    batch = prompts([3, 7])
    outputs = Outputs(None, [6, 6])
    from lmlab.generation.token_ids import run_decoder

    for _ in run_decoder(greedy(), engine, batch, outputs):
        pass
    assert engine.passes >= 1 + 5  # the prompts, then one pass per step
    assert [c.tokens for c in outputs.completions] == [alone(plain, ids, 6) for ids in batch]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_the_cuda_graph_decode_step_equals_the_eager_one():
    model = model_with("rope", n_kv_heads=2).cuda()
    batch = prompts([3, 11, 6])
    from lmlab.generation.token_ids import run_decoder

    results = []
    for graph in (False, True):
        engine = make_engine(model, len(batch), 40, cuda_graph=graph)
        assert (engine.graphed is not None) == graph
        outputs = Outputs(None, [25] * len(batch))
        for _ in run_decoder(greedy(), engine, batch, outputs):
            pass
        results.append([c.tokens for c in outputs.completions])
    assert results[0] == results[1]


@pytest.mark.slow
def test_the_compiled_decode_step_gives_the_eager_tokens(tmp_path, monkeypatch):
    """... and its compilation is timed apart and cached in lmlab's cache folder (where a later
    process finds it)."""
    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    model = model_with("rope", n_kv_heads=2)
    batch = prompts([3, 11, 6])
    from lmlab.generation.token_ids import run_decoder

    results = []
    for compiled in (False, True):
        engine = make_engine(model, len(batch), 40, compile=compiled)
        assert (engine.graphed is not None) == compiled
        outputs = Outputs(None, [25, 10, 25])  # a row that ends early leaves the others stepping eagerly
        for _ in run_decoder(greedy(), engine, batch, outputs):
            pass
        results.append([c.tokens for c in outputs.completions])
        assert (engine.compile_s > 0) == compiled and (engine.report() is not None) == compiled
    assert results[0] == results[1]
    assert "compiled in" in engine.report() and str(tmp_path / "torchinductor") in engine.report()
    assert any((tmp_path / "torchinductor").rglob("*")), "nothing cached"


class Chars:
    """A tokenizer of single characters, for the stop-string tests."""

    eos_id = None

    def decode(self, ids):
        return "".join(chr(97 + i) for i in ids)


def test_a_stop_string_split_over_tokens_ends_the_text_before_it_and_never_streams():
    outputs = Outputs(Chars(), [50], stop=[["cde"]])
    streamed = ""
    for token in [0, 1, 2, 3]:  # "abcd": "cd" may still become "cde"
        outputs.record(0, [token])
        streamed += outputs.delta(0)
    assert streamed == "ab" and not outputs.done(0)
    outputs.record(0, [4])  # "e" completes the stop string
    streamed += outputs.delta(0)
    assert outputs.done(0) and outputs.completions[0].finish_reason == "stop"
    assert streamed == "ab" == outputs.completions[0].text


def test_eos_and_the_token_limit_end_a_prompt():
    outputs = Outputs(Chars(), [3, 10], eos_id=4)
    outputs.record(0, [0, 1, 2, 3])
    outputs.record(1, [0, 4, 1])
    assert [c.finish_reason for c in outputs.completions] == ["length", "stop"]
    assert [c.tokens for c in outputs.completions] == [[0, 1, 2], [0]]
    assert outputs.ends(1, [2, 4]) and outputs.ends(0, [1, 1, 1]) and not outputs.ends(0, [1])
