"""API 1.10 in the core: objectives that run the model themselves, add heads to it, work with other run
folders and report figures (the reward model and DPO of lmlab-objectives drive it end to end)."""

import json
import textwrap
from pathlib import Path

import pytest
import torch

from support import ROOT, refused, run_cli

HELD_OUT = ROOT / "data" / "shakespeare-prefs" / "heldout.jsonl.gz"

BASE = """\
name = "base"
seed = 1
[data]
use = "text-file"
path = "{text}"
[tokenizer]
use = "char"
[model]
n_layers = 1
n_heads = 2
d_model = 32
block_size = 128
[optimizer]
use = "adamw"
lr = 3e-3
[train]
max_steps = 6
batch_size = 4
eval_every = 6
eval_steps = 1
sample_tokens = 0
[tracker]
use = "none"
"""

PAIRS = """\
name = "{name}"
seed = 1
[init]
from = "{init}"
[data]
use = "preferences"
path = "{data}"
response_end = "\\n"
val_fraction = 0.1
[objective]
use = "{objective}"
{options}
[optimizer]
use = "adamw"
lr = 1e-3
[train]
max_steps = 4
batch_size = 8
eval_every = 4
eval_steps = 2
sample_tokens = 0
[tracker]
use = "none"
"""


def write(path: Path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny base run, a reward model and a DPO run from it, on the shipped held-out pairs."""
    root = tmp_path_factory.mktemp("alignment")
    text = ROOT / "data" / "tinyshakespeare.txt"  # the whole of it: the pairs use its every character
    out = {}
    for name, manifest in [
        ("base", BASE.format(text=text)),
        ("rm", PAIRS.format(name="rm", init=root / "runs" / "base" / "default", data=HELD_OUT, objective="reward-model",
                            options="")),
        ("dpo", PAIRS.format(name="dpo", init=root / "runs" / "base" / "default", data=HELD_OUT, objective="dpo",
                             options="beta = 0.1")),
    ]:
        result = run_cli("run", write(root / f"{name}.toml", manifest), "--out", str(root / "runs" / name))
        assert result.returncode == 0, result.stderr[-3000:]
        out[name] = root / "runs" / name / "default"
    out["root"] = root
    return out


def test_a_head_is_trained_saved_and_loaded_with_the_run(runs):
    from lmlab.checkpoint import load, state_of
    from lmlab.trained import load_run

    run = load_run(runs["rm"])
    saved = state_of(load(run.checkpoint))
    assert set(run.model.heads) == {"reward"}
    for name, value in run.model.heads.state_dict().items():
        assert torch.equal(value, saved[f"heads.{name}"])
    base = state_of(load(load_run(runs["base"]).checkpoint))
    assert not any(k.startswith("heads.") for k in base)  # a model without an objective head is unchanged


def test_reported_figures_reach_metrics_and_summary(runs):
    summary = json.loads((runs["rm"] / "summary.json").read_text())
    assert 0.0 <= summary["val_accuracy"] <= 1.0 and "val_margin" in summary
    lines = [json.loads(line) for line in (runs["rm"] / "metrics.jsonl").read_text().splitlines()]
    assert any("train_accuracy" in line for line in lines)
    final = [line for line in lines if line.get("final")]
    assert final and final[-1]["val_accuracy"] == summary["val_accuracy"]
    dpo = json.loads((runs["dpo"] / "summary.json").read_text())
    assert {"val_reward_accuracy", "val_policy_accuracy", "val_reward_margin"} <= set(dpo)


def test_a_defaulted_reference_is_named_in_the_trained_runs_manifest(runs):
    import tomllib

    manifest = tomllib.loads((runs["dpo"] / "manifest.toml").read_text())
    assert Path(manifest["objective"]["reference"]) == runs["base"].resolve()


def test_held_out_evaluation_scores_what_the_final_evaluation_scores(runs, tmp_path):
    """The run's validation split, written out as a file, scored by `lmlab eval`: the same loss and
    accuracy as the closing evaluation wrote (same records, same batching)."""
    import gzip

    # The validation records of the rm run: every 10th document (val_fraction 0.1), as the split assigns them.
    records = [json.loads(line) for line in gzip.open(HELD_OUT, "rt")]
    val = [r for k, r in enumerate(records) if (k + 1) // 10 > k // 10]
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in val))
    result = run_cli("eval", str(runs["rm"]), "--data", str(path), "--out", str(tmp_path / "scores.json"))
    assert result.returncode == 0, result.stderr[-2000:]
    scores = json.loads((tmp_path / "scores.json").read_text())
    summary = json.loads((runs["rm"] / "summary.json").read_text())
    assert scores["records"] == len(val)
    assert scores["val_loss"] == pytest.approx(summary["val_loss"], abs=1e-6)
    assert scores["val_accuracy"] == pytest.approx(summary["val_accuracy"], abs=1e-9)


def test_a_reference_with_another_tokenizer_is_refused_at_check(runs):
    root = runs["root"]
    other = root / "other.txt"
    other.write_text("abc abc cab\n" * 2000)  # another character set: other ids
    result = run_cli("run", write(root / "other.toml", BASE.replace('name = "base"', 'name = "other"')
                                  .format(text=other)), "--out", str(root / "runs" / "other"))
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = write(root / "dpo-other.toml", PAIRS.format(
        name="dpo-other", init=runs["base"], data=HELD_OUT, objective="dpo",
        options=f'reference = "{root / "runs" / "other" / "default"}"'))
    line = refused(run_cli("check", manifest), "objective.reference")
    assert "tokenizer" in line


def test_a_reference_that_is_not_a_run_folder_is_refused(runs, tmp_path):
    manifest = write(tmp_path / "m.toml", PAIRS.format(name="x", init=runs["base"], data=HELD_OUT, objective="dpo",
                                                       options=f'reference = "{tmp_path}"'))
    refused(run_cli("check", manifest), "objective.reference")


def test_an_objective_that_runs_the_model_refuses_exit_heads(runs, tmp_path):
    manifest = write(tmp_path / "m.toml", PAIRS.format(name="x", init=runs["base"], data=HELD_OUT,
                                                       objective="reward-model", options="")
                     .replace("[optimizer]", "[architecture]\nexit_layers = [0]\n[optimizer]"))
    refused(run_cli("check", manifest), "architecture.exit_layers")


def test_an_init_with_heads_starts_a_plain_run_and_a_plain_init_starts_a_head(runs):
    """The rm run started from base (no heads: the head starts as built); a causal-lm run can start from
    the rm run (its head is left behind)."""
    from lmlab import manifest
    from lmlab.assemble import assemble
    from lmlab.pretrained import initialise

    (variant,) = manifest.load(write(runs["root"] / "from-rm.toml", BASE.replace('name = "base"', 'name = "x"')
                                     .format(text=ROOT / "data" / "tinyshakespeare.txt") + f'[init]\nfrom = "{runs["rm"]}"\n'))
    built = assemble(variant, model=True, vocabulary_unknown_ok=True)
    initialise(variant, built.model)
    assert built.model.heads is None


def test_generate_ids_continues_as_the_greedy_decoder_and_cuts_at_a_stop(runs):
    from lmlab.generation.batch import generate_ids
    from lmlab.generation.token_ids import generate_tensor
    from lmlab.trained import load_run

    run = load_run(runs["base"])
    decoder = run.plugins["decoding"]
    prompts = [[int(t) for t in run.tokenizer.encode(text)] for text in ("ROMEO:\n", "First Citizen:\nWe are")]
    made = generate_ids(decoder, run.model, prompts, 12)
    for prompt, new in zip(prompts, made):
        whole = generate_tensor(decoder, run.model, torch.tensor([prompt]), 12)[0].tolist()
        assert new == whole[len(prompt):]
    stop = made[0][3]
    cut = generate_ids(decoder, run.model, prompts[:1], 12, stop_ids=[stop])[0]
    assert cut == made[0][:made[0].index(stop) + 1]


def test_report_names_are_checked():
    from lmlab_objectives.reward_model import RewardModel

    objective = RewardModel()
    objective.report("accuracy", torch.ones(3))
    objective.report("accuracy", torch.zeros(1))
    (total, count), = objective.take_reports().values()
    assert float(total) == 3.0 and count == 4 and objective.take_reports() == {}
    for bad in ("loss", "Accuracy", "two words"):
        with pytest.raises(ValueError):
            objective.report(bad, torch.ones(1))
