"""Bad input anywhere — the manifest, a file lmlab reads back, a command-line value, the machine —
is one line naming the key or file, exit status 2, no traceback, found before any training where it
can be (and by `lmlab check` where it can be found there), and nothing is written for it."""

import json
import math

import pytest
import torch

from lmlab.cli.main import main
from support import refused, run_cli


def run(path, tmp_path, *args):
    return run_cli("run", str(path), "--out", str(tmp_path / "out"), *args)


def test_a_binary_manifest_is_named(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\x00\x01binary\xff\xfe")
    for verb in ("check", "run"):
        line = refused(run_cli(verb, str(path)), str(path))
        assert "not UTF-8 text" in line


@pytest.mark.parametrize("content, why", [(b"[1, 2]\n", "a JSON list, not an object"),
                                          (b"\xff\xfe{}", "not UTF-8 text"),
                                          (b'{"status": "compl', "not valid JSON")])
def test_a_damaged_summary_is_named_by_run_and_by_compare(tiny_manifest, tmp_path, content, why):
    path = tiny_manifest()
    summary = tmp_path / "out" / "default" / "summary.json"
    summary.parent.mkdir(parents=True)
    summary.write_bytes(content)
    assert why in refused(run(path, tmp_path), str(summary))
    assert why in refused(run_cli("compare", str(tmp_path / "out")), str(summary))
    assert summary.read_bytes() == content  # refused, not overwritten


@pytest.mark.parametrize("name, content, why", [
    ("summary.json", b"[1, 2]\n", "a JSON list, not an object"),
    ("summary.json", b"\xff\xfe{}", "not UTF-8 text"),
    ("summary.json", b'{"status": "failed", "error": 42}', "'error' is a number, not a string"),
    ("summary.json", b'{"status": "failed", "diagnosis": "oom"}', "'diagnosis' is a string, not an object"),
    ("warnings.log", b"\xff\xfe\x00\x01", None),
])
def test_doctor_names_a_damaged_run_file(tmp_path, name, content, why):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"status": "failed", "steps": 3, "error": "RuntimeError: x"}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "train_loss": 2.0, "grad_norm": 1.0}) + "\n")
    (run_dir / name).write_bytes(content)
    for json_out in ((), ("--json",)):
        result = run_cli("doctor", str(run_dir), *json_out, timeout=60)
        if why is not None:
            assert why in refused(result, str(run_dir / name)) and result.stdout == ""
            continue
        # The warnings are an aside: the diagnosis goes on without them, and says so once.
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        (line,) = [line for line in result.stderr.splitlines() if line.startswith("lmlab: warning:")]
        assert str(run_dir / name) in line and "left out" in line
        assert "health:" in result.stdout if not json_out else json.loads(result.stdout)["warnings"] is None


def test_a_sweep_index_that_is_not_an_object_is_named_by_compare(tmp_path):
    (tmp_path / "runs" / "v").mkdir(parents=True)
    (tmp_path / "runs" / "v" / "summary.json").write_text(json.dumps({"status": "completed", "val_loss": 1.0}))
    (tmp_path / "runs" / "sweep.json").write_text("[1]")
    refused(run_cli("compare", str(tmp_path / "runs")), str(tmp_path / "runs" / "sweep.json"))


def test_an_out_that_is_a_file_is_refused(tiny_manifest, tmp_path):
    path = tiny_manifest()
    (tmp_path / "afile").write_text("x")
    refused(run_cli("run", str(path), "--out", str(tmp_path / "afile")), str(tmp_path / "afile"))
    line = refused(run_cli("run", str(path), "--out", str(tmp_path / "afile" / "runs")),
                   str(tmp_path / "afile" / "runs"))
    assert f"{tmp_path / 'afile'} is a file" in line


def test_an_out_that_cannot_be_written_is_refused(tiny_manifest):
    from pathlib import Path

    # /proc takes no folders from anyone, root included (CI runs as root, and root writes into
    # folders whose mode forbids it, so a chmod-ed folder would test nothing there).
    out = Path("/proc") / "lmlab-runs" / "runs"
    line = refused(run_cli("run", str(tiny_manifest()), "--out", str(out)), str(out))
    assert "/proc cannot be written to" in line
    assert not out.parent.exists()


def test_a_run_folder_without_its_tokenizer_is_named(run_copy):
    import shutil

    shutil.rmtree(run_copy / "tokenizer")
    line = refused(run_cli("generate", str(run_copy), "--prompt", "a"), str(run_copy / "tokenizer"))
    assert "is missing" in line


def test_a_sweep_too_large_to_expand_is_refused_at_once(tiny_manifest):
    axis = list(range(1, 10_001))
    path = tiny_manifest(f'\n[sweep]\n"train.max_steps" = {axis}\n"train.batch_size" = {axis}\n')
    line = refused(run_cli("check", str(path), "-q", timeout=60), "sweep")
    assert "100,000,000 variants" in line


def test_data_smaller_than_one_window_is_refused_before_training(tiny_manifest, tmp_path):
    path = tiny_manifest()
    (path.parent / "tiny.txt").write_text("abcabcabcabc")  # 12 characters; block_size is 16
    line = refused(run(path, tmp_path), "model.block_size")
    assert "fewer than a window" in line
    assert not (tmp_path / "out" / "default").exists()  # nothing claimed, nothing left behind


@pytest.mark.parametrize("override, key", [
    ("data.encoding=rot13", "data.encoding"),       # a codec, but not of text
    ("seed=1099511627776", "seed"),                 # 2**40: seeding takes 32 bits
    ("optimizer.lr=inf", "optimizer.lr"),           # non-finite numbers are never settings
    ("optimizer.lr=nan", "optimizer.lr"),
    ("model.n_layers=100000000000", "model.n_layers"),
])
def test_values_no_run_could_use_are_refused_by_check_and_by_run(tiny_manifest, tmp_path, override, key):
    path = tiny_manifest()
    refused(run_cli("check", str(path), "--set", override), key)
    refused(run(path, tmp_path, "--set", override), key)
    assert not (tmp_path / "out" / "default").exists()


def test_an_accelerator_the_machine_lacks_is_refused_before_any_folder_is_written(tiny_manifest, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    path = tiny_manifest('\n[parallel]\nuse = "ddp"\naccelerator = "gpu"\ndevices = 4\n')
    result = run(path, tmp_path)
    refused(result, "parallel.accelerator")
    assert not (tmp_path / "out" / "default").exists()
    assert "summary.json" not in result.stderr  # no claim of files that were never written


def test_a_sample_prompt_the_tokenizer_cannot_encode_is_refused_before_training(tiny_manifest, tmp_path):
    path = tiny_manifest()
    line = refused(run(path, tmp_path, "--set", "train.sample_prompt=€"), "train.sample_prompt")
    assert "'€'" in line
    assert not (tmp_path / "out" / "default").exists()


def test_a_sample_prompt_the_tokenizer_cannot_encode_is_refused_by_check_and_stops_a_sweep_before_it_trains(
        tiny_manifest, tmp_path):
    path = tiny_manifest('\n[sweep]\nseeds = [1, 2]\n')
    line = refused(run_cli("check", str(path), "-q", "--set", "train.sample_prompt=€"), "train.sample_prompt")
    assert "'€'" in line and "(variant seed=1)" in line
    result = run(path, tmp_path, "--set", "train.sample_prompt=€")
    assert refused(result, "train.sample_prompt") == line  # bad input is exit 2 in a sweep too
    assert "refused" not in result.stderr and not (tmp_path / "out").exists()  # no variant started


def test_a_plugin_named_twice_in_a_many_valued_slot_is_refused(tiny_manifest, tmp_path):
    path = tiny_manifest('\n[monitor]\nuse = ["loss-spike", "grad-norm", "loss-spike"]\n')
    assert "'loss-spike' twice" in refused(run_cli("check", str(path)), "monitor.use")
    refused(run(path, tmp_path), "monitor.use")
    assert not (tmp_path / "out").exists()


def test_a_closing_sample_that_fails_never_stops_a_sweep(tiny_manifest, tmp_path, monkeypatch, capsys):
    import lmlab.sampling

    def broken(*args, **kwargs):
        raise RuntimeError("decoder exploded")

    monkeypatch.setattr(lmlab.sampling, "generate_text", broken)
    path = tiny_manifest('\n[sweep]\nseeds = [1, 2]\n')
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert err.count("the closing sample failed (RuntimeError: decoder exploded)") == 2
    for seed in (1, 2):
        assert json.loads((tmp_path / "out" / f"seed={seed}" / "summary.json").read_text())["status"] == "completed"


def test_a_diverging_run_fails_and_its_summary_stays_valid_json(tiny_manifest, tmp_path):
    # A finite but absurd learning rate: the loss becomes NaN within a few steps.
    path = tiny_manifest()
    result = run(path, tmp_path, "--set", "optimizer.lr=1e30", "--set", "train.grad_clip=0")
    assert result.returncode == 1, result.stderr[-2000:]
    assert "training diverged" in result.stderr
    run_dir = tmp_path / "out" / "default"
    summary = json.loads((run_dir / "summary.json").read_text(),
                         parse_constant=lambda c: pytest.fail(f"summary.json holds {c}"))
    assert summary["status"] == "failed" and "diverged" in summary["error"]
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line, parse_constant=lambda c: pytest.fail(f"metrics.jsonl holds {c}"))
        assert all(v is None or not isinstance(v, float) or math.isfinite(v) for v in record.values())


@pytest.mark.parametrize("text, block_size", [("abc", 16), ("abc" * 50, 16), ("abc" * 50, 64)])
def test_data_shorter_than_one_window_is_refused_naming_the_block_size_and_leaves_nothing(tmp_path, text,
                                                                                        block_size):
    """Too short for a window, whether found before the tokenizer is fitted (which would otherwise fail
    first on a character only the validation part holds) or once the tokens are counted: one line naming
    model.block_size, and no runs folder, sweep.json included."""
    from conftest import tiny_toml

    (tmp_path / "short.txt").write_text(text)
    path = tmp_path / "short.toml"
    path.write_text(tiny_toml("short.txt").replace("block_size = 16", f"block_size = {block_size}"))
    line = refused(run(path, tmp_path), "model.block_size")
    assert f"block_size + 1 = {block_size + 1}" in line
    assert not (tmp_path / "out").exists()
