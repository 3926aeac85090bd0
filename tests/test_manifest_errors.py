"""Bad input: one clear line naming the key or file, exit status 2, no traceback."""

import pytest

from lmlab.cli.main import main

from support import run_cli


def check(capsys, path, *extra) -> str:
    code = main(["check", str(path), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


def test_malformed_toml_names_the_file(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text('name = "x"\n[data\nuse = 1\n')
    err = check(capsys, path)
    assert str(path) in err and "malformed TOML" in err


def test_missing_manifest_names_the_file(tmp_path, capsys):
    err = check(capsys, tmp_path / "nope.toml")
    assert "nope.toml" in err


def test_unknown_slot_suggests_the_close_one(tiny_manifest, capsys):
    err = check(capsys, tiny_manifest('[attentoin]\nuse = "mha"\n'))
    assert "attentoin" in err and "did you mean 'attention'" in err


def test_unknown_plugin_names_key_and_what_to_install(tiny_manifest, capsys):
    err = check(capsys, tiny_manifest('[attention]\nuse = "flash-mamba"\n'))
    assert "attention.use" in err and "flash-mamba" in err


def test_missing_plugin_from_the_catalogue_names_its_distribution(tiny_manifest, capsys, monkeypatch):
    from lmlab import discovery

    real = discovery.installed
    monkeypatch.setattr(discovery, "installed", lambda: {s: [p for p in ps if p.name != "gqa"]
                                                         for s, ps in real().items()})
    err = check(capsys, tiny_manifest('[attention]\nuse = "gqa"\n'))
    assert "attention.use" in err and "pip install lmlab-attention" in err


def test_unknown_option_suggests_the_close_one(tiny_manifest, capsys):
    err = check(capsys, tiny_manifest('[attention]\nuse = "gqa"\nn_kv_head = 2\n'))
    assert "attention.n_kv_head" in err and "did you mean 'n_kv_heads'" in err


def test_wrong_type_names_the_key(tiny_manifest, capsys):
    err = check(capsys, tiny_manifest('[optimizer]\nuse = "adamw"\nlr = "fast"\n'))
    assert "optimizer.lr" in err and "fast" in err


def test_missing_data_file_names_key_and_file(tiny_manifest, capsys, tmp_path):
    path = tiny_manifest()
    path.write_text(path.read_text().replace('path = "tiny.txt"', 'path = "missing.txt"'))
    err = check(capsys, path)
    assert "data.path" in err and "missing.txt" in err


@pytest.mark.parametrize("steps", [0, -5])
def test_non_positive_step_count_is_refused(tiny_manifest, capsys, steps):
    err = check(capsys, tiny_manifest(steps=steps))
    assert "train.max_steps" in err


def test_sweep_over_an_unknown_option_names_the_sweep_key(tiny_manifest, capsys):
    err = check(capsys, tiny_manifest('[sweep]\n"model.n_layer" = [1, 2]\n'))
    assert "sweep" in err and "model.n_layer" in err


def test_sweep_over_an_unknown_table_names_the_sweep_key(tiny_manifest, capsys):
    err = check(capsys, tiny_manifest('[sweep]\n"modle.n_layers" = [1, 2]\n'))
    assert "sweep" in err and "modle.n_layers" in err


def test_bad_set_override_is_refused(tiny_manifest, capsys):
    err = check(capsys, tiny_manifest(), "--set", "train.max_steps")
    assert "--set" in err


def test_heads_must_divide_width(tiny_manifest, capsys):
    err = check(capsys, tiny_manifest(), "--set", "model.n_heads=3")
    assert err.startswith("lmlab: error: model:") and "divisible" in err


def test_the_real_cli_exits_2_without_a_traceback(tiny_manifest):
    result = run_cli("check", str(tiny_manifest('[attention]\nuse = "gqa"\nn_kv_heads = "two"\n')))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "attention.n_kv_heads" in result.stderr
