"""`lmlab new-plugin`: the distribution it writes installs with pip (into a folder outside the
repository), passes its own tests unmodified, is listed, trains from its example manifest and
validates against `lmlab schema`; for every slot of lmlab.api. Bad input exits 2 with one line."""

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w
from jsonschema import Draft202012Validator

from lmlab import scaffold, testing
from lmlab.api import SLOT_BASES
from lmlab.discovery import MANY_SLOTS
from lmlab.testing import check_names
from support import ROOT, run_cli

SMALL = ["--set", "train.max_steps=4", "--set", "train.eval_every=2", "--set", "train.eval_steps=1",
         "--set", "train.checkpoint_every=4", "--set", "train.log_every=2", "--set", "train.batch_size=4",
         "--set", "model.n_layers=1", "--set", "model.d_model=16", "--set", "model.block_size=16",
         "--set", "train.sample_tokens=4"]


def pip_install(site: Path, *dists: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "--target", str(site), *map(str, dists)], check=True)


def run_pytest(site: Path, cwd: Path, *args: str) -> tuple[int, str]:
    """pytest as the plugin's author runs it, against the installed plugin."""
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                            capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    passed = re.search(r"(\d+) passed", result.stdout)
    assert result.returncode == 0 and "failed" not in result.stdout, result.stdout[-3000:]
    return int(passed.group(1)) if passed else 0, result.stdout


def schema_validator(site: Path, tmp_path: Path) -> Draft202012Validator:
    out = tmp_path / "lmlab.schema.json"
    result = run_cli("schema", "--out", str(out), env={"PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr
    return Draft202012Validator(json.loads(out.read_text()))


def imports_of(source: str) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module)
    return modules


@pytest.mark.parametrize("slot", list(SLOT_BASES))
def test_every_api_slot_renders_to_a_distribution_that_imports_only_lmlab_api(slot):
    plan = scaffold.plan("my-thing", slot)
    files = scaffold.render(plan)
    project = tomllib.loads(files["pyproject.toml"])["project"]
    assert project["name"] == "lmlab-my-thing"
    assert project["entry-points"][f"lmlab.{slot}"] == {"my-thing": f"lmlab_my_thing.my_thing:{plan.cls}"}
    assert any(dep.startswith("lmlab>=") for dep in project["dependencies"])
    example = tomllib.loads(files["example.toml"])
    if slot == "compress":  # applied to a trained run by `lmlab compress`, never named in a training manifest
        assert slot not in example and "lmlab compress runs/my-thing-example/default --use my-thing" in files["README.md"]
    elif slot == "executor":  # named on the command line: the example is a sweep to run through it
        assert slot not in example and example["sweep"]["seeds"] == [1, 2]
        assert "lmlab run example.toml --executor my-thing" in files["README.md"]
    else:
        assert example[slot]["use"] == (["my-thing"] if slot in MANY_SLOTS else "my-thing")
    plugin = files[f"src/lmlab_my_thing/{plan.module}.py"]
    core = {m for m in imports_of(plugin) if m == "lmlab" or m.startswith("lmlab.")}
    # lmlab.api and its submodules (an architecture's building blocks live in lmlab.api.architecture)
    assert "lmlab.api" in core and all(m.startswith("lmlab.api.") for m in core - {"lmlab.api"}), core
    assert re.search(rf"^class {plan.cls}\(", plugin, re.M)
    assert re.search(r'Field\([^)]*help="', plugin), "an option with a default and help text"
    tests = imports_of(files["tests/test_lmlab_my_thing.py"])
    assert {m for m in tests if m.startswith("lmlab.")} <= {"lmlab.api", "lmlab.testing"}
    assert f"lmlab_my_thing.{plan.module}" in tests
    for path, text in files.items():
        if path.endswith(".py"):
            compile(text, path, "exec")
    assert "$" not in files["README.md"] + files["example.toml"]


#: slot → what its generated tests call to run the slot's conformance kit
KIT_CALLS = {slot: (f"check_{slot}(", "iter_checks(") for slot in testing.SLOTS} | {"peft": ("check_peft(",)}


@pytest.mark.parametrize("slot", [slot for slot in SLOT_BASES if slot in KIT_CALLS])
def test_the_generated_tests_of_a_slot_with_a_kit_run_the_kit(slot):
    # That they pass as generated: test_generated_plugins_of_every_other_slot_pass_their_tests_...
    tests = scaffold.render(scaffold.plan("my-thing", slot))["tests/test_lmlab_my_thing.py"]
    assert any(call in tests for call in KIT_CALLS[slot]), slot


def test_generated_plugins_use_the_current_api():
    decoder = scaffold.render(scaffold.plan("my-thing", "decoding"))["src/lmlab_my_thing/my_thing.py"]
    assert "class MyThingDecoder(TokenDecoder):" in decoder and "def generate" not in decoder  # served per row
    attention = scaffold.render(scaffold.plan("my-thing", "attention"))["src/lmlab_my_thing/my_thing.py"]
    assert "def kv_layout(self)" in attention and "ctx.key_mask" in attention  # batched, ragged decoding
    filter_ = scaffold.render(scaffold.plan("my-thing", "filter"))["src/lmlab_my_thing/my_thing.py"]
    assert "def keep(self, text: str)" in filter_ and "hookimpl" not in filter_
    architecture = scaffold.render(scaffold.plan("my-thing", "architecture"))["src/lmlab_my_thing/my_thing.py"]
    assert "class MyThingArchitecture(Architecture):" in architecture and "(Block):" in architecture  # API 1.18
    assert "return Stack(" in architecture and "block=block" in architecture and "hookimpl" not in architecture


def test_names_become_a_distribution_a_package_and_a_class():
    plan = scaffold.plan("sliding-window", "attention")
    assert (plan.dist, plan.package, plan.module, plan.cls) == (
        "lmlab-sliding-window", "lmlab_sliding_window", "sliding_window", "SlidingWindowAttention")
    assert scaffold.plan("my-attention", "attention").cls == "MyAttention"  # no AttentionAttention
    assert scaffold.plan("class", "ffn").module == "class_"  # a keyword cannot be a module name


@pytest.mark.parametrize("args, message", [
    (["Demo_1", "--slot", "ffn"], "'Demo_1' is not a valid plugin name"),
    (["-demo", "--slot", "ffn"], None),  # argparse takes it for an option: its own one-line error
    (["demo", "--slot", "atention"], "unknown slot 'atention' (did you mean 'attention'?); slots: data, "),
    (["demo", "--slot", "ffn", "--dir", "taken"], "lmlab-demo: already exists"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, message):
    (tmp_path / "taken" / "lmlab-demo").mkdir(parents=True)
    result = run_cli("new-plugin", *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("lmlab: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert message is None or message in errors[0], errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # nothing written
    assert list((tmp_path / "taken").iterdir()) == [tmp_path / "taken" / "lmlab-demo"]


def test_generated_attention_plugin_installs_passes_its_tests_lists_and_trains(tmp_path):
    result = run_cli("new-plugin", "demo", "--slot", "attention", "--dir", "tmp", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    dist = tmp_path / "tmp" / "lmlab-demo"
    assert (dist / "pyproject.toml").is_file() and (dist / "README.md").is_file()
    site = tmp_path / "site"
    pip_install(site, dist)

    # The generated tests, unmodified, from inside the generated folder.
    passed, _ = run_pytest(site, dist)
    assert passed >= len(check_names("attention"))

    listing = run_cli("plugins", "attention", env={"PYTHONPATH": str(site)})
    assert re.search(r"demo\s+lmlab-demo 0\.1\.0", listing.stdout), listing.stdout

    run = run_cli("run", str(dist / "example.toml"), "--out", str(tmp_path / "runs"), *SMALL,
                  env={"PYTHONPATH": str(site)})
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "default" / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["plugins"]["attention"] == {"name": "demo", "distribution": "lmlab-demo", "version": "0.1.0"}


def test_generated_plugins_of_every_other_slot_pass_their_tests_and_train_together(tmp_path):
    slots = [slot for slot in SLOT_BASES if slot != "attention"]
    dists = [scaffold.create(f"my-{slot}", slot, tmp_path / "gen")[0] for slot in slots]  # as the CLI does
    site = tmp_path / "site"
    pip_install(site, *dists)

    passed, output = run_pytest(site, tmp_path, "--import-mode=importlib", *(str(d / "tests") for d in dists))
    # every check of the kit's slots, and at least the contract check and one property per other slot
    assert passed >= len(check_names("position")) + len(check_names("ffn")) + 2 * len(slots), output[-500:]

    # Each example validates against `lmlab schema`, and so does one manifest that uses all of them
    # at once (each generated example's slot table), which then trains.
    manifest = {"name": "all-generated", "seed": 1}
    for dist in dists:
        example = tomllib.loads((dist / "example.toml").read_text())
        slot = dist.name.removeprefix("lmlab-my-")
        if slot in ("compress", "executor"):  # used on the trained run below; runs the sweep below
            continue
        manifest[slot] = example[slot]
        if slot == "data":
            manifest[slot]["path"] = str(dist / "example.txt")
    validator = schema_validator(site, tmp_path)
    for dist in dists:
        example = tomllib.loads((dist / "example.toml").read_text())
        assert not [e.message for e in validator.iter_errors(example)], dist.name
    assert not [e.message for e in validator.iter_errors(manifest)]

    # A peft plugin names the layouts it works under (the generated one: single and ddp), which a
    # layout generated beside it cannot be among: the parallel plugin trains its own example.
    del manifest["parallel"]
    del manifest["order"]  # it ranks documents, and the generated data source yields one: it trains its own example
    path = tmp_path / "all.toml"
    path.write_text(tomli_w.dumps(manifest))
    run = run_cli("run", str(path), "--out", str(tmp_path / "runs"), *SMALL, env={"PYTHONPATH": str(site)})
    assert run.returncode == 0, run.stderr[-3000:]
    folder = tmp_path / "runs" / "default"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "completed"
    for slot in slots:
        if slot not in ("parallel", "compress", "order", "executor"):
            used = summary["plugins"][slot]
            assert (used[0] if slot in MANY_SLOTS else used)["distribution"] == f"lmlab-my-{slot}"
    assert 0 < summary["trainable_params"] < summary["params"] and summary["adapter_bytes"] > 0  # my-peft
    example = tmp_path / "gen" / "lmlab-my-parallel" / "example.toml"
    run = run_cli("run", str(example), "--out", str(tmp_path / "parallel"), *SMALL, env={"PYTHONPATH": str(site)})
    assert run.returncode == 0, run.stderr[-3000:]
    used = json.loads((tmp_path / "parallel" / "default" / "summary.json").read_text())["plugins"]["parallel"]
    assert used["distribution"] == "lmlab-my-parallel"
    example = tmp_path / "gen" / "lmlab-my-order" / "example.toml"
    run = run_cli("run", str(example), "--out", str(tmp_path / "order"), *SMALL, env={"PYTHONPATH": str(site)})
    assert run.returncode == 0, run.stderr[-3000:]
    used = json.loads((tmp_path / "order" / "default" / "summary.json").read_text())["plugins"]["order"]
    assert used["distribution"] == "lmlab-my-order"
    assert "my-monitor/loss_ema" in (folder / "metrics.jsonl").read_text()  # a hook of a many-valued slot
    assert (folder / "tracker.jsonl").is_file()  # the generated tracker
    compressed = tmp_path / "compressed"
    run = run_cli("compress", str(folder), "--use", "my-compress", "--out", str(compressed), "--timing-rounds", "1",
                  env={"PYTHONPATH": str(site)})
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((compressed / "summary.json").read_text())
    assert summary["plugins"]["compress"][0]["distribution"] == "lmlab-my-compress"
    assert summary["compress"][0]["sparsity"] > 0.29
    assert not (ROOT / "plugins" / "lmlab-my-ffn").exists()  # nothing was added to the repository


def test_the_wheel_of_lmlab_ships_every_template(tmp_path):
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "--wheel-dir", str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("lmlab-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    templates = [p.relative_to(ROOT / "core").as_posix() for p in scaffold.TEMPLATES.rglob("*.tmpl")]
    assert len(templates) > 30 and not [t for t in templates if t not in shipped]
