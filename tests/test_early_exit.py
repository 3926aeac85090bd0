"""Early exit, the decoder architecture's options (``exit_layers``, ``exit_loss_weight``,
``train_only_exits``, ``exit_threshold``; lmlab_architectures.early_exit): light exit heads trained
with the main loss or on a frozen model, and an engine that leaves at the first confident head, which
any one-token-per-step decoder drives. Threshold 1.0 is the full model, token for token
and logit for logit; threshold 0.0 is the model cut after the first exit; in between, a trained
model leaves earlier as the threshold falls."""

import random
from pathlib import Path

import pytest
import torch

from conftest import tiny_toml
from lmlab import discovery
from lmlab.api import MixerContext, ModelShape, UserError
from lmlab.cli.main import main
from lmlab.generation.batch import generate_texts
from lmlab.generation.token_ids import run_decoder
from lmlab.generation.engine import make_engine
from lmlab.generation.outputs import Outputs
from lmlab.model import LanguageModel, compute_loss
from lmlab.trained import load_run
from lmlab_architectures.early_exit import EarlyExitEngine, EarlyExitRow, ExitStack, teacher_forced
from support import refused, run_cli

SHAPE = ModelShape(n_layers=4, d_model=32, n_heads=4, block_size=64, vocab_size=29)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def model_with(exit_layers=(0, 2), position: str = "rope", seed: int = 0, sharpen: float = 25) -> LanguageModel:
    torch.manual_seed(seed)
    parts = dict(position=discovery.load("position", position)(), attention=discovery.load("attention", "gqa")(),
                 ffn=discovery.load("ffn", "mlp")(), tie_embeddings=False)
    model = ExitStack(SHAPE, exit_layers=exit_layers, **parts) if exit_layers else LanguageModel(SHAPE, **parts)
    # An untrained model's logits are nearly flat: sharpened, every greedy choice is clear, and the
    # exit heads' confidences spread over (0, 1).
    with torch.no_grad():
        model.head.weight.mul_(sharpen)
        for norm in getattr(model, "exit_heads", {}).values():
            norm.weight.uniform_(0.5, 1.5)
    return model.eval()


def decoder(name: str, **options):
    cls = discovery.load("decoding", name)
    return cls(cls.Options(**options))


def through_engine(model, dec, prompts, n, seed=None):
    """The decoder's own path: the engine, every prompt a row."""
    engine = make_engine(model, len(prompts), max(map(len, prompts)) + n)
    outputs = Outputs(None, [n] * len(prompts))
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    with torch.inference_mode():
        for _ in run_decoder(dec, engine, prompts, outputs, generator):
            pass
    return [c.tokens for c in outputs.completions]


def with_exits(model, dec, prompts, n, threshold, seed=None):
    """The decoder through early exit's engine, every prompt a row."""
    engine = EarlyExitEngine(model, len(prompts), max(map(len, prompts)) + n, threshold)
    outputs = Outputs(None, [n] * len(prompts))
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    with torch.inference_mode():
        for _ in run_decoder(dec, engine, prompts, outputs, generator):
            pass
    return [c.tokens for c in outputs.completions], engine.stats


# -- the model ------------------------------------------------------------------------------------------

def test_exit_heads_add_only_their_norms_and_a_model_without_them_is_unchanged():
    plain, exits = model_with(()), model_with((0, 2))
    assert not hasattr(plain, "exit_heads") and "exit_heads" not in str(plain) and plain.extra_heads == ()
    added = set(exits.state_dict()) - set(plain.state_dict())
    assert added == {"exit_heads.0.weight", "exit_heads.2.weight"}  # a norm each, the head is shared
    assert set(plain.state_dict()) <= set(exits.state_dict())
    idx = torch.randint(0, SHAPE.vocab_size, (2, 12))
    with torch.no_grad():
        logits, exit_logits = exits(idx, extras=True)
        torch.testing.assert_close(logits, exits(idx), rtol=0, atol=0)
        # Exit 0's logits are the tied head over block 0's output, through exit 0's own norm.
        hidden = exits.position.embed(exits.tok_emb(idx), torch.arange(12))
        hidden = exits.blocks[0](hidden, MixerContext(position=exits.position, positions=torch.arange(12)))
        torch.testing.assert_close(exit_logits[0], exits.head(exits.exit_heads["0"](hidden)))
    assert len(exit_logits) == 2


def test_the_loss_adds_the_weighted_mean_of_the_exit_losses_and_reports_the_heads_alone():
    model = model_with((0, 2)).train()
    objective = discovery.load("objective", "causal-lm")()
    windows = torch.randint(0, SHAPE.vocab_size, (3, 17))
    batch = objective.make_batch(windows)
    model.extra_loss_weight = 0.5  # architecture.exit_loss_weight
    out = compute_loss(model, objective, batch)
    logits, exit_logits = model(batch.input_ids, extras=True)
    ce = [objective.loss(x, batch) for x in exit_logits]
    torch.testing.assert_close(out.loss, objective.loss(logits, batch))
    torch.testing.assert_close(out.extras, torch.stack(ce))
    torch.testing.assert_close(out.total, out.loss + 0.5 * (ce[0] + ce[1]) / 2)
    out.total.backward()
    assert model.exit_heads["0"].weight.grad.abs().sum() > 0


# -- decoding -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("position", ["rope", "learned"])
def test_threshold_one_gives_the_full_models_tokens_and_logits(position):
    model = model_with(position=position)
    # The full model as the plain KV-cache loop runs it: prefill, then one token per forward.
    with torch.inference_mode():
        cache = model.new_cache(1, 40)
        logits = model(torch.tensor([PROMPT]), cache=cache)[0, -1]
        full_tokens, full_logits = [], []
        for _ in range(24):
            full_logits.append(logits.float())
            full_tokens.append(int(logits.argmax()))
            logits = model(torch.tensor([[full_tokens[-1]]]), cache=cache)[0, -1]
        row = EarlyExitRow(model, 1.0, 40)
        logits, layer = row.start(PROMPT)
        for t in range(24):
            assert torch.equal(logits, full_logits[t]) and layer == SHAPE.n_layers
            logits, layer = row.step(full_tokens[t])
    (tokens,), stats = with_exits(model, decoder("greedy"), [PROMPT], 24, 1.0)
    assert tokens == full_tokens == through_engine(model, decoder("greedy"), [PROMPT], 24)[0]
    assert stats.mean == SHAPE.n_layers and stats.tokens == 24


def test_threshold_one_samples_what_the_sample_decoder_samples_with_the_same_seed():
    model = model_with(sharpen=5)  # flatter: draws that differ
    options = dict(temperature=1.5, top_k=12)
    sampled = through_engine(model, decoder("sample", **options), [PROMPT], 30, seed=7)
    (tokens,), _ = with_exits(model, decoder("sample", **options), [PROMPT], 30, 1.0, seed=7)
    assert tokens == sampled[0]
    (other,), _ = with_exits(model, decoder("sample", **options), [PROMPT], 30, 1.0, seed=8)
    assert other != tokens  # the seed does decide


@torch.inference_mode()
def truncated_greedy(model, first_exit: int, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding of blocks 0..first_exit and that exit head, built as a model of its own."""
    shape = ModelShape(**{**SHAPE.__dict__, "n_layers": first_exit + 1})
    cut = LanguageModel(shape, position=discovery.load("position", "rope")(),
                        attention=discovery.load("attention", "gqa")(), ffn=discovery.load("ffn", "mlp")(),
                        tie_embeddings=False).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(("exit_heads.", "norm_f."))
             and not (k.startswith("blocks.") and int(k.split(".")[1]) > first_exit)}
    state.update({f"norm_f.{k}": v for k, v in model.exit_heads[str(first_exit)].state_dict().items()})
    cut.load_state_dict(state, strict=True)
    cache = cut.new_cache(1, len(prompt) + n)
    logits = cut(torch.tensor([prompt]), cache=cache)[0, -1]
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = cut(torch.tensor([[out[-1]]]), cache=cache)[0, -1]
    return out


def test_threshold_zero_leaves_every_token_at_the_first_exit_as_the_cut_model_decodes():
    model = model_with((1, 2))
    (tokens,), stats = with_exits(model, decoder("greedy"), [PROMPT], 24, 0.0)
    assert stats.mean == 2.0  # every token: blocks 0 and 1
    assert tokens == truncated_greedy(model, 1, PROMPT, 24)
    assert tokens != through_engine(model, decoder("greedy"), [PROMPT], 24)[0]  # not what the full model says


@pytest.mark.parametrize("propagate", ["copy", "exact"])
def test_skipped_blocks_catch_up_in_one_chunk_with_the_states_propagation_gives(propagate):
    # Tokens leave at different depths; each block's cache must hold every position before the
    # current one, and "exact" must leave the keys and values the full model gives the same tokens.
    model = model_with((0, 1, 2))
    ids = torch.randint(0, SHAPE.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        row = EarlyExitRow(model, 0.6, 64, propagate)
        row.start(ids[:4])
        layers = [row.step(t)[1] for t in ids[4:]]
        assert len(set(layers)) > 2  # the test needs several depths
        assert all(length <= len(ids) for length in row.lengths) and row.lengths[0] == len(ids)
        pending = len(ids) - row.lengths[-1]  # positions the last block has not seen yet
        assert pending > 1
        # One more token that goes through every block (threshold 1): the last block takes the
        # positions it lacks and the token in one chunk.
        row.exits = {}
        logits, layer = row.step(7)
        assert layer == SHAPE.n_layers and row.lengths == [len(ids) + 1] * SHAPE.n_layers
        full = model(torch.tensor([ids + [7]]))[0, -1]
    if propagate == "exact":
        torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)
    else:
        assert not torch.allclose(logits, full, rtol=1e-4, atol=1e-4)  # copied states are an approximation


def test_a_sequence_past_the_context_restarts_from_its_recent_tokens():
    model = model_with(position="learned")
    assert model.max_context == SHAPE.block_size
    tokens, _ = with_exits(model, decoder("greedy"), [PROMPT], 80, 1.0)
    assert tokens == through_engine(model, decoder("greedy"), [PROMPT], 80)


def test_several_prompts_decode_as_each_alone_and_rows_are_reused():
    model = model_with((0, 2))
    prompts = [PROMPT, PROMPT[:3], [7, 7, 2, 1, 8]]
    together, _ = with_exits(model, decoder("greedy"), prompts, 12, 0.6)
    assert together == [with_exits(model, decoder("greedy"), [p], 12, 0.6)[0][0] for p in prompts]
    engine = EarlyExitEngine(model, 2, 20, 0.6)
    rows, logits = engine.add([PROMPT, PROMPT[:3]])
    assert rows == [0, 1] and logits.shape == (2, SHAPE.vocab_size)
    engine.release([0])
    assert engine.add([[1, 2]])[0] == [0] and engine.length(0) == 2


def test_refused_decoders_and_models_name_the_threshold():
    with pytest.raises(UserError) as exc:  # beam search forks rows, which per-row early exit cannot
        with_exits(model_with(), decoder("beam", width=2), [PROMPT], 4, 0.9)
    assert exc.value.key == "architecture.exit_threshold"
    with pytest.raises(UserError) as exc:
        EarlyExitEngine(model_with(()), 1, 32, 0.9)
    assert exc.value.key == "architecture.exit_threshold" and "architecture.exit_layers" in exc.value.message


# -- training and lmlab generate -------------------------------------------------------------------------

WORDS = "apple banana cherry damson elder fig grape huckleberry kiwi lemon mango nectarine".split()


def train_words(root: Path, name: str, steps: int, architecture: str = "", extra: str = "") -> Path:
    """Train a 3-layer model (d_model 32, block 32) through the CLI on a corpus of random fruit names
    (easy letters inside a word, hard ones at its start: a model of a few dozen steps already has
    tokens to leave early on); its run folder. ``architecture``: lines of the decoder's table."""
    corpus = root / "words.txt"
    if not corpus.exists():
        r = random.Random(0)
        corpus.write_text(" ".join(r.choice(WORDS) for _ in range(9000)))
    manifest = tiny_toml("words.txt", name=name, steps=steps, batch_size=8, eval_every=steps, checkpoint_every=steps,
                         sample_tokens=0)
    manifest = manifest.replace("n_layers = 2", "n_layers = 3").replace("block_size = 16", "block_size = 32")
    manifest += f'\n[architecture]\nuse = "decoder"\n{architecture}\n'
    manifest += f'\n[optimizer]\nuse = "adamw"\nlr = 1e-2\n\n[decoding]\nuse = "greedy"\n{extra}'
    (root / f"{name}.toml").write_text(manifest)
    done = run_cli("run", str(root / f"{name}.toml"), "--out", str(root / name),
                   env={"LMLAB_CACHE": str(root / "cache")})
    assert done.returncode == 0, done.stderr[-2000:]
    return root / name / "default"


@pytest.fixture(scope="module")
def words(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("early-exit")


@pytest.fixture(scope="module")
def exit_run(words) -> Path:
    """80 steps from scratch with exits after blocks 0 and 1, trained with the main loss."""
    return train_words(words, "joint", 80, architecture="exit_layers = [0, 1]")


def exit_losses(model, text_ids: list[int], block: int) -> torch.Tensor:
    """Each exit head's cross-entropy, then the output head's, over windows of ``text_ids``."""
    n = (len(text_ids) - 1) // block
    ids = torch.tensor(text_ids[:n * block + 1])
    x, y = ids[:-1].view(n, block), ids[1:].view(n, block)
    with torch.no_grad():
        logits, exits = model(x, extras=True)
    return torch.stack([torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
                        for out in [*exits, logits]])


def held_out(run, words: Path) -> list[int]:
    return list(run.tokenizer.encode((words / "words.txt").read_text()[-4000:]))


def test_exit_losses_train_the_heads_and_lower_thresholds_leave_earlier(exit_run, words):
    run = load_run(exit_run)
    val = held_out(run, words)
    trained = exit_losses(run.model, val, 32)
    torch.manual_seed(1)
    run.model.reset_parameters()
    fresh = exit_losses(run.model, val, 32)
    assert (trained < fresh - 1.0).all(), (trained, fresh)  # every exit learned, not only the head

    means = []
    for threshold in (1.0, 0.9, 0.5, 0.0):
        run = load_run(exit_run, [f"architecture.exit_threshold={threshold}"])
        result = generate_texts(run.model, run.tokenizer, run.plugins["decoding"], ["apple ", "kiwi lem"], 60)
        means.append(float(result.note.split("average exit layer ")[1].split()[0]))
    assert means[0] == 3.0 and means[-1] == 1.0
    assert means == sorted(means, reverse=True) and means[1] > means[2] > means[3], means
    # Teacher-forced, the exits cost little: threshold 0.9's perplexity within 10 % of the full model's.
    full, _ = teacher_forced(run.model, val[:200], 1.0)
    early, layers = teacher_forced(run.model, val[:200], 0.9)
    assert sum(layers) / len(layers) < 3.0
    assert early.mean().exp() < 1.1 * full.mean().exp()


def test_generate_prints_the_average_exit_layer(exit_run, capsys):
    assert main(["generate", str(exit_run), "--prompt", "apple ", "--max-new-tokens", "20",
                 "--set", "architecture.exit_threshold=0"]) == 0
    assert "average exit layer 1.00 of 3" in capsys.readouterr().err
    assert main(["generate", str(exit_run), "--prompt", "apple ", "--max-new-tokens", "20",
                 "--set", "architecture.exit_threshold=1"]) == 0
    captured = capsys.readouterr()
    assert "average exit layer 3.00 of 3" in captured.err
    assert main(["generate", str(exit_run), "--prompt", "apple ", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out == captured.out  # threshold 1 is the model's own text


def test_the_summary_reports_each_exits_validation_loss_and_serve_decodes_through_the_exits(exit_run):
    import json

    from lmlab.serve.service import Service

    summary = json.loads((exit_run / "summary.json").read_text())
    losses = summary["val_exit_losses"]
    assert list(losses) == ["0", "1"]
    assert losses["0"] > losses["1"] > summary["val_loss"]  # deeper exits predict better
    import httpx

    from test_serve import serving

    # Served through the exits: a greedy completion is what lmlab generate gives at the same threshold.
    run = load_run(exit_run, ["architecture.exit_threshold=0.5"])
    expected = generate_texts(run.model, run.tokenizer, run.plugins["decoding"], ["kiwi lem"], 16)
    service = Service.from_run(exit_run, overrides=["architecture.exit_threshold=0.5"])
    assert isinstance(service.scheduler.engine, EarlyExitEngine)
    with serving(service) as url:
        body = {"model": service.model_id, "prompt": "kiwi lem", "max_tokens": 16}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert answer["choices"][0]["text"] == expected.outputs.completions[0].text
    assert service.scheduler.engine.stats.mean < 3.0  # tokens did leave early
    with pytest.raises(UserError) as refused_:  # the older spelling names where it went
        Service.from_run(exit_run, overrides=["decoding.exit_threshold=0.9"])
    assert refused_.value.key == "decoding.exit_threshold" and "architecture.exit_threshold" in refused_.value.message


@pytest.mark.slow
def test_train_only_exit_heads_on_a_trained_run_freezes_everything_else(words):
    from lmlab.checkpoint import model_state

    base = train_words(words, "base", 80)  # no exit heads
    frozen = train_words(words, "frozen", 30, architecture="exit_layers = [0, 1]\ntrain_only_exits = true",
                         extra=f'\n[init]\nfrom = "{base}"\n')
    before, _ = model_state(base / "checkpoints" / "best.ckpt")
    after, _ = model_state(frozen / "checkpoints" / "last.ckpt")
    assert set(after) - set(before) == {"exit_heads.0.weight", "exit_heads.1.weight"}
    for name, value in before.items():
        assert torch.equal(after[name], value), name  # frozen, bit for bit
    run = load_run(frozen)
    val = held_out(run, words)
    trained = exit_losses(run.model, val, 32)
    with torch.no_grad():  # where they started: copies of the final norm (load_state gives them)
        for norm in run.model.exit_heads.values():
            norm.weight.copy_(before["norm_f.weight"])
    start = exit_losses(run.model, val, 32)
    assert (trained[:2] < start[:2] - 0.02).all(), (trained, start)  # a norm's gains alone: a modest gain
    assert trained[2] == start[2]  # the output head's untouched


# -- bad input ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layers", ["[1]", "[-1]", "[0, 0]"])
def test_exit_layers_outside_the_model_or_repeated_are_refused(tiny_manifest, layers, capsys):
    # The tiny model has 2 blocks: only block 0 can hold an exit (block 1's is the model's head).
    assert main(["check", str(tiny_manifest()), "--set", f"architecture.exit_layers={layers}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmlab: error: architecture.exit_layers:"), lines


def test_exit_layers_out_of_range_stop_lmlab_run_before_training(tiny_manifest, tmp_path):
    refused(run_cli("run", str(tiny_manifest()), "--out", str(tmp_path / "out"), "--set",
                    "architecture.exit_layers=[5]"), "architecture.exit_layers")
    assert not (tmp_path / "out" / "default" / "checkpoints").exists()


def test_a_threshold_without_exit_heads_is_refused_by_lmlab_check(tiny_manifest, capsys):
    assert main(["check", str(tiny_manifest()), "--set", "architecture.exit_threshold=0.8"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmlab: error: architecture.exit_threshold:"), lines
    assert "architecture.exit_layers" in lines[0]
    assert main(["check", str(tiny_manifest()), "--set", "architecture.exit_threshold=0.8",
                 "--set", "architecture.exit_layers=[0]"]) == 0
    assert main(["check", str(tiny_manifest()), "--set", "architecture.exit_threshold=0.8",
                 "--set", "architecture.exit_layers=[0]", "--set", "decoding.use=beam"]) == 2
    assert "architecture.exit_threshold: early exit decodes one token per step" in capsys.readouterr().err


def test_train_only_without_exit_heads_is_refused(tiny_manifest, tmp_path):
    refused(run_cli("run", str(tiny_manifest()), "--out", str(tmp_path / "out"), "--set",
                    "architecture.train_only_exits=true"), "architecture.train_only_exits")


@pytest.mark.parametrize("key, value, moved", [
    ("model.exit_layers", "[0]", "architecture.exit_layers = [0]"),
    ("train.exit_loss_weight", "0.5", "architecture.exit_loss_weight = 0.5"),
    ("train.train_only", "exit_heads", "architecture.train_only_exits = true"),
    ("decoding.exit_threshold", "0.9", "architecture.exit_threshold = 0.9"),
])
def test_the_older_spellings_are_refused_naming_the_architecture_option(tiny_manifest, capsys, key, value, moved):
    assert main(["check", str(tiny_manifest()), "--set", f"{key}={value}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lmlab: error: {key}:") and moved in lines[0], lines


def test_a_run_recorded_with_the_older_spellings_reads_as_the_architectures_options():
    from lmlab.upgrade import upgrade_recorded

    recorded = {"model": {"n_layers": 3, "exit_layers": [0, 1]}, "architecture": {"use": "decoder"},
                "train": {"exit_loss_weight": 0.5, "train_only": "exit_heads"}, "decoding": {"use": "greedy"}}
    now = upgrade_recorded(recorded)
    assert now["architecture"] == {"use": "decoder", "exit_layers": [0, 1], "exit_loss_weight": 0.5,
                                   "train_only_exits": True}
    assert now["model"] == {"n_layers": 3} and now["train"] == {} and now["decoding"] == {"use": "greedy"}
    plain = upgrade_recorded({"model": {"exit_layers": []}, "architecture": {"use": "decoder"},
                              "train": {"exit_loss_weight": 1.0}})
    assert plain == {"model": {}, "architecture": {"use": "decoder"}, "train": {}}


@pytest.mark.parametrize("args", [
    ["--set", "architecture.exit_threshold=1.5"],  # outside [0, 1]
    ["--set", "architecture.exit_threshold=0.9"],  # the run has no exit heads
    ["--set", "decoding.use=beam", "--set", "architecture.exit_threshold=0.9"],
])
def test_a_bad_threshold_is_one_line_naming_it(trained_run, args, capsys):
    assert main(["generate", str(trained_run), "--prompt", "a", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmlab: error: architecture.exit_threshold:"), captured.err
