"""Manifest resolution: defaults, overrides, sweeps, variant names, relative paths."""

from pathlib import Path

from lmlab import manifest


def test_defaults_fill_every_slot_and_option(tiny_manifest):
    (variant,) = manifest.load(tiny_manifest())
    m = variant.manifest
    assert variant.name == "default"
    assert m["attention"]["use"] == "mha" and m["ffn"]["use"] == "mlp" and m["position"]["use"] == "learned"
    assert m["optimizer"]["lr"] > 0 and m["train"]["grad_accum"] == 1 and m["model"]["norm"] == "layernorm"


def test_relative_data_path_resolves_against_the_manifest_folder(tiny_manifest, tmp_path, monkeypatch):
    path = tiny_manifest()
    monkeypatch.chdir("/")
    (variant,) = manifest.load(path)
    assert Path(variant.manifest["data"]["path"]) == tmp_path / "tiny.txt"


def test_set_overrides_coerce_types(tiny_manifest):
    (variant,) = manifest.load(tiny_manifest(), ["train.max_steps=7", "optimizer.lr=3e-4",
                                                 "model.bias=true", "attention.use=gqa",
                                                 "attention.n_kv_heads=2"])
    m = variant.manifest
    assert m["train"]["max_steps"] == 7 and m["optimizer"]["lr"] == 3e-4 and m["model"]["bias"] is True
    assert m["attention"].items() >= {"use": "gqa", "n_kv_heads": 2}.items()


def test_sweep_is_the_cartesian_product_with_seeds_innermost(tiny_manifest):
    path = tiny_manifest('[sweep]\n"attention.use" = ["mha", "mqa"]\n"model.n_layers" = [1, 2]\nseeds = [1, 2]\n')
    variants = manifest.load(path)
    assert [v.name for v in variants] == [
        f"attention.use={a},model.n_layers={n},seed={s}" for a in ("mha", "mqa") for n in (1, 2) for s in (1, 2)]
    last = variants[-1].manifest
    assert (last["attention"]["use"], last["model"]["n_layers"], last["seed"]) == ("mqa", 2, 2)


def test_sweeping_use_keeps_options_the_plugin_declares_and_notes_the_rest(tiny_manifest):
    path = tiny_manifest('[attention]\nuse = "gqa"\nn_kv_heads = 2\n[sweep]\n"attention.use" = ["mha", "gqa"]\n')
    mha, gqa = manifest.load(path)
    assert mha.manifest["attention"]["use"] == "mha" and "n_kv_heads" not in mha.manifest["attention"]
    assert any("n_kv_heads" in note for note in mha.notes)
    assert gqa.manifest["attention"].items() >= {"use": "gqa", "n_kv_heads": 2}.items() and not gqa.notes


def test_check_prints_each_resolved_variant(tiny_manifest, capsys):
    from lmlab.cli.main import main

    assert main(["check", str(tiny_manifest('[sweep]\nseeds = [4, 5]\n'))]) == 0
    out = capsys.readouterr().out
    assert "2 variants" in out and "# variant: seed=4" in out and "# variant: seed=5" in out
    assert 'use = "mha"' in out and "max_steps = 6" in out


def test_check_imports_only_the_named_plugins_and_no_heavy_library(tiny_manifest):
    import subprocess
    import sys

    code = ("import sys; from lmlab.cli.main import main; assert main(['check', sys.argv[1], '-q']) == 0; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "{'lightning', 'pytorch_lightning', 'wandb', 'deepspeed', 'peft', 'transformers', 'sentencepiece'}); "
            "plugins = sorted({m.split('.')[0] for m in sys.modules if m.startswith('lmlab_')}); "
            "print(heavy, plugins)")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_manifest())], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    heavy, plugins = out.split("] [")
    assert heavy == "["
    assert set(plugins.rstrip("]").replace("'", "").split(", ")) <= {
        "lmlab_data", "lmlab_tokenizers", "lmlab_architectures", "lmlab_position", "lmlab_attention", "lmlab_ffn",
        "lmlab_objectives", "lmlab_optimizers", "lmlab_parallel", "lmlab_decoding", "lmlab_trackers"}
    assert "lmlab_wandb" not in plugins and "lmlab_sentencepiece" not in plugins


def test_a_sweep_axis_over_whole_tables_links_options(tiny_manifest):
    path = tiny_manifest('[sweep]\nattention = [{use = "mha"}, {use = "gqa", n_kv_heads = 2}]\n')
    mha, gqa = manifest.load(path)
    assert (mha.name, gqa.name) == ("attention=mha", "attention=gqa+n_kv_heads=2")
    assert mha.manifest["attention"]["use"] == "mha" and "n_kv_heads" not in mha.manifest["attention"]
    assert gqa.manifest["attention"].items() >= {"use": "gqa", "n_kv_heads": 2}.items()


def test_a_linked_sweep_axis_sets_several_keys_per_point_and_crosses_the_other_axes(tiny_manifest):
    path = tiny_manifest('[sweep]\n"model.n_layers" = [1, 2]\n'
                         'linked = [{attention = {use = "mha"}, "optimizer.lr" = 3e-4},\n'
                         '          {attention = {use = "gqa", n_kv_heads = 2}, "optimizer.lr" = 2e-3}]\n')
    variants = manifest.load(path)
    assert [v.name for v in variants] == [
        f"model.n_layers={n},{point}" for n in (1, 2)
        for point in ("attention=mha,optimizer.lr=0.0003", "attention=gqa+n_kv_heads=2,optimizer.lr=0.002")]
    last = variants[-1].manifest
    assert last["attention"].items() >= {"use": "gqa", "n_kv_heads": 2}.items() and last["optimizer"]["lr"] == 2e-3
    assert last["optimizer"]["use"] == "adamw" and last["model"]["n_layers"] == 2


def test_a_linked_entry_naming_no_slot_is_refused_with_its_position(tiny_manifest):
    import pytest
    from lmlab.errors import UserError

    path = tiny_manifest('[sweep]\nlinked = [{"optimizer.lr" = 1e-3}, {"optimiser.lr" = 1e-3}]\n')
    with pytest.raises(UserError, match="optimiser.lr") as info:
        manifest.load(path)
    assert info.value.key == "sweep.linked[1].'optimiser.lr'"
    with pytest.raises(UserError, match="non-empty table"):
        manifest.load(tiny_manifest('[sweep]\nlinked = [3]\n'))
    with pytest.raises(UserError, match="also a sweep axis"):
        manifest.load(tiny_manifest('[sweep]\n"optimizer.lr" = [1e-3]\nlinked = [{"optimizer.lr" = 2e-3}]\n'))
