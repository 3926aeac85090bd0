"""The encoder–decoder model: a causal decoder, a bidirectional encoder, cross-attention that sees the
whole (unpadded) encoder output and nothing of the decoder's future, cached generation equal to the
full forward pass for every decoding plugin, and the manifest's refusals."""

import pytest
import torch

from lmlab import discovery
from lmlab.api import ModelParts, ModelShape
from lmlab.generation.engine import make_engine
from lmlab.testing.runs import main

SHAPE = ModelShape(n_layers=2, d_model=32, n_heads=4, block_size=24, vocab_size=37)


def build(attention="mha", position="learned", ffn="mlp", seed=0, **options):
    """The encoder-decoder architecture's model (``options``: its [architecture] options), built as a
    run's is, through discovery."""
    torch.manual_seed(seed)
    plugins = {slot: discovery.load(slot, name)() for slot, name in
               (("attention", attention), ("position", position), ("ffn", ffn))}
    cls = discovery.load("architecture", "encoder-decoder")
    arch = cls(cls.Options(**{"encoder_layers": 3, "decoder_start_id": 1, **options}))
    return arch.build(ModelParts(shape=SHAPE, family="encoder-decoder", **plugins)).eval()


@pytest.fixture(params=[("mha", "learned"), ("gqa", "rope"), ("mqa", "alibi")], ids=lambda p: "-".join(p))
def model(request):
    return build(*request.param)


def test_decoder_outputs_before_t_ignore_decoder_tokens_after_t(model):
    enc = torch.randint(0, 37, (2, 11))
    dec = torch.randint(0, 37, (2, 16))
    changed = dec.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % 37
    with torch.no_grad():
        a, b = model(dec, encoder_ids=enc), model(changed, encoder_ids=enc)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-6)
    assert (a[:, 9:] - b[:, 9:]).abs().amax() > 1e-3


def test_encoder_is_bidirectional(model):
    enc = torch.randint(0, 37, (2, 11))
    for where in (0, 5, 10):
        changed = enc.clone()
        changed[:, where] = (changed[:, where] + 1) % 37
        with torch.no_grad():
            a, b = model.encode(enc), model.encode(changed)
        moved = (a - b).abs().amax(dim=-1)  # (B, S): which outputs the change reached
        assert (moved > 1e-4).all(), f"a change at {where} did not reach every encoder output: {moved}"


def test_cross_attention_sees_every_encoder_position_from_the_first_decoder_token(model):
    enc = torch.randint(0, 37, (2, 11))
    dec = torch.randint(0, 37, (2, 4))
    with torch.no_grad():
        base = model(dec, encoder_ids=enc)
        for where in (0, 5, 10):
            changed = enc.clone()
            changed[:, where] = (changed[:, where] + 1) % 37
            assert (model(dec, encoder_ids=changed)[:, 0] - base[:, 0]).abs().amax() > 1e-4


def test_encoder_padding_is_never_attended(model):
    enc = torch.randint(0, 37, (2, 11))
    padding = torch.zeros(2, 11, dtype=torch.bool)
    padding[1, 7:] = True  # row 1 holds 7 tokens
    garbage = enc.clone()
    garbage[1, 7:] = (garbage[1, 7:] + 5) % 37
    dec = torch.randint(0, 37, (2, 6))
    with torch.no_grad():
        a = model(dec, encoder_ids=enc, encoder_padding=padding)
        b = model(dec, encoder_ids=garbage, encoder_padding=padding)
        alone = model(dec[1:], encoder_ids=enc[1:, :7])  # the same row, unpadded
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a[1:], alone, rtol=1e-5, atol=1e-5)


def full_forward_logits(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    dec = torch.tensor([[model.decoder_start_id] + continuation])
    with torch.no_grad():
        return model(dec, encoder_ids=torch.tensor([prompt]))[0]


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_cached_generation_equals_the_full_forward_for_prompts_of_different_lengths(model, cache):
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15]]
    engine = make_engine(model, 4, 12, cache=cache, block_size=4)
    with torch.no_grad():
        rows, first = engine.add(prompts)
        fed = [[], [], []]
        logits = [first]
        for step in range(5):
            tokens = torch.tensor([[(7 * i + step) % 37] for i in range(3)])
            for i in range(3):
                fed[i].append(int(tokens[i, 0]))
            logits.append(engine.step(rows, tokens)[:, -1])
    for i, prompt in enumerate(prompts):
        reference = full_forward_logits(model, prompt, fed[i])
        for t, got in enumerate(logits):
            torch.testing.assert_close(got[i], reference[t], rtol=1e-4, atol=1e-5)


def test_forked_rows_carry_their_encoder_keys(model):
    engine = make_engine(model, 4, 10)
    with torch.no_grad():
        rows, _ = engine.add([[3, 4, 5], [6, 7, 8, 9, 10]])
        (twin,) = engine.fork([rows[1]])
        out = engine.step([twin, rows[0]], torch.tensor([[2], [2]]))[:, -1]
    torch.testing.assert_close(out[0], full_forward_logits(model, [6, 7, 8, 9, 10], [2])[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[1], full_forward_logits(model, [3, 4, 5], [2])[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("decoder", ["greedy", "beam"])
def test_every_decoder_matches_a_loop_of_full_forwards(decoder):
    from lmlab.generation.batch import generate_ids

    model = build("mha", "rope", seed=3)
    plugin = discovery.load("decoding", decoder)()
    prompts = [[3, 4, 5, 6], [7, 8]]
    made = generate_ids(plugin, model, prompts, 6)
    if decoder == "greedy":
        for prompt, got in zip(prompts, made):
            cont: list[int] = []
            for _ in range(6):
                cont.append(int(full_forward_logits(model, prompt, cont)[-1].argmax()))
            assert got == cont
    else:  # beam: the chosen continuation scores at least as well as greedy's under the full forward
        for prompt, got in zip(prompts, made):
            def score(cont):
                logp = torch.log_softmax(full_forward_logits(model, prompt, cont[:-1]), -1)
                return sum(float(logp[t, tok]) for t, tok in enumerate(cont))
            greedy: list[int] = []
            for _ in range(6):
                greedy.append(int(full_forward_logits(model, prompt, greedy)[-1].argmax()))
            assert len(got) == 6 and score(got) >= score(greedy) - 1e-4


def test_sampling_runs_and_greedy_speculative_decoding_equals_greedy():
    from lmlab.generation.batch import generate_ids
    from lmlab.generation.token_ids import run_decoder
    from lmlab.generation.outputs import Outputs

    model = build("gqa", "learned", seed=4)
    gen = torch.Generator().manual_seed(0)
    made = generate_ids(discovery.load("decoding", "sample")(), model, [[3, 4, 5], [6]], 5, generator=gen)
    assert [len(m) for m in made] == [5, 5] and all(0 <= t < 37 for m in made for t in m)
    spec = discovery.load("decoding", "speculative")
    decoder = spec(spec.Options(draft="a run folder", k=3))
    decoder.prepare(model, {"draft": build("gqa", "learned", seed=5)})  # a different model as the draft
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10]]
    outputs = Outputs(None, [8, 8], eos_id=None)
    with torch.no_grad():
        for _ in run_decoder(decoder, make_engine(model, 2, 20), prompts, outputs):
            pass
    greedy = generate_ids(discovery.load("decoding", "greedy")(), model, prompts, 8)
    assert [list(c.tokens) for c in outputs.completions] == greedy
    assert decoder.stats["proposed"] > 0


# -- from a manifest ----------------------------------------------------------------------------------

ED = '[architecture]\nuse = "encoder-decoder"'


def manifest(tmp_path, tables: str = ED, objective: str = 'use = "sft"', attention: str = "mha") -> str:
    """``tables``: TOML written right after [model]'s own keys (more of them, or tables such as ED)."""
    (tmp_path / "r.jsonl").write_text("".join(
        f'{{"instruction": "Say {w} twice", "output": "{w} {w}"}}\n' for w in
        ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")))
    path = tmp_path / "m.toml"
    path.write_text(f'name = "ed"\n\n[data]\nuse = "alpaca"\npath = "r.jsonl"\nval_fraction = 0.2\n\n'
                    f'[tokenizer]\nuse = "char"\n\n[model]\nn_layers = 1\n'
                    f'd_model = 32\nn_heads = 2\nblock_size = 32\n{tables}\n\n[attention]\nuse = "{attention}"\n\n'
                    f'[objective]\n{objective}\n\n[train]\nmax_steps = 4\nbatch_size = 4\neval_every = 4\n'
                    f'eval_steps = 1\nsample_tokens = 0\n\n[tracker]\nuse = "none"\n')
    return str(path)


@pytest.mark.parametrize("tables, objective, attention, key, says", [
    (ED, 'use = "sft"', "mamba", "attention.use", "has no cross-attention"),
    (ED, 'use = "causal-lm"', "mha", "architecture.use",
     "trains decoder models; architecture 'encoder-decoder' builds encoder-decoder models"),
    ('[architecture]\nuse = "decoder"\nencoder_layers = 2', 'use = "sft"', "mha", "architecture.encoder_layers",
     "it is an option of architecture plugin 'encoder-decoder'"),
    (ED, 'use = "sft"\npacking = true', "mha", "objective.packing", "one record per row"),
    # API 1.18 moved the family and the encoder-decoder's settings out of [model].
    ('architecture = "encoder-decoder"', 'use = "sft"', "mha", "model.architecture",
     'moved to the architecture slot: write [architecture] use'),
    ('encoder_layers = 2', 'use = "sft"', "mha", "model.encoder_layers",
     "moved to the architecture slot: write architecture.encoder_layers"),
], ids=["no-cross-attention", "objective-architecture", "encoder-layers-on-a-decoder", "packing",
        "model-architecture-moved", "model-encoder-layers-moved"])
def test_bad_manifests_are_refused_by_check_naming_the_key(tmp_path, monkeypatch, capsys, tables, objective,
                                                          attention, key, says):
    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path / "cache"))
    assert main(["check", manifest(tmp_path, tables, objective, attention)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lmlab: error: {key}: ") and says in err and err.count("\n") == 1, err


def test_sft_trains_an_encoder_decoder_run_that_generates(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(["run", manifest(tmp_path), "--out", str(tmp_path / "runs")]) == 0
    run = tmp_path / "runs" / "default"
    assert (run / "summary.json").exists()
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "Say one twice\n", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["eval", str(run), "--data", str(tmp_path / "r.jsonl"), "--limit", "4"]) == 0
    assert "exact match" in capsys.readouterr().out
    # lmlab serve: the scheduler batches an encoder-decoder's rows through the same engine.
    import openai

    from lmlab.generation.batch import generate_ids
    from lmlab.serve.service import Service
    from lmlab.trained import load_run
    from test_serve import serving

    service = Service.from_run(run, model_name="ed", max_batch=4)
    prompts = ["Say one twice\n", "Say twelve twice\n"]
    with serving(service) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        # The run decodes greedily ([decoding] default), so the server does: a request sets no temperature.
        served = [client.completions.create(model="ed", prompt=p, max_tokens=6).choices[0].text for p in prompts]
    loaded = load_run(run)
    made = generate_ids(discovery.load("decoding", "greedy")(), loaded.model,
                        [loaded.tokenizer.encode(p) for p in prompts], 6, eos_id=loaded.tokenizer.eos_id)
    assert served == [loaded.tokenizer.decode([t for t in m if t != loaded.tokenizer.eos_id]) for m in made]


def test_a_wholly_padded_encoder_row_gives_finite_outputs():
    model = build()
    enc = torch.randint(0, 37, (2, 5))
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[0] = True  # a record with an empty prompt
    with torch.no_grad():
        out = model(torch.randint(0, 37, (2, 3)), encoder_ids=enc, encoder_padding=padding)
    assert torch.isfinite(out).all()


def test_peft_roles_cover_both_stacks_and_the_cross_attention():
    from lmlab.api import resolve_roles

    names = resolve_roles(build(), ["q"])
    assert names == ["enc_blocks.0.attn.q_proj", "enc_blocks.1.attn.q_proj", "enc_blocks.2.attn.q_proj",
                     "blocks.0.attn.q_proj", "blocks.0.cross.q_proj", "blocks.1.attn.q_proj", "blocks.1.cross.q_proj"]


def test_lora_fine_tunes_an_encoder_decoder_run(tmp_path, monkeypatch):
    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = manifest(tmp_path)
    with open(path, "a") as f:
        f.write('\n[peft]\nuse = "lora"\nr = 2\ntargets = ["q", "v"]\n')
    assert main(["run", path, "--out", str(tmp_path / "runs")]) == 0
    import json
    summary = json.loads((tmp_path / "runs" / "default" / "summary.json").read_text())
    # r = 2 on q and v of 1 encoder + 1 decoder self-attention + 1 cross-attention, d_model 32: 6 × 2 × (32 + 32)
    assert summary["trainable_params"] == 6 * 2 * (32 + 32), summary["trainable_params"]


def test_embeddings_are_shared_or_separate_and_layer_counts_are_per_side():
    shared, separate = build(), build(share_embeddings=False)
    assert shared.enc_emb is shared.tok_emb and separate.enc_emb is not separate.tok_emb
    assert separate.num_params() - shared.num_params() == SHAPE.vocab_size * SHAPE.d_model
    assert (len(shared.enc_blocks), len(shared.blocks)) == (3, SHAPE.n_layers)
    assert shared.enc_position is not shared.position  # each side its own position module
