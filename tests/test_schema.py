"""`lmlab schema`: a valid draft 2020-12 JSON Schema of manifests that accepts every manifest under
experiments/ and refuses what `lmlab check` refuses (unknown options, wrong types, unknown plugins),
with the help texts as descriptions, built without importing lightning, wandb, deepspeed or peft."""

import json
import os
import subprocess
import sys
import tomllib

import jsonschema
import pytest
import tomli_w

from lmlab import discovery, manifest
from lmlab.api import Field, Options, Plugin
from lmlab.errors import UserError
from lmlab.schema import installed_plugins, manifest_schema
from support import ROOT

EXPERIMENTS = sorted((ROOT / "experiments").glob("*.toml"))


@pytest.fixture(scope="module")
def schema() -> dict:
    return manifest_schema()


@pytest.fixture(scope="module")
def validator(schema):
    return jsonschema.Draft202012Validator(schema)


def errors(validator, document: dict) -> list[str]:
    return [f"{e.json_path}: {e.message}" for e in validator.iter_errors(document)]


def base() -> dict:
    """An experiment's manifest without its sweep (which would override the tables under test)."""
    with open(ROOT / "experiments" / "attention-ablation.toml", "rb") as f:
        document = tomllib.load(f)
    del document["sweep"]
    return document


def test_schema_is_a_valid_draft_2020_12_schema(schema):
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.stem for p in EXPERIMENTS])
def test_every_experiment_manifest_validates(validator, path):
    with open(path, "rb") as f:
        assert errors(validator, tomllib.load(f)) == []


def _set(document: dict, dotted: str, value) -> dict:
    *tables, key = dotted.split(".")
    node = document
    for table in tables:
        node = node.setdefault(table, {})
    node[key] = value
    return document


REFUSED = {
    "unknown option": ("attention.n_kv_head", 2),
    "option of another plugin": ("optimizer.n_kv_heads", 2),
    "option of a plugin not in use": ("ffn.n_experts", 4),  # moe's, under mlp
    "wrong type of a plugin option": ("attention.n_kv_heads", "two"),
    "wrong type of a core option": ("model.n_layers", "four"),
    "value outside a choice": ("model.norm", "batchnorm"),
    "unknown plugin name": ("attention.use", "gqa2"),
    "unknown table": ("atention.use", "gqa"),
    "unknown top-level key": ("seeds", [1, 2]),
    "bad sweep value": ("sweep.model.d_model", ["wide"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_schema_refuses_what_lmlab_check_refuses(validator, tmp_path, case):
    key, value = REFUSED[case]
    document = base()
    if key.startswith("sweep."):
        document["sweep"] = {key.removeprefix("sweep."): value}
    else:
        _set(document, key, value)
    assert errors(validator, document), f"{case}: accepted by the schema"
    document["data"]["path"] = str(ROOT / "data" / "tinyshakespeare.txt")
    path = tmp_path / "m.toml"
    path.write_text(tomli_w.dumps(document))
    with pytest.raises(UserError):
        manifest.load(path)


ACCEPTED = {
    "a table without use means the default plugin": ("optimizer", {"lr": 3e-3, "weight_decay": 0.0}),
    "another installed plugin with its options": ("attention", {"use": "mamba", "d_state": 8}),
    "whole tables in a sweep": ("sweep", {"ffn": [{"use": "mlp", "hidden": 64}, {"use": "swiglu"}],
                                          "seeds": [1, 2], "attention.use": ["mha", "mqa"]}),
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_schema_accepts_what_lmlab_check_accepts(validator, tmp_path, case):
    table, value = ACCEPTED[case]
    document = base()
    document[table] = value
    assert errors(validator, document) == []
    document["data"]["path"] = str(ROOT / "data" / "tinyshakespeare.txt")
    path = tmp_path / "m.toml"
    path.write_text(tomli_w.dumps(document))
    assert manifest.load(path)


def test_use_lists_the_installed_plugins_and_descriptions_are_the_help_texts(schema):
    attention = schema["properties"]["attention"]
    installed = sorted({p.name for p in discovery.installed()["attention"]})
    assert attention["properties"]["use"]["enum"] == installed
    assert attention["properties"]["use"]["default"] == "mha"  # the slot table's default
    gqa = next(rule["then"] for rule in attention["allOf"] if rule["if"]["properties"]["use"]["const"] == "gqa")
    assert gqa["properties"]["n_kv_heads"]["description"].startswith("key/value heads")
    model = schema["properties"]["model"]["properties"]
    assert model["d_model"] == {"default": 128, "description": "width of the residual stream",
                                "exclusiveMinimum": 0, "type": "integer"}
    assert "title" not in model["d_model"]
    assert schema["required"] == ["name", "data"]  # the slots without a default plugin


class ProbeOptions(Options):
    every: int = Field(10, gt=0, help="steps between probes")


class Probe(Plugin):
    """``probe``: looks at the model now and then."""

    slot = "monitor"
    Options = ProbeOptions


def test_a_many_valued_slot_takes_a_list_and_one_options_subtable_per_plugin():
    plugins = {**installed_plugins(print), "monitor": {"probe": Probe}, "filter": {}}
    schema = manifest_schema(plugins)
    document = base()
    document["monitor"] = {"use": ["probe"], "probe": {"every": 5}}
    assert errors(jsonschema.Draft202012Validator(schema), document) == []
    monitor = jsonschema.Draft202012Validator(schema["properties"]["monitor"])
    assert errors(monitor, {"use": "probe"}) == []
    assert errors(monitor, {"use": ["probe"], "probe": {"every": "often"}})
    assert errors(monitor, {"use": ["probe"], "every": 5})  # options belong under [monitor.probe]
    assert errors(monitor, {"use": ["nope"]})
    assert errors(monitor, {"probe": {}})  # use is required
    probe = schema["properties"]["monitor"]["properties"]["probe"]
    assert probe["properties"]["every"]["description"] == "steps between probes"
    assert "`probe`: looks at the model now and then." in probe["description"]
    assert "no filter plugin is installed" in schema["properties"]["filter"]["description"]
    assert errors(jsonschema.Draft202012Validator(schema), {**document, "filter": {"use": ["x"]}})


def test_a_plugin_that_fails_to_load_is_left_out_with_a_warning(monkeypatch):
    real = discovery.load

    def load(slot, name, key=None):
        if (slot, name) == ("attention", "mqa"):
            raise UserError("plugin 'mqa' failed to load (boom)", key="attention.use")
        return real(slot, name, key)

    monkeypatch.setattr(discovery, "load", load)
    warnings = []
    plugins = installed_plugins(warnings.append)
    assert "mqa" not in plugins["attention"] and "mha" in plugins["attention"]
    assert "left out of the schema: attention.use: plugin 'mqa' failed to load (boom)" in warnings


def test_cli_writes_the_schema_without_importing_lightning_wandb_deepspeed_or_peft(tmp_path):
    out = tmp_path / "schema.json"
    probe = ("import sys; from lmlab.cli.main import main; rc = main(['schema', '--out', sys.argv[1]]); "
             "heavy = {'lightning', 'wandb', 'deepspeed', 'peft'}; "
             "print(sorted(heavy & {m.split('.')[0] for m in sys.modules})); sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", probe, str(out)], capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
    assert json.loads(out.read_text())["properties"]["attention"]["properties"]["use"]["enum"]


def test_cli_prints_the_schema_or_refuses_a_folder_that_does_not_exist(tmp_path, capsys):
    from lmlab.cli.main import main

    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out)["title"] == "lmlab manifest"
    assert main(["schema", "--out", str(tmp_path / "no" / "such" / "schema.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmlab: error: ") and err.count("\n") == 1, err
