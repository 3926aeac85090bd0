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


# Values must have the declared type: nothing is coerced ("16" → 16, true → 1.0, "3e-4" → 0.0003).

def passes(capsys, path, *extra) -> str:
    code = main(["check", str(path), *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_a_number_in_quotes_for_an_integer_option_of_a_plugin_is_refused(tiny_manifest, capsys):
    err = check(capsys, tiny_manifest('[attention]\nuse = "gqa"\nn_kv_heads = "2"\n'))
    assert err == 'lmlab: error: attention.n_kv_heads: expected an integer, got the string "2"; drop the quotes'


def test_a_boolean_for_a_float_option_is_refused(tiny_manifest, capsys):
    err = check(capsys, tiny_manifest('[optimizer]\nuse = "adamw"\nweight_decay = true\n'))
    assert err == "lmlab: error: optimizer.weight_decay: expected a number (float), got the boolean true"


def test_a_number_in_quotes_for_a_float_option_is_refused(tiny_manifest, capsys):
    err = check(capsys, tiny_manifest('[optimizer]\nuse = "adamw"\nlr = "3e-4"\n'))
    assert err == 'lmlab: error: optimizer.lr: expected a number (float), got the string "3e-4"; drop the quotes'


@pytest.mark.parametrize("key", ["model.n_layers", "train.warmup_steps", "train.decay_steps"])
def test_a_boolean_for_a_bounded_integer_names_the_type_not_the_bound(tiny_manifest, capsys, key):
    err = check(capsys, tiny_manifest(), "--set", f"{key}=true")
    assert err == f"lmlab: error: {key}: expected an integer, got the boolean true"


@pytest.mark.parametrize("value", ["2.0", "2.5"])
def test_a_float_for_an_integer_is_refused(tiny_manifest, capsys, value):
    err = check(capsys, tiny_manifest(), "--set", f"model.n_layers={value}")
    assert err == f"lmlab: error: model.n_layers: expected an integer, got the float {value}"


def test_an_integer_for_a_float_is_a_float(tiny_manifest, capsys):
    out = passes(capsys, tiny_manifest('[optimizer]\nuse = "adamw"\nlr = 1\nweight_decay = 0\n'))
    assert "\nlr = 1.0\n" in out and "\nweight_decay = 0.0\n" in out


def test_an_integer_for_a_boolean_is_refused(tiny_manifest, capsys):
    err = check(capsys, tiny_manifest(), "--set", "model.bias=1")
    assert err == "lmlab: error: model.bias: expected a boolean (true or false), got the integer 1"


def test_list_items_have_the_declared_type(tiny_manifest, capsys):
    err = check(capsys, tiny_manifest('[optimizer]\nuse = "adamw"\nbetas = [0.9, "0.99"]\n'))
    assert err == ('lmlab: error: optimizer.betas: expected a list of 2 numbers (float); item 2 is the string '
                   '"0.99"; drop the quotes')
    assert "\nbetas = [\n    0.9,\n    0.99,\n]\n" in passes(capsys, tiny_manifest('[optimizer]\nuse = "adamw"\n'
                                                                                   'betas = [0.9, 0.99]\n'))


def test_a_number_in_quotes_is_refused_where_a_union_also_takes_a_word(tiny_manifest, capsys):
    # devices: a positive integer or "auto"; pydantic alone would take "2" for 2.
    err = check(capsys, tiny_manifest('[parallel]\nuse = "ddp"\ndevices = "2"\n'))
    assert err == 'lmlab: error: parallel.devices: expected an integer or "auto", got the string "2"; drop the quotes'


def test_a_choice_outside_a_literal_lists_the_choices(tiny_manifest, capsys):
    err = check(capsys, tiny_manifest(), "--set", "model.norm=rms")
    assert err == 'lmlab: error: model.norm: expected one of "layernorm", "rmsnorm", got the string "rms"'


def test_set_reads_values_as_toml(tiny_manifest, capsys):
    # A number stays a number (no quotes to drop), a bare word is a string.
    out = passes(capsys, tiny_manifest(), "--set", "optimizer.lr=3e-4", "--set", "tokenizer.use=char")
    assert "\nlr = 0.0003\n" in out and '[tokenizer]\nuse = "char"\n' in out
    err = check(capsys, tiny_manifest(), "--set", "train.sample_prompt=2024")
    assert err == ('lmlab: error: train.sample_prompt: expected a string, got the integer 2024; '
                   'quote it ("2024") if it is meant as text')
