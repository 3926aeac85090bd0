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


def test_an_out_that_cannot_be_written_is_refused(tiny_manifest, tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    refused(run_cli("run", str(tiny_manifest()), "--out", str(locked / "runs")), str(locked / "runs"))


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
