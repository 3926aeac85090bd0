"""`lmlab compress` end to end on a trained character model: each method against its baseline at the same
budget, the new run folder reloading to the model as compressed, loadable by generate and [init], and
bad input refused in one line before anything is written."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from lmlab.cli.main import main
from support import refused, run_cli

CORPUS = Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt"

pytestmark = pytest.mark.slow

MANIFEST = """
name = "compress-base"
seed = 1337

[data]
use = "text-file"
path = "shakespeare.txt"
val_fraction = 0.1

[model]
n_layers = 4
n_heads = 4
d_model = 128
block_size = 64
bias = false

[position]
use = "rope"

[optimizer]
use = "adamw"
lr = 1e-3
betas = [0.9, 0.99]

[train]
max_steps = 700
batch_size = 16
warmup_steps = 50
eval_every = 700
eval_steps = 4
checkpoint_every = 700
log_every = 100
sample_tokens = 0

[tracker]
use = "none"
"""


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A 4-layer rope model trained for 700 steps on tinyshakespeare (about a minute here)."""
    root = tmp_path_factory.mktemp("compress")
    shutil.copy(CORPUS, root / "shakespeare.txt")
    (root / "base.toml").write_text(MANIFEST)
    assert main(["run", str(root / "base.toml"), "--out", str(root / "runs")]) == 0
    return root / "runs" / "default"


@pytest.fixture(scope="module")
def compressed(base, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """The base run compressed by Wanda with the default calibration, and the windows Wanda was handed.
    A stale ``.partial`` folder (what a kill -9 mid-compress leaves) is planted first: the command
    must replace it."""
    from lmlab import discovery

    out = tmp_path_factory.mktemp("compressed") / "wanda"
    stale = out.with_name("wanda.partial")
    (stale / "checkpoints").mkdir(parents=True)
    (stale / "checkpoints" / "last.ckpt").write_bytes(b"cut short")
    handed = []
    cls = discovery.load("compress", "wanda")
    original = cls.compress
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cls, "compress", lambda self, model, calibration: (
            handed.append(calibration.windows.clone()), original(self, model, calibration))[1])
        compress(base, out, "--use", "wanda")
    assert not stale.exists()
    return out, torch.cat(handed)


def compress(base: Path, out: Path, *args: str) -> dict:
    assert main(["compress", str(base), "--out", str(out), "--calibration-windows", "64", "--timing-rounds", "1",
                 *args]) == 0
    return json.loads((out / "summary.json").read_text())


def test_awq_has_lower_perplexity_than_round_to_nearest_at_the_same_bits_and_group(base, tmp_path):
    # Calibrated on the training split (the default), scored on validation: at 3 bits in groups of 64
    # this small model loses too little to RTN for AWQ's fit to carry over (it did only when it
    # calibrated on the scored text itself); whole rows (128) leave it room. A grid of 10 points rather
    # than the default 20 halves the search: measured, AWQ's margin over RTN is the same (7.1994 and
    # 7.2177 against 7.2053 and 7.2303; 7.1967 and 7.2224 with 20 points).
    for bits, group in ((4, 64), (3, 128)):
        rtn = compress(base, tmp_path / f"rtn{bits}", "--use", "rtn", "--set", f"bits={bits}", "--set", f"group_size={group}")
        awq = compress(base, tmp_path / f"awq{bits}", "--use", "awq", "--set", f"bits={bits}", "--set", f"group_size={group}",
                       "--set", "grid=10")
        assert awq["val_ppl"] < rtn["val_ppl"], (bits, awq["val_ppl"], rtn["val_ppl"])
        assert rtn["val_ppl"] > rtn["base"]["val_ppl"]  # quantising costs something
        assert rtn["disk_bytes"] < 0.5 * rtn["base"]["disk_bytes"]
        assert rtn["params"] == awq["params"] == rtn["base"]["params"]  # the weights the codes stand for


@pytest.mark.parametrize("compare, split", [("layer", "train"), ("row", "val")])
def test_wanda_has_lower_perplexity_than_magnitude_at_half_sparsity(base, tmp_path, compare, split):
    """The same weights compared (per layer, or per output row), scored by |W|·‖X‖ or by |W| alone;
    Wanda's input norms from either split of the run."""
    wanda = compress(base, tmp_path / "wanda", "--use", "wanda", "--set", "sparsity=0.5", "--set", f"compare={compare}",
                     "--calibration-split", split)
    assert wanda["calibration"]["from"] == f"the run's {'training' if split == 'train' else 'validation'} split"
    magnitude = compress(base, tmp_path / "magnitude", "--use", "magnitude", "--set", "sparsity=0.5",
                         "--set", f"compare={compare}")
    assert wanda["val_ppl"] < magnitude["val_ppl"], (wanda["val_ppl"], magnitude["val_ppl"])
    assert wanda["compress"][0]["sparsity"] == pytest.approx(0.5, abs=0.01)


def test_gradient_head_importance_beats_random_heads_at_the_same_count(base, tmp_path):
    pruned = compress(base, tmp_path / "grad", "--use", "head-prune", "--set", "heads=4")
    randoms = [compress(base, tmp_path / f"random{seed}", "--use", "head-prune", "--set", "heads=4",
                        "--set", "importance=random", "--set", f"seed={seed}")["val_ppl"] for seed in range(3)]
    assert pruned["val_ppl"] < sum(randoms) / len(randoms), (pruned["val_ppl"], randoms)
    assert pruned["params"] < pruned["base"]["params"] and pruned["memory_bytes"] < pruned["base"]["memory_bytes"]


def _logits(run_dir: Path, windows: torch.Tensor) -> torch.Tensor:
    from lmlab.trained import load_run

    with torch.no_grad():
        return load_run(run_dir).model(windows)


@pytest.mark.parametrize("chain", [["head-prune", "awq"], ["wanda", "nf4"], ["int8"]])
def test_a_compressed_run_reloads_to_the_model_as_compressed(base, tmp_path, chain):
    """The plugins applied here to the loaded run, with the calibration the command draws, give the
    same logits as the run folder the command wrote, loaded back."""
    from lmlab.compress import calibration as calib
    from lmlab.compress.methods import resolve
    from lmlab.prepare.tokens import load_tokens
    from lmlab.trained import load_run

    # Reloading is what is checked, not the search's quality: AWQ's search over two points costs a
    # tenth of its default twenty.
    sets = (["head-prune.heads=4"] if "head-prune" in chain else []) + (["awq.grid=2"] if "awq" in chain else [])
    out = tmp_path / "out"
    compress(base, out, *[a for m in chain for a in ("--use", m)], *[a for s in sets for a in ("--set", s)])
    run = load_run(base)
    tokens = load_tokens(run.variant, tokenizer=run.tokenizer)
    calibration = calib.from_tokens(tokens.train, 64, 64, 0, "cpu")
    with torch.no_grad():
        for method in resolve(chain, sets, tmp_path):
            method.plugin.compress(run.model, calibration if method.plugin.calibrated else None)
        expected = run.model.eval()(calibration.windows[:4, :-1])
    assert torch.equal(_logits(out, calibration.windows[:4, :-1]), expected)
    summary = json.loads((out / "summary.json").read_text())
    assert [m["plugin"] for m in summary["compress"]] == chain
    assert {"val_loss", "val_ppl", "disk_bytes", "memory_bytes", "tokens_per_s", "base", "plugins"} <= set(summary)
    assert summary["status"] == "completed"
    assert summary["generation"]["decoder"] == "greedy"  # the run's decoding plugin timed the speed


def test_a_compressed_run_generates_and_fine_tunes_from_init(base, tmp_path, capsys):
    out = tmp_path / "pruned"
    compress(base, out, "--use", "head-prune", "--use", "rtn", "--set", "head-prune.heads=4")
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")
    fine_tune = MANIFEST.replace('name = "compress-base"', 'name = "from-compressed"').replace(
        "max_steps = 700", "max_steps = 4").replace("eval_every = 700", "eval_every = 4").replace(
        "checkpoint_every = 700", "checkpoint_every = 4") + f'\n[init]\nfrom = "{out}"\n'
    (base.parent.parent / "tune.toml").write_text(fine_tune)
    assert main(["run", str(base.parent.parent / "tune.toml"), "--out", str(tmp_path / "tuned")]) == 0
    tuned = tmp_path / "tuned" / "default"
    assert main(["generate", str(tuned), "--prompt", "ROMEO:", "--max-new-tokens", "5"]) == 0
    from lmlab.trained import load_run

    heads = [b.attn.n_heads for b in load_run(tuned).model.blocks]
    assert sum(heads) == 16 - 4


@pytest.mark.parametrize("args, key", [
    (["--use", "wanda", "--set", "pattern=4:4"], "compress.wanda.pattern"),
    (["--use", "wanda", "--set", "pattern=5:4"], "compress.wanda.pattern"),
    (["--use", "head-prune", "--set", "heads=16"], "compress.head-prune.heads"),
    (["--use", "rtn", "--set", "group_size=48"], "compress.rtn.group_size"),
    (["--use", "no-such-method"], "--use"),
    (["--use", "rtn", "--set", "awq.bits=3"], "compress.awq.bits"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(base, tmp_path, capsys, args, key):
    out = tmp_path / "out"
    assert main(["compress", str(base), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err, err
    assert not out.exists() and not out.with_name("out.partial").exists()


def test_without_calibration_data_a_calibrated_method_is_refused(base, tmp_path, capsys, monkeypatch):
    """The run's data file is gone and the token cache is empty: AWQ has nothing to calibrate on, and
    the compressed run nothing to be scored on."""
    moved = tmp_path / "run"
    shutil.copytree(base, moved)
    manifest = (moved / "manifest.toml").read_text()
    (moved / "manifest.toml").write_text(manifest.replace(str(base.parent.parent / "shakespeare.txt"),
                                                          str(tmp_path / "gone.txt")))
    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path / "empty-cache"))
    assert main(["compress", str(moved), "--use", "awq", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lmlab: error: data.path:") and "--calibration" in err, err
    assert not (tmp_path / "out").exists()


def test_an_existing_output_folder_is_left_alone(base, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["compress", str(base), "--use", "rtn", "--out", str(out)]) == 2
    assert (out / "keep.txt").read_text() == "mine"


def test_a_lora_run_is_merged_then_compressed_into_a_plain_run(base, tmp_path):
    """Compressing a PEFT run folds the adapter into the base first, as lmlab merge does: the new folder
    is a plain run, scored against the adapted model."""
    tune = MANIFEST.replace("max_steps = 700", "max_steps = 20").replace("eval_every = 700", "eval_every = 20").replace(
        "checkpoint_every = 700", "checkpoint_every = 20") + \
        f'\n[init]\nfrom = "{base}"\n\n[peft]\nuse = "lora"\nr = 4\nalpha = 8\ntargets = ["q", "v"]\n'
    (tmp_path / "lora.toml").write_text(tune)
    shutil.copy(CORPUS, tmp_path / "shakespeare.txt")
    assert main(["run", str(tmp_path / "lora.toml"), "--out", str(tmp_path / "runs")]) == 0
    lora = tmp_path / "runs" / "default"
    summary = compress(lora, tmp_path / "out", "--use", "rtn")
    assert summary["merged_peft"] == "lora"
    trained = json.loads((lora / "summary.json").read_text())
    assert summary["base"]["val_loss"] == pytest.approx(trained["val_loss"], abs=1e-5)  # the adapted model's
    assert "peft" not in (tmp_path / "out" / "manifest.toml").read_text()
    assert summary["val_ppl"] > summary["base"]["val_ppl"]


def test_the_default_calibration_is_training_text_never_the_scored_validation_text(base, compressed):
    """The summary's perplexity is the validation split's: a calibrated method must not have seen it."""
    import numpy as np

    from lmlab.compress import calibration as calib
    from lmlab.prepare.tokens import load_tokens
    from lmlab.trained import load_run

    out, windows = compressed
    run = load_run(base)
    tokens = load_tokens(run.variant, tokenizer=run.tokenizer)
    assert windows.shape == (64, 65)
    assert torch.equal(windows, calib.from_tokens(tokens.train, 64, 64, 0, "cpu").windows)
    val = np.lib.stride_tricks.sliding_window_view(np.asarray(tokens.val, dtype=np.uint16), windows.shape[1])
    seen = set(map(bytes, np.ascontiguousarray(val)))
    assert not [row for row in windows.numpy().astype(np.uint16) if bytes(row) in seen]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["calibration"]["split"] == "train" and summary["calibration"]["file"] is None
    assert summary["calibration"]["windows"] == 64


def test_a_half_written_compressed_folder_is_refused_by_every_loader(compressed, tmp_path):
    """What a kill -9 mid-compress leaves (the .partial folder), or a compressed folder without its
    completion marker (summary.json), is never loaded: one line naming the folder, exit 2."""
    from lmlab.errors import UserError
    from lmlab.pretrained import locate

    out, _ = compressed
    partial = tmp_path / "wanda.partial"
    shutil.copytree(out, partial)
    unmarked = tmp_path / "unmarked"
    shutil.copytree(out, unmarked)
    (unmarked / "summary.json").unlink()
    assert "interrupted lmlab compress" in refused(run_cli("generate", str(partial), "--prompt", "RO"), str(partial))
    for verb, args in (("generate", ("--prompt", "RO")), ("eval", ("--data", str(out / "manifest.toml"))),
                       ("serve", ("--port", "0"))):
        refused(run_cli(verb, str(unmarked), *args, timeout=120), str(unmarked))
    with pytest.raises(UserError, match="did not finish"):
        locate(unmarked)
    assert main(["generate", str(out), "--prompt", "RO", "--max-new-tokens", "2"]) == 0  # the whole one loads


def test_an_interrupted_compression_leaves_no_partial_folder(base, tmp_path, monkeypatch, capsys):
    """Ctrl-C (or SIGTERM) once the new folder is being written: it is removed, exit 130."""
    from lmlab.compress import measure

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(measure, "generation_speed", interrupt)
    out = tmp_path / "out"
    assert main(["compress", str(base), "--use", "rtn", "--out", str(out)]) == 130
    assert not out.exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("case", ["out-is-a-file", "cuda-without-a-gpu", "no-such-device", "already-compressed",
                                  "calibration-the-tokenizer-cannot-encode"])
def test_bad_options_are_one_line_naming_them_exit_2_as_a_user_runs_them(base, compressed, tmp_path, case):
    out = tmp_path / "out"
    (tmp_path / "a-file").write_text("mine")
    (tmp_path / "snow.txt").write_text("a snowman: \u2603 " * 200)
    run, args, key = {
        "out-is-a-file": (base, ["--out", str(tmp_path / "a-file")], "--out"),
        "cuda-without-a-gpu": (base, ["--device", "cuda"], "--device"),
        "no-such-device": (base, ["--device", "banana"], "--device"),
        "already-compressed": (compressed[0], [], str(compressed[0])),
        "calibration-the-tokenizer-cannot-encode": (base, ["--use", "awq", "--calibration", str(tmp_path / "snow.txt")],
                                                    str(tmp_path / "snow.txt")),
    }[case]
    args = args if "--use" in args else ["--use", "rtn", *args]
    args = args if "--out" in args else [*args, "--out", str(out)]
    refused(run_cli("compress", str(run), *args, env={"CUDA_VISIBLE_DEVICES": ""}), key)
    assert not out.exists() and not (tmp_path / "out.partial").exists()
    assert (tmp_path / "a-file").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "snow.txt"]


def test_an_encoder_decoder_run_is_refused_naming_the_run(tmp_path):
    """Its forward needs the encoder's ids, which calibration windows do not hold (a 2-step run: the
    refusal comes before anything is measured)."""
    (tmp_path / "t.txt").write_text(CORPUS.read_text()[:20_000])
    (tmp_path / "ed.toml").write_text(
        'name = "ed"\n[data]\nuse = "text-file"\npath = "t.txt"\nval_fraction = 0.2\n[tokenizer]\nuse = "char"\n'
        '[model]\nn_layers = 1\nd_model = 32\nn_heads = 2\nblock_size = 32\n[architecture]\nuse = "encoder-decoder"\n'
        '[objective]\nuse = "span-corruption"\n[train]\nmax_steps = 2\nbatch_size = 4\neval_every = 2\n'
        'eval_steps = 1\nsample_tokens = 0\n[tracker]\nuse = "none"\n')
    assert main(["run", str(tmp_path / "ed.toml"), "--out", str(tmp_path / "runs")]) == 0
    run = tmp_path / "runs" / "default"
    out = tmp_path / "out"
    line = refused(run_cli("compress", str(run), "--use", "rtn", "--out", str(out)), str(run))
    assert "encoder-decoder" in line
    assert not out.exists() and not (tmp_path / "out.partial").exists()
