"""`lmlab check` refuses what a run would refuse, before anything is built or read: each combination
below is one line naming the key and exit status 2, from the plugins' own checks (``Plugin.check``)
and the model built on the meta device; and one resolved run is assembled one way, so `lmlab plan`,
`lmlab run` and a loaded run agree on the model."""

import json

import pytest
import torch

from lmlab import manifest
import support
from lmlab.cli.main import main
from support import ROOT, run_cli


def refused(capsys, path, *overrides) -> str:
    code = main(["check", str(path), "-q", *(f"--set={o}" for o in overrides)])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("extra, overrides, key", [
    ('[attention]\nuse = "gqa"\nn_kv_heads = 3\n', [], "attention.n_kv_heads"),  # 3 does not divide 4 heads
    ('[attention]\nuse = "mamba"\n\n[position]\nuse = "rope"\n', [], "position.use"),
    ('[attention]\nuse = "mamba"\n\n[position]\nuse = "alibi"\n', [], "position.use"),
    ('[attention]\nuse = "mamba"\n\n[position]\nuse = "none"\n\n[objective]\nuse = "mlm"\n', [], "attention.use"),
    ('[objective]\nuse = "sft"\n', [], "objective.use"),  # text-file yields plain text: nothing to mask
    ('[tokenizer]\nuse = "byte"\n', ["model.vocab_size=100"], "model.vocab_size"),
    ('[peft]\nuse = "lora"\ntargets = ["gate"]\n', [], "peft.targets"),  # mlp has no gate
    ('[peft]\nuse = "lora"\n\n[parallel]\nuse = "fsdp"\ndevices = 2\naccelerator = "cpu"\n', [], "peft.use"),
    ('[parallel]\nuse = "tensor"\ndevices = 3\naccelerator = "cpu"\ntensor_parallel_size = 3\n', [],
     "parallel.tensor_parallel_size"),  # 4 heads do not split 3 ways
])
def test_check_refuses_what_the_run_would_refuse_naming_the_key(tiny_manifest, capsys, extra, overrides, key):
    plugin = next((line.split('"')[1] for line in extra.splitlines() if line.startswith("use = ")), None)
    from importlib.metadata import entry_points

    for slot, name in (("peft", "lora"), ("parallel", "fsdp"), ("parallel", "tensor"), ("attention", "mamba")):
        if f'use = "{name}"' in extra and not entry_points(group=f"lmlab.{slot}", name=name):
            pytest.skip(f"{name} is not installed ({plugin})")
    err = refused(capsys, tiny_manifest("\n" + extra), *overrides)
    assert err.startswith(f"lmlab: error: {key}:"), err


def test_check_refuses_16_mixed_on_a_machine_without_a_gpu(tiny_manifest, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert refused(capsys, tiny_manifest(), "train.precision=16-mixed").startswith("lmlab: error: train.precision:")


def test_check_refuses_an_init_with_another_tokenizer(trained_run, tiny_manifest, capsys):
    path = tiny_manifest(f'\n[init]\nfrom = "{trained_run}"\n\n[tokenizer]\nuse = "byte"\n')
    assert refused(capsys, path).startswith("lmlab: error: tokenizer.use:")


def test_a_vocab_size_below_what_the_tokenizer_learns_is_refused_by_check_as_by_run(tiny_manifest, tmp_path):
    # The char tokenizer learns its vocabulary from the data: check fits it (through the token cache)
    # when model.vocab_size must hold it, and says what the run says, before the run writes anything.
    path = tiny_manifest()
    checked = support.refused(run_cli("check", str(path), "-q", "--set=model.vocab_size=10"), "model.vocab_size")
    out = tmp_path / "out"
    ran = support.refused(run_cli("run", str(path), "--out", str(out), "--set=model.vocab_size=10"),
                          "model.vocab_size")
    assert checked == ran and "smaller than the tokenizer's vocabulary" in ran
    assert not out.exists()


def test_check_quiet_prints_nothing_when_every_variant_passes(tiny_manifest):
    result = run_cli("check", str(tiny_manifest('[sweep]\nseeds = [1, 2]\n')), "-q")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""


def test_the_optimizer_comparison_gives_each_optimizer_the_options_its_comment_says():
    # experiments/optimizers.toml: the quickstart's betas and weight decay reach every swept optimizer
    # that has the option; everything else (but lr) is the plugin's default.
    carried = {"betas": [0.9, 0.99], "weight_decay": 0.1}
    variants = manifest.load(ROOT / "experiments" / "optimizers.toml", ["sweep.seeds=[1]"])
    assert [v.slots["optimizer"].name for v in variants] == ["adamw", "adafactor", "lamb", "adam8bit", "lion", "muon"]
    for variant in variants:
        chosen = variant.slots["optimizer"]
        given, default = chosen.table(), chosen.plugin.Options().model_dump(mode="json")
        expected = {**default, "lr": variant.sweep["optimizer.lr"],
                    **{key: value for key, value in carried.items() if key in default}}
        assert given == expected, chosen.name
        assert ("betas" in default) == (f"optimizer.betas does not apply to optimizer plugin {chosen.name!r}; "
                                        "ignored" not in variant.notes)


def test_plan_run_and_a_loaded_run_assemble_one_model(tmp_path):
    from lmlab.api import Windows
    from lmlab.assemble import assemble
    from lmlab.model import compute_loss
    from lmlab.plan import plan_variant
    from lmlab.train import runner
    from lmlab.train.batches import RandomWindows
    from lmlab.trained import load_run

    overrides = ["tracker.use=none", "train.max_steps=1", "train.eval_every=1", "train.eval_steps=1",
                 "train.checkpoint_every=1", "train.log_every=1", "train.sample_tokens=0", "model.dropout=0.0"]
    (variant,) = manifest.load(ROOT / "experiments" / "shakespeare-char.toml", overrides)
    summary = runner.run_variant(variant, tmp_path / "run").summary
    first_loss = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["train_loss"]

    assert plan_variant(variant).facts.params == summary["params"] == load_run(tmp_path / "run").model.num_params()

    # The model a run trains is the one assemble builds, weight for weight: its loss on the run's first
    # batch is the first step's loss.
    torch.manual_seed(variant.seed)
    built = assemble(variant, data=True)
    windows = RandomWindows(built.tokens.train, variant.model.block_size, variant.train.batch_size, variant.seed)
    batch = windows.batch(0)
    made = built.objective.make_batch_from(Windows(batch)) if built.objective.wants_windows() \
        else built.objective.make_batch(batch)
    with torch.no_grad():
        loss = compute_loss(built.model, built.objective, made).loss.item()
    assert loss == pytest.approx(first_loss, abs=1e-6)
